"""What a host saves and when (a mixin of `HostNode`, gonka_node/host/node.py, which owns the
attributes declared here): the snapshot of each adopted model, a trained round before its upload, and
the files a rig's processes read. The large saves are written by the host's writer thread
(host/writer.py) beside the next round's training, each with the state as of when it was asked for.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from gonka_node.host.follow import GlobalModel
from gonka_node.host.recovery import UploadRecovery
from gonka_node.host.rig_round import RigRounds
from gonka_node.host.sealing import Trained
from gonka_node.host.settings import HostSettings
from gonka_node.host.store import Progress, RollbackPoint
from gonka_node.host.writer import StoreWriter, Written
from training.codecs import Spec, get_codec
from training.worker import commitment_root


class HostSaves(UploadRecovery):
    settings: HostSettings
    writer: StoreWriter
    _spec: Spec

    def _save(self, gm: GlobalModel, progress: Progress) -> Written:
        """The snapshot of the held model, progress and worker state, as of now, written behind (`writer`):
        the worker state is linked from the kept round's file that holds it, when one does."""
        progress.round_done, progress.model_sha256, progress.shards = gm.round_done, gm.sha256.hex(), gm.shards
        progress.outer_steps = gm.outer.steps if gm.outer is not None else -1
        record, params = copy.deepcopy(progress), dict(gm.params)
        buffers = dict(gm.outer.buffers) if gm.outer is not None else None
        state, wait = self._state_now()
        state_file = self._state_file
        written = self.writer.submit(f"the snapshot after round {gm.round_done}", lambda: self.store.save(
            record, params, buffers, state, state_file))
        if wait:
            written.wait()
        return written

    def _state_now(self) -> tuple[Mapping[str, Any], bool]:
        """(the worker state as of now, for a save written behind; whether the daemon must wait for that
        save): a `fresh` epoch's or a rig's snapshot copies nothing large (the residuals are replaced,
        never written in place; a rig's state is a version's name); a `carry` epoch's AdamW moments are
        updated in place by the next round, so its save is waited for rather than copied (two models)."""
        if self.recipe.round_state == "fresh" or isinstance(self.rounds, RigRounds):
            return self.rounds.snapshot(), False
        return self.rounds.state_dict(), True

    def _global_file(self, gm: GlobalModel, progress: Progress) -> Path:
        """The held global model as a file (what a rig's processes read): the store's snapshot, saved
        first if the model moved on since (a catch-up over several rounds saves only at the end)."""
        self.writer.flush()
        path = self.store.global_path(gm.round_done)
        if (progress.round_done, progress.model_sha256) != (gm.round_done, gm.sha256.hex()) or not path.exists():
            self._save(gm, progress).wait()
        return path

    def _keep(self, result: Trained, before: RollbackPoint | None = None) -> RollbackPoint | None:
        """Save the trained round durably before its upload starts (`HostStore.save_sent`); an overlapped
        top-k host keeps the previous round's state too, which that round's challenge opens, and `before`,
        the state the round trained from (its rollback point, returned as now kept on disk)."""
        state = self.rounds.state_dict()
        root = self.residual_roots[result.round] = self._signed_root(result, state)
        self.store.save_sent(result.round, result.payload, root, state, keep_previous=self._opens_kept_state,
                             before=before)
        self._state_file = self.store.sent_state_path(result.round)
        return None if before is None else RollbackPoint(before.state, self.store.before_path(result.round))

    def _keep_behind(self, result: Trained, before: RollbackPoint | None) -> tuple[Written, RollbackPoint | None]:
        """`_keep` on the writer's thread, beside the next round's training (an overlapped host): the
        round's upload waits for it (`PendingUpload`'s `kept`). The state is taken as of now; the files
        it links (`before`'s, the previous round's) are written by saves asked for before it."""
        state, wait = self._state_now()
        keep_previous = self._opens_kept_state

        def save() -> None:
            # the root too is hashed here, off the training path; the upload that signs it waits for this
            root = self.residual_roots[result.round] = self._signed_root(result, state)
            self.store.save_sent(result.round, result.payload, root, state, keep_previous=keep_previous,
                                 before=before)

        written = self.writer.submit(f"round {result.round}'s save before its upload", save)
        if wait:
            written.wait()
        self._state_file = self.store.sent_state_path(result.round)
        return written, None if before is None else RollbackPoint(before.state, self.store.before_path(result.round))

    def _signed_root(self, result: Trained, state: Mapping[str, Any]) -> bytes:
        """The root the round's payload is signed with: the worker's (a rig's), or hashed here over the
        residual in the state kept with it (a one-process host's worker leaves it to the save: `LocalRounds`)."""
        if result.residual_root is not None:
            return result.residual_root
        return commitment_root(state["feedback"]["residual"], self._spec, get_codec(self.recipe.codec))

    def _base_file(self, base: Mapping[str, Tensor]) -> Path:
        """An eager forecast as a file (what a rig's processes read; rebuilt from public inputs after a
        restart, so not kept durably)."""
        # A rig's next order drops the versions it no longer needs: the snapshot naming the one it keeps
        # must be on disk first, as `_global_file` waits for it (a crash would find no state to resume).
        self.writer.flush()
        path = self.settings.state_dir / "eager-base.safetensors"
        save_file({n: t.detach().contiguous().cpu() for n, t in base.items()}, str(path))
        return path
