"""The rounds being served: one `ServedModel` per chain-verified checkpoint, each with its own engine.

A model's id names its epoch and round (`gonka-epoch-1-round-3`); the epoch's alias
(`gonka-epoch-1`) means the newest round served. Adding a round makes it the newest; past `keep`
rounds the oldest is dropped from the list and its engine retired: it finishes the requests it holds
and takes no new one. Resolving a name and queueing on that model's engine happen under one lock with
that retirement, so no request can be queued on an engine that has stopped taking work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gonka_node.serve.engine import BatchEngine, Saturated, Sequence
from gonka_node.serve.errors import ModelNotFound, NoModelLoaded, QueueFull

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer

ID_PREFIX = "gonka-epoch-"


def model_id(epoch: int, round_: int) -> str:
    return f"{ID_PREFIX}{epoch}-round-{round_}"


def epoch_alias(epoch: int) -> str:
    return f"{ID_PREFIX}{epoch}"


@dataclass(frozen=True)
class Provenance:
    """What the chain says about the weights: a client checks an answer against these."""

    epoch: int
    round: int
    sha256: str  # canonical tensor sha256 (hex), as the chain records it for (epoch, round)
    chain_id: int
    registry: str

    def field(self) -> dict[str, Any]:
        return {"checkpoint_sha256": self.sha256, "epoch": self.epoch, "round": self.round,
                "chain_id": self.chain_id, "registry": self.registry}

    def headers(self) -> dict[str, str]:
        return {"X-Gonka-Checkpoint-Sha256": self.sha256, "X-Gonka-Epoch": str(self.epoch),
                "X-Gonka-Round": str(self.round), "X-Gonka-Chain-Id": str(self.chain_id),
                "X-Gonka-Registry": self.registry}


@dataclass(frozen=True)
class ServedModel:
    provenance: Provenance
    engine: BatchEngine
    created: int  # unix seconds it was loaded
    tokenizer: Tokenizer  # the epoch recipe's: prompts are encoded and tokens decoded with it

    @property
    def id(self) -> str:
        return model_id(self.provenance.epoch, self.provenance.round)

    def card(self) -> dict[str, Any]:
        """Its `/v1/models` entry."""
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "gonka",
                "gonka": self.provenance.field()}


class ModelRegistry:
    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._models: list[ServedModel] = []  # oldest first
        self._lock = threading.Lock()

    def add(self, provenance: Provenance, engine: BatchEngine, tokenizer: Tokenizer) -> ServedModel:
        served = ServedModel(provenance, engine.start(), int(time.time()), tokenizer)
        with self._lock:
            self._models.append(served)
            retired, self._models = self._models[: -self.keep], self._models[-self.keep :]
        for old in retired:
            old.engine.retire()
        return served

    def newest(self) -> ServedModel | None:
        with self._lock:
            return self._models[-1] if self._models else None

    def listed(self) -> list[ServedModel]:
        with self._lock:
            return list(reversed(self._models))  # newest first

    def submit(self, name: str, sequences: Iterable[Sequence]) -> ServedModel:
        """Queue `sequences` on the model `name` names; the model that will answer."""
        with self._lock:
            served = self._resolve(name)
            try:
                served.engine.submit(sequences)
            except Saturated as exc:
                raise QueueFull(f"the server is at capacity ({exc}); retry shortly") from None
        return served

    def get(self, name: str) -> ServedModel:
        with self._lock:
            return self._resolve(name)

    def stop(self) -> None:
        with self._lock:
            models, self._models = self._models, []
        for served in models:
            served.engine.stop()

    def _resolve(self, name: str) -> ServedModel:
        if not self._models:
            raise NoModelLoaded("no verified checkpoint is loaded yet; retry shortly")
        newest = self._models[-1]
        if name == epoch_alias(newest.provenance.epoch):
            return newest
        for served in self._models:
            if served.id == name:
                return served
        names = ", ".join(m.id for m in reversed(self._models))
        raise ModelNotFound(
            f"The model '{name}' does not exist on this server; it serves {names} "
            f"(and {epoch_alias(newest.provenance.epoch)} for the newest)", "model")
