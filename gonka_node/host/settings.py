"""What the host daemon (`node.HostNode`) is configured with, the error it stops with, and what its loop
and helpers share: the chain's checkpoint hashes and patient retries of an aggregator that may be down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import torch

from chain.client import ChainClient
from gonka_node.host.rig_round import RigOptions

T = TypeVar("T")
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


def patiently(
    call: Callable[[], T], who: str, what: str, sleep: Callable[[float], None], note: Callable[[str], None],
    backoff_s: float, max_backoff_s: float = 30.0,
) -> T:
    """`call` until it answers: a host must outlive an aggregator outage while it follows the chain
    (the round is finalized on chain; only the download is missing). Refusals that are not about
    reachability (RETRYABLE) propagate. Says so once, then every ~5 minutes of waiting."""
    delay, waited, said = backoff_s, 0.0, -1.0
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            code = exc.code()
            if code not in RETRYABLE:
                raise
            if said < 0 or waited - said >= 300:
                note(f"{who} unreachable ({code.name}) while fetching {what}; waiting for it to come back")
                said = waited
        sleep(delay)
        waited += delay
        delay = min(delay * 2, max_backoff_s)


class HostError(RuntimeError):
    """The node cannot go on (not signed in, recipe disagrees with the chain, …); the message says why."""


@dataclass(frozen=True)
class HostSettings:
    epoch: int
    stake: int  # ngonka escrowed at sign-in
    state_dir: Path
    cache_dir: Path | None = None
    poll_s: float = 0.5
    submit_attempts: int = 6
    backoff_s: float = 0.5
    stop_after_rounds: int | None = None  # leave the loop after this many applied rounds (tests)
    procs: int = 1  # processes of this host's rig (`--gpus N`): the inner steps run across them
    sharding: str = "auto"  # the rig's state: "replicated", "sharded" (FSDP2) or "auto" (training.plan)
    checkpoint_activations: bool = False
    compile: bool = False  # torch.compile in the rig's processes
    rig_stall_s: float = RigOptions.stall_s  # `--rig-stall-s`
    rig_start_s: float = RigOptions.start_s  # `--rig-start-s`

    def rig_options(self) -> RigOptions:
        return RigOptions(self.procs, self.sharding, self.checkpoint_activations, self.compile,
                          stall_s=self.rig_stall_s, start_s=self.rig_start_s)

    def uses_rig(self) -> bool:
        """A rig of processes (torchrun) unless this is one process on a CPU: one GPU trains there too."""
        return self.procs > 1 or torch.cuda.is_available()


class ChainHashes:
    """The checkpoint hash the chain records for each finalized round."""

    def __init__(self, chain: ChainClient, epoch: int) -> None:
        self.chain, self.epoch = chain, epoch
        self._skipped: dict[int, bool] = {}

    def checkpoint_sha256(self, round_: int) -> bytes:
        result = self.chain.round_result(self.epoch, round_)
        if not result.finalized:
            raise HostError(f"round {self.epoch}/{round_} is not finalized on chain")
        return bytes(result.checkpoint_sha256)

    def skipped(self, round_: int) -> bool:
        """Whether the chain skipped finalized round `round_`: it records the model of the round before
        (or the epoch's initial one) unchanged, and no update. Final once known, so remembered."""
        known = self._skipped.get(round_)
        if known is None:
            before = self.checkpoint_sha256(round_ - 1) if round_ > 1 else \
                bytes(self.chain.get_epoch(self.epoch).spec.init_checkpoint_hash)
            known = self._skipped[round_] = self.checkpoint_sha256(round_) == before
        return known
