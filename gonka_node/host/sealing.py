"""A round's seal written behind the next round's first steps (an eager recipe's `forecast_step`).

The seal of a round (error-feedback compress of its pseudo-gradient, the payload's kept entries) is CPU
work the size of the model: 12-16 s a round at 1.2B on this machine's 2 cores (docs/benchmarks.md). With
the recipe's `forecast_step` the next round starts from the outer step's all +0 part, which needs no
payload, and moves onto its forecast only after that many steps (training/overlap.py), so the seal runs
in a thread of its own meanwhile: what the daemon reads of the round (its payload, its kept entries, the
worker state after it) waits for the seal where it is read, which is off the training path (the upload
thread, the writer, the forecast taken at that step).

The next round's steps touch the local model and AdamW state only; the seal reads the pseudo-gradient
(computed before it starts, on the path) and replaces the error-feedback residuals. So the worker
state after the round is its inner state as the steps left it, taken when they end, with the residuals
the seal leaves: a state asked for while a seal runs is that (`StateAfterSeal`); one seal runs at a time (`LocalRounds` joins it before the next seal and before
anything that reads or replaces the residuals now).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar, cast

from torch import Tensor

from training.inner import InnerResult
from training.worker import DiLoCoWorker, WorkerRound

T = TypeVar("T")
log = logging.getLogger(__name__)


class SealedRound:
    """A trained round whose seal runs in a thread started here: the figures of its training at once, what
    the seal makes (`payload`, `sparse`, `delta_norm`) when it is done (reading one waits for it; a seal
    that failed raises its error there). Reads like a `WorkerRound` (its `residual_root` is None: the
    daemon hashes the residual where it saves the round)."""

    residual_root: bytes | None = None

    def __init__(self, worker: DiLoCoWorker, round_: int, delta: dict[str, Tensor], result: InnerResult,
                 sparse: bool, on_sealed: Callable[[WorkerRound], None]) -> None:
        self.round, self.tokens, self.seconds = round_, result.tokens, result.seconds
        self.mean_loss, self.last_loss = result.mean_loss, result.last_loss
        self._sealed: WorkerRound | None = None
        self._feedback: Mapping[str, Any] | None = None
        self._error: BaseException | None = None
        self._on_sealed = on_sealed
        self._thread = threading.Thread(target=self._seal, args=(worker, delta, result, sparse),
                                        name=f"seal-round-{round_}", daemon=True)
        self._thread.start()

    def _seal(self, worker: DiLoCoWorker, delta: dict[str, Tensor], result: InnerResult, sparse: bool) -> None:
        try:
            sealed = worker.seal(self.round, delta, result, root=False, sparse=sparse)
            self._feedback = worker.feedback.state_dict()  # the residuals as this seal left them
            self._sealed = sealed
        except BaseException as exc:  # raised where the round is read (`wait`), never lost
            self._error = exc
            return
        try:  # what is told of the round (its log, its metrics) cannot undo it
            self._on_sealed(sealed)
        except Exception:
            log.exception("round %d: reporting its seal failed", self.round)

    def wait(self) -> WorkerRound:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"round {self.round}: its seal failed: {type(self._error).__name__}: "
                               f"{self._error}") from self._error
        assert self._sealed is not None
        return self._sealed

    def join(self) -> None:
        """Wait for the seal's thread, whatever came of it (the host is closing)."""
        self._thread.join()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def read_payload(self) -> bytes:
        return self.wait().payload

    @property
    def payload(self) -> bytes:
        return self.read_payload()

    @property
    def sparse(self) -> dict[str, tuple[Tensor, Tensor]] | None:
        return self.wait().sparse

    @property
    def delta_norm(self) -> float:
        return self.wait().delta_norm

    def feedback_after(self) -> Mapping[str, Any]:
        self.wait()
        assert self._feedback is not None
        return self._feedback


class Beside(Generic[T]):
    """Work for a round's first steps to hide (an eager round's late forecast: host/forecast.py), run in a
    thread of its own once `begin()` says the round took its first step (the round has copied its start
    by then, which the work may write over in place); `result()` waits for it and raises its error."""

    def __init__(self, name: str, work: Callable[[], T]) -> None:
        self._work, self._began, self._cancelled = work, threading.Event(), False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._began.set()

    def cancel(self) -> None:
        """The round ended before it read the result (it failed, or was given up): work not started is
        not done, and work under way is waited for (it may be writing over tensors that what follows,
        the step's finish, reads)."""
        self._cancelled = True
        self._began.set()
        self._thread.join()

    def _run(self) -> None:
        self._began.wait()
        if self._cancelled:
            return
        try:
            self._value = self._work()
        except BaseException as exc:  # raised where the result is read, never lost
            self._error = exc

    def result(self) -> T:
        self._began.set()  # read before the first step (a round of one step): run now
        self._thread.join()
        if self._error is not None:
            raise self._error
        value, self._value = self._value, None  # the caller's alone (a model's worth: not held here too)
        return cast(T, value)


Trained = WorkerRound | SealedRound  # what a round's training returns: sealed, or sealing behind


class StateAfterSeal(Mapping[str, Any]):
    """A worker state (`DiLoCoWorker.state_dict()`'s keys) whose residuals are the ones a seal in flight
    leaves: reading "feedback" waits for that seal, reading "inner" does not."""

    def __init__(self, inner: Mapping[str, Any], sealing: SealedRound) -> None:
        self._inner, self._sealing = inner, sealing

    def __getitem__(self, key: str) -> Any:
        if key == "inner":
            return self._inner
        if key == "feedback":
            return self._sealing.feedback_after()
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("inner", "feedback"))

    def __len__(self) -> int:
        return 2
