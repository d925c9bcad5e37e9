"""The batching engine: one thread steps every admitted sequence of one model, one token per step.

Requests wait in a bounded queue (`Saturated` when it is full) and join the batch at the start of a
step whenever a slot is free; a sequence leaves the batch the step it finishes (its stop token, a stop
sequence its sink matched, `max_tokens`) or after it was cancelled (a client gone, a timeout), and its
slot serves the next one. Per step: new (and window-sliding) sequences are prefilled, one forward per
prompt length, then one batched decode advances all others (`batching.py`). Results go to each sequence's `Sink` from the
engine thread; a failing step fails only the sequences in it, and the engine goes on.

`retire()` lets the engine finish what it was given and then end its thread (a model being replaced
keeps serving its requests in flight); `stop()` ends it now and fails what is left with `EngineStopped`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gonka_node.serve.batching import SlotCache, decode, prefill
from gonka_node.serve.sampling import SamplingParams, TokenLogprobs, pick, token_logprobs
from training.generate import SamplingConfig
from training.model import Llama

log = logging.getLogger(__name__)


class Saturated(Exception):
    """The waiting queue is full."""


class EngineStopped(Exception):
    """The engine was stopped (or retired and finished) before this sequence could run."""


class Sink(Protocol):
    """Where a sequence's results go; called from the engine thread, so it must be quick."""

    def on_token(self, token: int, logprobs: TokenLogprobs | None) -> bool:
        """A generated token (not the stop token); True: a stop sequence matched, end the sequence."""
        ...

    def on_finish(self, reason: str) -> None:
        """'stop' or 'length'; nothing follows."""
        ...

    def on_error(self, error: BaseException) -> None:
        """The sequence failed; nothing follows."""
        ...


@dataclass(eq=False)
class Sequence:
    prompt: list[int]  # what the model reads first (at least one token)
    max_tokens: int
    params: SamplingParams
    sink: Sink
    stop_token: int | None = None  # ends the sequence when drawn; not passed to the sink
    context: list[int] = field(init=False)
    generated: int = 0
    position: int = 0  # tokens held in the slot's cache
    slot: int | None = None
    cancelled: bool = False
    done: bool = False
    _config: SamplingConfig = field(init=False)
    _generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        self.context = list(self.prompt)
        self._config = self.params.config()

    def held_slot(self) -> int:
        """The cache slot of a running sequence (given when it was admitted)."""
        assert self.slot is not None, "a running sequence holds a slot"
        return self.slot


