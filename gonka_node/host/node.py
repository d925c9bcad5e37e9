"""The host daemon's loop: sign in, then for each round follow the global model, train, submit, wait.

Crash safety: progress is saved after every applied round (`HostStore`), and a trained round (its
payload, signed residual root and the worker state it left) before its upload starts. Both are written
by the host's writer thread (host/writer.py) beside the next round's training: the upload waits for its
round's save, and a snapshot not yet on disk at a crash leaves the one before it, which a restart
follows the chain from (as it follows from any snapshot). A restarted node
reloads the progress, adopts a kept round the aggregator holds (`_recover_upload`: the round is not
trained again, and the residual it opens if challenged is the one whose root it signed), follows the
chain to the current round and carries on. A round whose submission is refused (late, wrong round)
leaves no trace: the inner optimizer and the error-feedback residual go back to their state before that
round, so nothing the aggregator never saw leaks into the next payload.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from chain.client import ChainClient
from chain.errors import BeaconNotReady
from chain.units import format_gnk
from gonka_node.core.client import AggregatorClient
from gonka_node.core.keys import NodeKeys
from gonka_node.core.recipe import Recipe, RecipeError, check_network_overlap
from gonka_node.host.challenge import Challenges
from gonka_node.host.events import HostEvents, LogEvents
from gonka_node.host.follow import (
    GlobalModel,
    NextModel,
    adopt,
    follow_to,
    speculate,
)
from gonka_node.host.forecast import Forecast, Forecasts, LatePlan
from gonka_node.host.rig_round import LocalRounds, RigError, Rounds, host_rounds
from gonka_node.host.sealing import SealedRound
from gonka_node.host.settings import ChainHashes, HostError, HostSettings
from gonka_node.host.store import HostStore, Progress, RollbackPoint
from gonka_node.host.upload import PendingUpload
from gonka_node.host.writer import StoreWriter, WriteError
from proto.gonka.v1 import aggregator_pb2 as pb
from training.checkpoint import canonical_sha256
from training.diloco import OuterOptimizer, SpeculativeStep
from training.model import build_model
from training.overlap import base_round, next_overlapped_round
from training.worker import Assignment, DiLoCoWorker, Rebase, WorkerRound

log = logging.getLogger(__name__)


class _TrainAgain(Exception):
    """An eager round's merge found the upload before it refused: the round is trained again from the
    held model as it was (`HostNode._train_overlapped`)."""


class HostNode(Forecasts):
    challenges_type: type[Challenges] = Challenges  # what answers the challenges (a test's may differ)

    def __init__(
        self,
        settings: HostSettings,
        recipe: Recipe,
        chain: ChainClient,
        aggregator: AggregatorClient,
        keys: NodeKeys,
        events: HostEvents | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settings, self.recipe, self.chain, self.aggregator, self.keys = (
            settings, recipe, chain, aggregator, keys,
        )
        self.events = events or LogEvents()
        self.sleep = sleep
        self.store = HostStore(settings.state_dir, settings.epoch)
        # the snapshots and an overlapped host's kept rounds are written here, beside the next round's
        # training (gonka_node/host/writer.py); the daemon waits for them before it steps the held model
        # in place (`_follow`), before a rig reads the snapshot (`_global_file`) and before it returns
        self.writer = StoreWriter()
        self.host_bytes = bytes.fromhex(keys.evm_address[2:])
        # round → the root of the residual its training left (`WorkerRound.residual_root`), signed with
        # its payload; a round trained again (a refusal, a restart) records its new root
        self.residual_roots: dict[int, bytes] = {}
        # round -> the worker state before it (a rollback point), kept in a top-k epoch until the round's
        # checks are known: a payload that FAILED them is no submission, and its residual is undone
        # (docs/PROTOCOL.md "Challenge and opening", e_{r−1})
        self._before_round: dict[int, Mapping[str, Any]] = {}
        # the file under the store's sent/ that holds the worker's current state (None: none does, e.g.
        # once a round trained): what an overlapped round's rollback point is linked to instead of
        # written again
        self._state_file: Path | None = None
        # (round, the next round's outer step from the held model after it, taken ahead of its update):
        # the adopted model's `next_step`, which an eager forecast writes over and the next upload thread
        # finishes (with a sparse broadcast: `_speculates`)
        self._next_step: tuple[int, SpeculativeStep] | None = None
        self._own: WorkerRound | SealedRound | None = None  # an eager host's last round, until its forecast
        self._applied = 0  # rounds adopted by the overlapped loop, a merge's in the middle of a round included

    # ---- sign-in ----------------------------------------------------------------------------------

    def ensure_joined(self) -> int:
        """Sign in to the epoch with stake and node key unless already signed in; returns the slot."""
        epoch = self.settings.epoch
        info = self.chain.host_info(epoch, self.keys.evm_address)
        if info.joined and not info.left:
            if info.node_key != self.keys.node_public_key:
                raise HostError(
                    f"{self.keys.evm_address} is signed in to epoch {epoch} with another node key "
                    f"({info.node_key.hex()[:16]}…); use that key or another account"
                )
            return info.slot
        slot = self.chain.join(epoch, self.settings.stake, self.keys.node_public_key)
        self.events.note(f"signed in to epoch {epoch} with {format_gnk(self.settings.stake)} stake, slot {slot}")
        return slot

    # ---- start / resume ---------------------------------------------------------------------------

    def _outer(self) -> OuterOptimizer:
        return OuterOptimizer(self.recipe.outer_lr, self.recipe.outer_momentum)

    def _rounds(self, assignment: Assignment) -> Rounds:
        """A rig (`RigRounds`, started last in `_prepare`) or the daemon's own process (`LocalRounds`)."""
        rig = self.settings.rig_options() if self.settings.uses_rig() else None
        try:
            return host_rounds(self.recipe, assignment, self.settings.cache_dir, rig, self.settings.state_dir / "rig",
                               keep_previous=self._rolls_back)
        except RigError as exc:
            raise HostError(str(exc)) from exc

    def _prepare(self) -> tuple[GlobalModel, Progress]:
        epoch = self.chain.get_epoch(self.settings.epoch)
        spec = epoch.spec
        self.recipe.check_against_chain(spec)
        try:
            check_network_overlap(self.recipe)
        except RecipeError as exc:
            raise HostError(str(exc)) from exc
        self.n_rounds = spec.n_rounds
        slot = self.ensure_joined()
        beacon = self._assignment_beacon()
        self.rounds = self._rounds(Assignment(self.recipe.epoch_seed, slot, spec.max_hosts, beacon))
        if isinstance(self.rounds, LocalRounds):  # its forecast reads its payload's entries, not the bytes
            self.rounds.sparse = self.recipe.overlap == "eager" and self._speculates
            # the next round starts from the step's +0 part: each seal runs beside its first steps (a `carry`
            # epoch's save reads the AdamW state the next round updates in place: sealed on the path)
            self.rounds.seal_behind = self.recipe.overlap == "eager" and self.recipe.forecast_step > 0 \
                and self.recipe.round_state == "fresh"
            self.rounds.on_sealed = self._round_sealed
        self.rounds.skipped = ChainHashes(self.chain, self.settings.epoch).skipped  # a streamed round's landing
        snap = self.store.load()
        if snap is not None and snap.progress.epoch == self.settings.epoch:
            progress = snap.progress
            outer = None
            if progress.outer_in_sync:
                outer = self._outer()
                outer.restore(progress.outer_steps, snap.outer_buffers or {})
            if snap.worker_state is not None:
                try:
                    self.rounds.load_state_dict(snap.worker_state)
                except RigError as exc:
                    raise HostError(f"{self.store.root}: {exc}") from exc
            gm = GlobalModel(snap.global_params, bytes.fromhex(progress.model_sha256), progress.round_done, outer,
                             self.recipe.shards)
            self.events.note(f"resumed at round {progress.round_done} from {self.store.root}")
            if self._recover_uploads(progress):
                self._save(gm, progress)
            self.rounds.start()
            return gm, progress
        # The daemon's copy of the global model: a model of its own (a rig trains in other processes).
        model = build_model(self.recipe.model, self.recipe.init_seed)
        params = {n: p.detach() for n, p in model.named_parameters()}
        sha = bytes.fromhex(canonical_sha256(params))
        if sha != spec.init_checkpoint_hash:
            raise HostError(
                f"the recipe's initial model hashes to {sha.hex()}, the epoch records "
                f"{spec.init_checkpoint_hash.hex()}"
            )
        progress = Progress(self.settings.epoch, slot, 0, sha.hex())
        resumed = self._recover_uploads(progress)
        gm = GlobalModel(params, sha, 0, self._outer(), self.recipe.shards)
        if resumed:
            self._save(gm, progress)
        self.rounds.start()
        return gm, progress

    def _assignment_beacon(self) -> bytes:
        """The randomness the recipe's assignment waits for ("signin-block": exists once sign-in closed)."""
        if self.recipe.assignment_seed != "signin-block":
            return b""
        said = False
        while True:
            try:
                return self.chain.signin_beacon(self.settings.epoch)
            except BeaconNotReady:
                if not said:
                    self.events.note("waiting for sign-in to close: the data assignment is drawn from the "
                                     "first block after it")
                    said = True
                self.sleep(self.settings.poll_s)

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> Progress:
        gm, progress = self._prepare()
        self._spec = {name: tuple(t.shape) for name, t in gm.params.items()}
        self._busy_until = time.monotonic()  # when the host last finished training (utilisation)
        self._prefetched: dict[int, bytes] = {}  # round -> its aggregated update, fetched by the upload thread
        self._ahead: NextModel | None = None  # the next global model, computed by the upload thread
        try:
            if self.recipe.overlap in ("delayed", "eager"):
                progress = self._loop_overlapped(gm, progress)
            else:
                progress = self._loop(gm, progress)
            self.writer.close()  # every save on disk before the host says it is done
            return progress
        except BaseException as exc:  # the error already on its way is the one to report
            try:
                self.writer.close()
            except WriteError:
                if not isinstance(exc, WriteError):
                    log.exception("a save written behind failed too")
            raise
        finally:
            self.rounds.close()

    def _loop(self, gm: GlobalModel, progress: Progress) -> Progress:
        hashes = ChainHashes(self.chain, self.settings.epoch)
        applied = 0
        while True:
            latest = self.chain.latest_round(self.settings.epoch)
            if latest >= self.n_rounds:
                self._catch_up(gm, latest, hashes, progress)
                self._save(gm, progress)
                self.events.note(f"epoch {self.settings.epoch} finished after {latest} rounds")
                return progress
            info = self._open_round()
            if info is None:
                self._undone_forgets_state_file(functools.partial(self.challenges.await_closing, latest + 1, progress),
                                                progress)
            if info is None or info.round <= gm.round_done:
                self.sleep(self.settings.poll_s)
                continue
            if info.round - 1 > latest:  # the aggregator is ahead of what our chain view shows yet
                self.sleep(self.settings.poll_s)
                continue
            self._catch_up(gm, info.round - 1, hashes, progress)
            if gm.sha256 != bytes(info.base_checkpoint_sha256):
                raise HostError(
                    f"round {info.round}: the aggregator's base {bytes(info.base_checkpoint_sha256).hex()[:16]}… "
                    f"differs from the chain's {gm.sha256.hex()[:16]}…"
                )
            submitted_at = time.monotonic()
            progress.max_chunk_bytes = int(info.limits.max_chunk_bytes)  # a restarted host's opening's chunks
            if str(info.round) not in progress.submitted:
                self._train_and_submit(self._local_worker(), gm, info, progress)
                submitted_at = time.monotonic()
            if str(info.round) in progress.submitted:
                self._undone_forgets_state_file(functools.partial(self.challenges.await_verdict, info, progress), progress)
            else:
                self._wait_finalized(info.round)
            how = self._follow(gm, info.round, hashes, progress)
            reward = self._reward(info.round)
            progress.rewards[str(info.round)] = reward
            self._save(gm, progress)
            self.events.round_applied(info.round, how, gm.sha256, reward, time.monotonic() - submitted_at)
            applied += 1
            if self.settings.stop_after_rounds is not None and applied >= self.settings.stop_after_rounds:
                return progress

    def _follow(self, gm: GlobalModel, target: int, hashes: ChainHashes, progress: Progress | None = None) -> str:
        epoch = self.settings.epoch
        self.writer.flush()  # a snapshot written behind holds the model's tensors, which follow_to steps in place

        def fetch(what: str, round_: int, call: Callable[[], bytes]) -> bytes:
            data = self._patiently(what, call)
            if progress is not None:
                progress.bytes_received += len(data)
            self.events.downloaded(round_, len(data))
            return data

        return follow_to(
            gm,
            target,
            hashes,
            lambda r: self._prefetched.pop(r, None) or fetch(
                f"round {r}'s update", r, lambda: self.aggregator.round_update(epoch, r).data
            ),
            lambda r: fetch(f"round {r}'s checkpoint", r, lambda: self.aggregator.checkpoint(epoch, r).data),
            self._update_of,
        )

    def _catch_up(self, gm: GlobalModel, target: int, hashes: ChainHashes, progress: Progress) -> str:
        """Follow to `target`, recording the reward and upload of every round passed over on the way: a
        host killed after its upload was accepted, and restarted once that round closed, was still paid
        for it, and its bytes were sent."""
        passed = range(gm.round_done + 1, target + 1)
        how = self._follow(gm, target, hashes, progress)
        for r in passed:
            self._record_round(r, progress)
        return how

    def _record_round(self, r: int, progress: Progress) -> None:
        if str(r) in progress.rewards:
            return
        mine = self._contribution(r)
        progress.rewards[str(r)] = int(mine.reward) if mine is not None else 0
        if mine is not None and str(r) not in progress.submitted:
            progress.bytes_sent += int(mine.payload_length)

    def _local_worker(self) -> DiLoCoWorker | None:
        return self.rounds.worker if isinstance(self.rounds, LocalRounds) else None

    def _train_and_submit(
        self, worker: DiLoCoWorker | None, gm: GlobalModel, info: pb.RoundInfo, progress: Progress
    ) -> None:
        """Train the round and upload it. `worker`: the one-process worker (None on a rig), what a
        subclass that replaces the honest round works with (`gonka_node.testing.adversary`); this one goes
        through `self.rounds`, which holds the same worker."""
        before = self.rounds.snapshot()
        result = self._train(info.round, gm, progress)
        self._keep(result)
        started = time.monotonic()
        accepted, reason = self._submit(info, result.payload, result.tokens)
        self.events.submitted(info.round, accepted, reason, time.monotonic() - started)
        if accepted:
            self._record_accepted(info.round, result.payload, progress)
            if self._challengeable:
                self._before_round[info.round] = before
        else:
            self.rounds.load_state_dict(before)
            self._state_file = None

    def _train(
        self, round_: int, gm: GlobalModel, progress: Progress, base: Mapping[str, Tensor] | None = None,
        rebases: Sequence[Rebase] = (), begin: Callable[[], None] = lambda: None,
    ) -> WorkerRound | SealedRound:
        """Train `round_` from the held global model (or `base`: an eager host's forecast); records the
        round's share of wall time in inner steps (since the previous round's training ended: waiting,
        uploading and following count)."""
        total = self.recipe.inner_steps

        def on_step(step: int, loss: float) -> None:
            if step == 1:
                begin()  # what the round's first steps hide may start (the round holds its start now)
            self.events.inner_step(round_, step, total, loss)

        def params_file() -> Path:
            return self._global_file(gm, progress) if base is None else self._base_file(base)

        self._state_file = None  # the state trained on is no file's any more
        try:
            result = self.rounds.train_round(round_, gm.params if base is None else base, params_file, on_step, rebases)
        except RigError as exc:
            raise HostError(str(exc)) from exc
        if isinstance(result, WorkerRound):  # else told once sealed (`_round_sealed`)
            self._round_sealed(result)
        if result.residual_root is not None:  # else hashed where the round is saved (`HostSaves._keep`)
            self.residual_roots[round_] = result.residual_root
        now = time.monotonic()
        wall, self._busy_until = max(now - self._busy_until, result.seconds), now
        progress.utilisation[str(round_)] = [round(result.seconds, 4), round(wall, 4)]
        self.events.utilisation(round_, result.seconds, wall)
        return result

    def _round_sealed(self, r: WorkerRound) -> None:
        self.events.round_trained(r.round, r.last_loss, r.tokens, r.seconds, len(r.payload))

    # ---- overlapped rounds (recipe overlap = "delayed" or "eager", training/overlap.py) ------------

    def _loop_overlapped(self, gm: GlobalModel, progress: Progress) -> Progress:
        """Round r trains from the model after round r − 2, so the host trains round r + 1 while round
        r uploads and closes. The held model advances only between trainings (the worker reads it to
        form the pseudo-gradient), and the upload of round r is joined after round r + 1 trained."""
        hashes = ChainHashes(self.chain, self.settings.epoch)
        trained = max((int(r) for r in progress.submitted), default=0)
        pending: PendingUpload | None = None
        eager = self.recipe.overlap == "eager"
        self._applied = 0
        # No round is undone from the challenge's thread when its checks fail (`Challenges._forget_failed`):
        # the next round has compressed on top of it by then; `_train_overlapped` undoes it instead.
        self._before_round.clear()
        undo: RollbackPoint | None = None  # the worker state before the round uploading (`pending`)
        restarted = self.challenges.answer_restarted(progress, self.chain.latest_round(self.settings.epoch))
        try:
            while True:
                latest = self.chain.latest_round(self.settings.epoch)
                if latest >= self.n_rounds:
                    self._settle(pending, progress, closed=True)
                    pending = None
                    self._catch_up(gm, latest, hashes, progress)
                    self._save(gm, progress)
                    self.events.note(f"epoch {self.settings.epoch} finished after {latest} rounds")
                    return progress
                r = next_overlapped_round(trained, latest, gm.round_done)
                base = base_round(r, self.recipe.overlap)
                if r > self.n_rounds or latest < base:  # the epoch's last round is trained / base not final
                    self.sleep(self.settings.poll_s)
                    continue
                if gm.round_done < base:
                    self._apply(gm, base, hashes, progress)
                    self._applied += 1
                stopping = self.settings.stop_after_rounds is not None and self._applied >= self.settings.stop_after_rounds
                # A forecast writes over the step the released upload thread finishes: first (late: partway)
                late = eager and self.recipe.forecast_step > 0 and not stopping
                forecast = self._forecast(r, gm, pending, progress) if eager and not late and not stopping else None
                release = self._releaser(gm, pending)
                if not late:
                    release()
                if stopping:
                    self._settle(pending, progress)
                    pending = None
                    return progress
                trained_from = gm.sha256  # the round's base: a merge moves the held model on during the training
                result, undo = self._train_overlapped(r, gm, progress, pending, undo, forecast, hashes, release)
                release()  # once per upload: a round that never reached its forecast's step did not
                forecast = None  # a model's worth, not needed past the training (the next thread's peak)
                kept, undo = self._keep_behind(result, undo)  # the upload waits for it, the next round does not
                if progress.round_done != gm.round_done:  # a merge adopted the model after r − 1: saved with round r
                    self._save(gm, progress)
                self._own = result if eager and self._speculates else None  # the next forecast reads its entries
                # Round r's upload starts now (a round sealed behind: once its seal and save are done); the
                # previous one had a whole round of compute to finish (its round closed before round r opens,
                # so the two never stream at once).
                upload = PendingUpload(
                    r, trained_from, result.payload if isinstance(result, WorkerRound) else result.read_payload,
                    result.tokens, self._open_round,
                    self._submit_checked if eager or self._challengeable
                    else lambda info, payload, tokens, _cancelled: self._submit(info, payload, tokens),
                    self.settings.poll_s,
                    functools.partial(self._update_bytes, r), functools.partial(self._step_ahead, gm, r),
                    self.challenges.answerer(r, pending, progress),
                    functools.partial(speculate, gm, r) if self._speculates else None, kept,
                    take_after=eager and self._speculates,  # the next round's +0 step, before the update
                ).start()
                self._settle(pending, progress)
                pending, trained = upload, r
        finally:
            if restarted is not None:
                restarted.set()
            if pending is not None:
                pending.cancel()
                pending.wait()

    def _train_overlapped(
        self, r: int, gm: GlobalModel, progress: Progress, pending: PendingUpload | None, undo: RollbackPoint | None,
        forecast: Forecast | None = None, hashes: ChainHashes | None = None, release: Callable[[], None] = lambda: None,
    ) -> tuple[WorkerRound | SealedRound, RollbackPoint | None]:
        """Train round r while round r − 1 (`pending`) uploads, the held model being the one after r − 2;
        an eager host trains from its forecast with round r − 1's payload (training/overlap.py; `forecast`:
        taken already, by `_forecast`). If the aggregator then
        refuses round r − 1 (or it FAILED its checks: a top-k or eager host waits for their verdict), round
        r is trained again from what the aggregator's replay of it assumes: no payload of ours to forecast
        with (eager), and in a top-k epoch the residual before round r − 1 (`undo`, the worker state round
        r − 1 trained from), since round r's opening is checked against e_{r−1}'s root of the host's last
        checked round. Returns round r and the state it trained from (the next round's `undo`; None where
        no round is ever trained again from further back: a dense codec, or a `carry` epoch, never
        challenged). A top-k host a round behind (its round r − 1 skipped: `pending` is an older round,
        refused LATE) rolls back the same way: `undo` is the state before `pending`'s round either way."""
        eager, uploading = self.recipe.overlap == "eager", pending is not None and pending.round == r - 1
        # A fresh top-k epoch's snapshot shares the residuals and copies no AdamW state (each round restarts it).
        before = RollbackPoint(self.rounds.snapshot(), self._state_file) if self._rolls_back or (eager and uploading) \
            else None
        late = eager and forecast is None and self.recipe.forecast_step > 0
        if eager and forecast is None and not late:
            forecast = self._forecast(r, gm, pending, progress)
        plan = self._late_forecast(r, gm, self._own_payload(r, pending, progress), release) if late else \
            LatePlan(None if forecast is None else forecast.base, [], [None if forecast is None else forecast.own])
        keep = before if self._rolls_back else None  # the next round's `undo`
        back = undo if undo is not None else before if eager and uploading else None  # None: nothing to undo

        def again_needed() -> bool:
            return pending is not None and back is not None and not pending.accepted()

        merge = self._merge(r, gm, progress, pending, hashes) if self.recipe.merge_step else None
        try:
            result = self._train(r, gm, progress, plan.start, [*plan.moves, *([] if merge is None else
                                 [merge(again_needed)])], plan.begin)
        except _TrainAgain:  # the merge found the round to be trained again before it moved the held model on
            result = None
        finally:
            plan.cancel()  # a forecast the round never reached is not taken
        if result is not None and not again_needed():
            return result, keep
        assert pending is not None and back is not None
        self.events.note(f"round {r}: round {pending.round}'s upload was refused; training round {r} again "
                         + (f"from round {gm.round_done}'s model (no payload of ours to forecast with)" if eager
                            and uploading else f"from the residual before round {pending.round} (the one the "
                            "aggregator holds)"))
        self.rounds.load_state_dict(back.state)
        self._state_file = back.file
        # Snapshot afresh: the retraining updates in place what `load_state_dict` took from `back`.
        again = RollbackPoint(self.rounds.snapshot(), back.file) if self._rolls_back else None
        own = None if uploading or not plan.forecast_with else plan.forecast_with[0]  # what the aggregator holds
        plan = self._late_forecast(r, gm, None if own is None else lambda: own, release) if late else \
            LatePlan(self._eager_base(r, gm, own) if eager else None, [], [])
        try:
            return self._train(r, gm, progress, plan.start, [*plan.moves, *([] if merge is None else
                               [merge(lambda: False)])], plan.begin), again
        finally:
            plan.cancel()

    def _merge(
        self, r: int, gm: GlobalModel, progress: Progress, pending: PendingUpload | None, hashes: ChainHashes | None,
    ) -> Callable[[Callable[[], bool]], Rebase]:
        """The recipe's merge of an eager round r (training/overlap.py): at `merge_step` the round moves onto
        the model after r − 1, which the daemon adopts there: it settles round r − 1's upload (the update
        and the model computed ahead from it come with it), waits for the chain to finalize r − 1, and
        adopts it as between rounds. A round that must be trained again (`again()`: the upload before it
        refused) is given up there, before the held model moves, which its second training starts from."""
        assert hashes is not None

        def target(again: Callable[[], bool]) -> Mapping[str, Tensor]:
            if pending is not None and pending.round == r - 1:
                self._settle(pending, progress)
            if again():
                raise _TrainAgain()
            if gm.round_done < r - 1:
                self._wait_finalized(r - 1)
                # No snapshot yet: one now would say the model after r − 1 is held with the state of half
                # a round (a restart would then skip round r); it is saved with round r kept (the loop).
                self._apply(gm, r - 1, hashes, progress, save=False)
                self._applied += 1
            return gm.params

        return lambda again: Rebase(self.recipe.merge_step, lambda: target(again))

    def _apply(self, gm: GlobalModel, target: int, hashes: ChainHashes, progress: Progress, save: bool = True) -> None:
        """Bring the held model to `target`: the model the upload thread computed ahead when it is the
        chain's (the outer step and the hash then cost the training path nothing), else follow. `save`:
        the snapshot now (a merge's, in the middle of a round, is saved once the round is kept instead)."""
        started = time.monotonic()
        ahead, self._ahead, self._next_step = self._ahead, None, None
        if ahead is not None and ahead.round == target and adopt(gm, ahead, hashes):
            how = "ahead"
            self._next_step = None if ahead.next_step is None else (target, ahead.next_step)
            self._record_round(target, progress)
        else:
            how = self._catch_up(gm, target, hashes, progress)
        for r in [r for r in self._prefetched if r <= target]:  # updates of rounds held now: needed no more
            del self._prefetched[r]
        if save:
            self._save(gm, progress)
        reward = progress.rewards.get(str(target), 0)
        self.events.round_applied(target, how, gm.sha256, reward, time.monotonic() - started)

    def _settle(self, pending: PendingUpload | None, progress: Progress, closed: bool = False) -> None:
        """Wait for an upload in flight and record its outcome (from the daemon's thread). `closed`: its
        round is over (the epoch ended, the node leaves): stop waiting for what it would fetch next. A
        save written behind that failed stops the daemon here (its upload was not sent), before a round
        is trained again as if the upload had been refused."""
        if pending is None or pending.recorded:  # once: a merge may have settled it during the next round
            return
        pending.recorded = True
        if closed:
            pending.cancel()
        outcome = pending.wait()
        self.writer.check()
        if outcome.update is not None:
            self._prefetched[pending.round] = outcome.update
            progress.bytes_received += len(outcome.update)
            self.events.downloaded(pending.round, len(outcome.update))
        self._ahead = outcome.ahead
        self.events.submitted(pending.round, outcome.accepted, outcome.reason, outcome.seconds)
        if outcome.accepted:
            self._record_accepted(pending.round, pending.payload, progress)

    def _undone_forgets_state_file(self, verdict: Callable[[], None], progress: Progress) -> None:
        """Run a challenge's wait for a round's verdict: a round that failed its checks is undone there
        (`Challenges._forget_failed` takes the worker back to the state before it), and the kept round's
        file then no longer holds the worker's state, so no snapshot may link it (`HostSaves._save`)."""
        submitted = set(progress.submitted)
        verdict()
        if not submitted <= set(progress.submitted):
            self._state_file = None

    def _wait_finalized(self, round_: int) -> None:
        while self.chain.latest_round(self.settings.epoch) < round_:
            self.sleep(self.settings.poll_s)

    # ---- the challenge of a top-k round (docs/PROTOCOL.md "Challenge and opening"; host/challenge.py) --

    @functools.cached_property
    def challenges(self) -> Challenges:
        """Built on first use, once the worker (`_prepare`) and the model's shapes (`run`) exist."""
        return self.challenges_type(
            self.aggregator, self.chain, self.settings, self.recipe, self.host_bytes,
            self.keys.node_key.signing_key, self.store, self.rounds, self._spec, self.events, self.sleep,
            self._open_round, self._before_round, self.residual_roots,
        )
