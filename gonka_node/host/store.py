"""A host's progress on disk, so a killed node resumes where it was.

Layout under the host's state directory:

    progress.json              which snapshot is current, and the round bookkeeping (written last)
    snap-<round>/global.safetensors   the global model after <round> (its chain hash in progress.json)
    snap-<round>/outer.safetensors    the outer momentum the host mirrors (absent when not in sync)
    snap-<round>/worker.pt            the worker state (`DiLoCoWorker.state_dict`): the error-feedback
                                      residuals and the inner step, plus the AdamW moments in a "carry"
                                      epoch (a "fresh" one restarts them every round)
    sent/round-<round>/        a trained round, written before its upload starts (`save_sent`):
        payload.bin            the payload (an eager host forecasts the next round's base with it:
                               training/overlap.py)
        round.json             the residual root signed with it, and the epoch (a state folder outlives
                               its epoch: another epoch's rounds are never read as this one's)
        worker.pt              the worker state after the round (both error-feedback residuals, the
                               step, AdamW only in a "carry" epoch;
                               kept for the newest round only, and for the one before it too on an
                               overlapped top-k host, whose round r is challenged while it trains r + 1):
                               a host killed after the aggregator took the payload resumes from it
                               instead of training the round again, whose residual on a GPU would not be
                               bit for bit the one it signed; a challenge of the round opens it
        before.pt              the worker state the round trained from (an overlapped top-k host only,
                               `RollbackPoint`): a host killed before the aggregator took the payload, or
                               whose payload failed its checks, resumes from it, since the aggregator's
                               e_{r−1} is the residual after the host's last *checked* round; a hard link
                               to the file already holding it where there is one (no second write)

A snapshot folder is complete before `progress.json` names it (each file fsync'd, then the folder,
then an atomic rename of progress.json), so a crash at any point leaves the previous snapshot intact.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from gonka_node.core.fragments import model_root
from training.durable import durable_replace, fsync_path

PROGRESS = "progress.json"
BEFORE = "before.pt"


@dataclass
class Progress:
    epoch: int
    slot: int
    round_done: int  # last round whose result is applied to the held model (0: the initial model)
    model_sha256: str  # the held global model's hash as the chain records it (hex; `shards` below)
    outer_steps: int = 0  # outer steps mirrored locally; -1 once a pulled checkpoint broke the mirror
    submitted: dict[str, str] = field(default_factory=dict)  # round -> payload sha256 accepted
    rewards: dict[str, int] = field(default_factory=dict)  # round -> ngonka earned (from the result)
    bytes_sent: int = 0  # payload bytes of accepted submissions
    bytes_received: int = 0  # aggregated-update bytes downloaded to follow the global model
    # round -> [seconds in inner steps, wall seconds since the previous round's training ended]
    utilisation: dict[str, list[float]] = field(default_factory=dict)
    # the epoch's aggregator shards: model_sha256 is the Merkle root over that many fragments
    # (core/fragments.model_root; 1: the canonical sha256 itself)
    shards: int = 1
    # round -> the residual root (hex) signed with its accepted payload: e_{r−1}'s root in round r's
    # opening is the one of the host's last submitted round (docs/PROTOCOL.md "Challenge and opening")
    residual_roots: dict[str, str] = field(default_factory=dict)
    # the chunk limit (bytes) of the last round this host took part in: a host restarted while its round
    # closes opens with it (0: not known, OPENING_CHUNK)
    max_chunk_bytes: int = 0

    @property
    def outer_in_sync(self) -> bool:
        return self.outer_steps >= 0


@dataclass(frozen=True)
class SentRound:
    """A round as kept before its upload (`HostStore.save_sent`)."""

    round: int
    payload: bytes
    residual_root: bytes
    has_state: bool  # worker.pt is kept (only the newest round's is)


@dataclass(frozen=True)
class RollbackPoint:
    """The worker state a round trained from (`state`), and the file that already holds it, if any
    (`file`: a kept round's `worker.pt` or `before.pt`; files under `sent/` are only ever replaced whole,
    never written in place, so a hard link to one keeps that content)."""

    state: Mapping[str, Any]
    file: Path | None = None


@dataclass
class Snapshot:
    progress: Progress
    global_params: dict[str, Tensor]
    outer_buffers: dict[str, Tensor] | None
    worker_state: dict[str, Any] | None


class HostStore:
    def __init__(self, root: Path, epoch: int | None = None) -> None:
        """`epoch`: the epoch whose kept rounds (`sent/`) this store reads and writes (None: any)."""
        self.root, self.epoch = root, epoch

    def _snap(self, round_done: int) -> Path:
        return self.root / f"snap-{round_done:06d}"

    def global_path(self, round_done: int) -> Path:
        """The saved global model after `round_done` (present once `save` recorded that round)."""
        return self._snap(round_done) / "global.safetensors"

    def load(self) -> Snapshot | None:
        path = self.root / PROGRESS
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            progress = Progress(**raw)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path}: unreadable host progress ({exc}); move it aside to start over") from exc
        snap = self._snap(progress.round_done)
        params = load_file(str(snap / "global.safetensors"))
        # round 0 is the epoch's initial checkpoint, which the chain records by its canonical hash
        if model_root(params, progress.shards if progress.round_done else 1).hex() != progress.model_sha256:
            raise ValueError(f"{snap}/global.safetensors does not hash to {progress.model_sha256}")
        outer = snap / "outer.safetensors"
        worker = snap / "worker.pt"
        return Snapshot(
            progress,
            params,
            load_file(str(outer)) if outer.exists() else None,
            torch.load(worker, weights_only=True) if worker.exists() else None,
        )

    def save(
        self,
        progress: Progress,
        global_params: Mapping[str, Tensor],
        outer_buffers: Mapping[str, Tensor] | None,
        worker_state: Mapping[str, Any] | None,
        state_file: Path | None = None,
    ) -> None:
        """`state_file`: a file under `sent/` that already holds `worker_state` (a kept round's), linked
        rather than written again (a residual is as large as the model)."""
        self.root.mkdir(parents=True, exist_ok=True)
        snap = self._snap(progress.round_done)
        tmp = snap.with_name(snap.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({n: t.detach().contiguous().cpu() for n, t in global_params.items()}, str(tmp / "global.safetensors"))
        if outer_buffers:
            save_file({n: t.contiguous().cpu() for n, t in outer_buffers.items()}, str(tmp / "outer.safetensors"))
        if worker_state is not None:
            _keep_state(RollbackPoint(worker_state, state_file), tmp / "worker.pt")
        for f in tmp.iterdir():
            fsync_path(f)
        shutil.rmtree(snap, ignore_errors=True)
        durable_replace(tmp, snap)
        staged = self.root / (PROGRESS + ".tmp")
        staged.write_text(json.dumps(asdict(progress), indent=2, sort_keys=True))
        durable_replace(staged, self.root / PROGRESS)
        # Older snapshots are no longer named by progress.json.
        for old in self.root.glob("snap-*"):
            if old != snap:
                shutil.rmtree(old, ignore_errors=True)

    def _sent(self, round_: int) -> Path:
        return self.root / "sent" / f"round-{round_:06d}"

    def save_sent(
        self, round_: int, payload: bytes, residual_root: bytes, worker_state: Mapping[str, Any] | None = None,
        keep_previous: bool = False, before: RollbackPoint | None = None,
    ) -> None:
        """Keep `round_` durably before its upload starts: a crash after the aggregator took the payload
        must lose neither the payload (an eager host's next base) nor the state that signed it. Drops
        the rounds before `round_` − 1 and the worker state of every older round (the snapshot, or this
        round's, holds what a restart resumes from), except `round_` − 1's with `keep_previous` (an
        overlapped top-k host: that round may still be challenged, and its residuals are opened from
        it; it is final before `round_` + 1 trains, whose save drops it). `before`: the state the round
        trained from, kept as long as the round (`before.pt`)."""
        folder = self._sent(round_)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "payload.bin").write_bytes(payload)
        (tmp / "round.json").write_text(json.dumps({"residual_root": residual_root.hex(), "epoch": self.epoch}))
        if worker_state is not None:
            torch.save(dict(worker_state), tmp / "worker.pt")  # the tensors themselves: no copy
        if before is not None:
            _keep_state(before, tmp / BEFORE)
        for f in tmp.iterdir():
            fsync_path(f)
        shutil.rmtree(folder, ignore_errors=True)
        durable_replace(tmp, folder)
        for old in (self.root / "sent").glob("round-*"):
            kept = int(old.name.split("-")[1].split(".")[0])
            if kept < round_ - 1 or old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
            elif kept < round_ and not keep_previous:
                (old / "worker.pt").unlink(missing_ok=True)

    def load_sent(self, round_: int) -> SentRound | None:
        """What `save_sent` kept of `round_` (None: nothing kept), without its worker state."""
        folder = self._sent(round_)
        if not (folder / "payload.bin").exists() or not (folder / "round.json").exists() or not self._ours(round_):
            return None  # nothing kept, a folder half deleted by a crash, or another epoch's
        meta = json.loads((folder / "round.json").read_text())
        return SentRound(round_, (folder / "payload.bin").read_bytes(), bytes.fromhex(meta["residual_root"]),
                         (folder / "worker.pt").exists())

    def sent_rounds(self) -> list[int]:
        """The rounds `save_sent` keeps, oldest first."""
        folders = (self.root / "sent").glob("round-*")
        rounds = (int(f.name.split("-")[1]) for f in folders if not f.name.endswith(".tmp"))
        return sorted(r for r in rounds if self._ours(r))

    def _ours(self, round_: int) -> bool:
        """Whether the kept `round_` is of this store's epoch (one kept before epochs were recorded: yes)."""
        meta = self._sent(round_) / "round.json"
        if self.epoch is None or not meta.exists():
            return True
        kept = json.loads(meta.read_text()).get("epoch")
        return kept is None or kept == self.epoch

    def sent_state_path(self, round_: int) -> Path:
        """Where `save_sent` keeps the worker state after `round_`."""
        return self._sent(round_) / "worker.pt"

    def before_path(self, round_: int) -> Path:
        """Where `save_sent` keeps the worker state `round_` trained from (present only if given)."""
        return self._sent(round_) / BEFORE

    def load_sent_before(self, round_: int) -> dict[str, Any] | None:
        """The worker state `round_` trained from, as kept with it (None: not kept)."""
        path = self.before_path(round_)
        return dict(torch.load(path, weights_only=True)) if path.exists() and self._ours(round_) else None

    def load_sent_state(self, round_: int, mmap: bool = False) -> dict[str, Any]:
        """The worker state kept with `round_` (`SentRound.has_state`). `mmap`: mapped, not read (an
        opening touches only its chunks of the residuals; the file must stay until they are used)."""
        return dict(torch.load(self._sent(round_) / "worker.pt", weights_only=True, mmap=mmap))

    def load_payload(self, round_: int) -> bytes | None:
        """The payload `save_sent` kept for `round_` (None: none kept)."""
        path = self._sent(round_) / "payload.bin"
        return path.read_bytes() if path.exists() and self._ours(round_) else None


def _keep_state(point: RollbackPoint, path: Path) -> None:
    """Write `point`'s state to `path`: a hard link to the file that holds it when there is one (a
    residual is as large as the model: a second write of it would cost the round seconds), else saved."""
    if point.file is not None and point.file.exists():
        try:
            os.link(point.file, path)
            return
        except OSError:  # another filesystem, or one without hard links: copy it
            shutil.copyfile(point.file, path)
            return
    torch.save(dict(point.state), path)
