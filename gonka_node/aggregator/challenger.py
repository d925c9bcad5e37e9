"""After each round, put this aggregator's slashable evidence on chain as bonded challenges.

The aggregator holds the evidence (`gonka_node.slashing`: signed garbage and copies from submission,
near-copies and replay mismatches from its store). Once a round has closed, it files one challenge per
host the slashing rule names (escrowing the epoch's challenge bond from its own account) and votes to
uphold it; with the epoch's `aggregator_quorum` of votes the chain slashes the host's whole remaining
stake. A cheat caught in round r is thus frozen within that round's close, long before the epoch ends,
and cannot withdraw (its stake stays locked while a challenge is open). A failure (no GNK for the bond,
the chain unreachable) is logged and tried again after the next round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from eth_utils import to_checksum_address

from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.slashing import (
    Evidence,
    EvidenceLog,
    RoundIdentity,
    SlashDecision,
    challenge_all,
    collect_evidence,
)

log = logging.getLogger(__name__)


def _challenge_all_as(account: Any, epoch: int, records: Sequence[Evidence], evidence_uri: str) -> list[SlashDecision]:
    """This aggregator files the challenges and is their one voter from here (others vote on their own)."""
    return challenge_all(account, [account], epoch, records, evidence_uri)


class Challenger:
    def __init__(self, engine: RoundEngine, evidence: EvidenceLog, evidence_uri: str = "") -> None:
        self.engine, self.evidence, self.evidence_uri = engine, evidence, evidence_uri

    def settle(self) -> list[SlashDecision]:
        """Challenge every host the rule names and no challenge covers yet; the decisions acted on."""
        e = self.engine
        ident = RoundIdentity.of(e.ctx)
        records = collect_evidence(e.store, e.ctx.epoch, ident, self.evidence)
        decisions = e.chain.as_account(_challenge_all_as, e.ctx.epoch, records, self.evidence_uri)
        for d in decisions:
            log.warning(
                "challenged %s's stake in epoch %d on %s evidence %s… (round %d)",
                to_checksum_address(d.host), e.ctx.epoch, d.evidence.kind, d.evidence.hash.hex()[:16], d.evidence.round,
            )
        return decisions

    async def run(self, stop: asyncio.Event) -> None:
        """Settle after every round's close, until `stop`."""
        while not stop.is_set():
            closed = self.engine.round_closed
            stopping = asyncio.ensure_future(stop.wait())
            waiting = asyncio.ensure_future(closed.wait())
            await asyncio.wait({stopping, waiting}, return_when=asyncio.FIRST_COMPLETED)
            for task in (stopping, waiting):
                task.cancel()
            if stop.is_set():
                return
            try:
                await asyncio.to_thread(self.settle)
            except Exception as exc:  # the bond, the chain: retried after the next round
                log.warning("could not file challenges for epoch %d's evidence (%s: %s); trying again "
                            "after the next round", self.engine.ctx.epoch, type(exc).__name__, exc)