class BatchEngine:
    def __init__(self, model: Llama, *, max_batch: int, max_waiting: int, name: str = "engine") -> None:
        self.model = model.eval()
        self.max_waiting = max_waiting
        self.name = name
        self._cache = SlotCache(model, max_batch)
        self._free = list(range(max_batch - 1, -1, -1))
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._cond = threading.Condition()
        self._draining = self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"gonka-serve-{name}", daemon=True)
        self.steps = 0  # batched steps run (tests and the benchmark read it)
        self.largest_batch = 0

    def start(self) -> BatchEngine:
        self._thread.start()
        return self

    def submit(self, sequences: Iterable[Sequence]) -> None:
        """Queue `sequences` (all or none): `Saturated` if the queue cannot take them all,
        `EngineStopped` if this engine no longer takes work."""
        batch = list(sequences)
        with self._cond:
            if self._stopping or self._draining:
                raise EngineStopped(f"{self.name} takes no more requests")
            if len(self._waiting) + len(batch) > self.max_waiting:
                raise Saturated(f"{len(self._waiting)} sequences already wait (at most {self.max_waiting})")
            self._waiting.extend(batch)
            self._cond.notify()

    def cancel(self, sequence: Sequence) -> None:
        sequence.cancelled = True  # the engine drops it at its next step; the sink hears nothing more

    def load(self) -> tuple[int, int]:
        """(sequences running, sequences waiting)."""
        with self._cond:
            return len(self._active), len(self._waiting)

    def retire(self) -> None:
        with self._cond:
            self._draining = True
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end (after `retire` or `stop`); True if it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._next_batch():
                self._step()
        finally:
            with self._cond:
                left = [*self._active, *self._waiting]
                self._active, self._waiting = [], collections.deque()
            for sequence in left:
                self._fail(sequence, EngineStopped(f"{self.name} stopped"))

    def _next_batch(self) -> bool:
        """Admit waiting sequences into free slots; False when the thread should end."""
        with self._cond:
            while True:
                if self._stopping:
                    return False
                self._admit()
                if self._active:
                    return True
                if self._draining and not self._waiting:
                    return False
                self._cond.wait()

    def _admit(self) -> None:
        device = self.model.lm_head.weight.device
        while self._waiting and self._free:
            sequence = self._waiting.popleft()
            if sequence.cancelled:
                continue
            if sequence.max_tokens == 0:
                self._finish(sequence, "length")
                continue
            sequence.slot = self._free.pop()
            sequence._generator = torch.Generator(device=device).manual_seed(sequence.params.seed)
            self._active.append(sequence)

    def _step(self) -> None:
        live = [s for s in self._active if not s.cancelled]
        for gone in (s for s in self._active if s.cancelled):
            self._release(gone)
        window = self.model.config.max_seq_len
        try:
            running = [s for s in live if 0 < s.position < window]  # before prefills move positions
            rows = self._prefill([s for s in live if s.position == 0 or s.position >= window], window)
            rows += self._decode(running)
            for sequence, logits in rows:
                self._emit(sequence, logits)
        except Exception as exc:  # a failed forward (a bug, device memory) fails its batch, not the server
            log.exception("%s: a generation step failed", self.name)
            for sequence in live:
                self._fail(sequence, exc)
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(live))
        with self._cond:
            self._active = [s for s in self._active if not s.done]

    def _prefill(self, sequences: list[Sequence], window: int) -> list[tuple[Sequence, torch.Tensor]]:
        """Prefill each sequence's last `window` tokens, one forward per length (every sequence whose
        window slides has exactly `window` tokens: they share one)."""
        by_length: dict[int, list[Sequence]] = collections.defaultdict(list)
        for sequence in sequences:
            by_length[min(len(sequence.context), window)].append(sequence)
        rows: list[tuple[Sequence, torch.Tensor]] = []
        for length, group in by_length.items():
            logits = prefill(self.model, self._cache, [s.held_slot() for s in group],
                             [s.context[-length:] for s in group])
            for sequence in group:
                sequence.position = length
            rows += zip(group, logits, strict=True)
        return rows

    def _decode(self, sequences: list[Sequence]) -> list[tuple[Sequence, torch.Tensor]]:
        if not sequences:
            return []
        logits = decode(
            self.model, self._cache, [s.held_slot() for s in sequences],
            [s.position for s in sequences], [s.context[-1] for s in sequences],
        )
        for sequence in sequences:
            sequence.position += 1
        return list(zip(sequences, logits, strict=True))

    def _emit(self, sequence: Sequence, logits: torch.Tensor) -> None:
        token = pick(logits, sequence.params, sequence._config, sequence._generator)
        sequence.context.append(token)
        sequence.generated += 1
        if token == sequence.stop_token:
            self._finish(sequence, "stop")
            return
        top = sequence.params.logprobs
        stopped = sequence.sink.on_token(token, None if top is None else token_logprobs(logits, token, top))
        if stopped:
            self._finish(sequence, "stop")
        elif sequence.generated >= sequence.max_tokens:
            self._finish(sequence, "length")

    def _finish(self, sequence: Sequence, reason: str) -> None:
        self._release(sequence)
        sequence.sink.on_finish(reason)

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        if not sequence.done:
            self._release(sequence)
            sequence.sink.on_error(error)

    def _release(self, sequence: Sequence) -> None:
        sequence.done = True
        if sequence.slot is not None:
            self._free.append(sequence.slot)
            sequence.slot = None
