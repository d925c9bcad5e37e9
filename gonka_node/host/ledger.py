"""A host's rewards from what the chain and the aggregator know, not from its own state folder.

For every finalized round of the epoch: a reward already claimed is on chain (the RewardClaimed event,
with its amount); one not yet claimed is a leaf of the round's reward tree, which the aggregator serves
with its Merkle proof (checked here against the root on chain before anything is sent). A host whose
state folder is lost therefore still sees, and claims, everything it earned. The local record is used
only when the aggregator cannot be asked, and is labelled so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from chain.client import ChainClient
from gonka_node.core.client import AggregatorClient
from proto.gonka.v1 import aggregator_pb2 as pb


class LedgerError(RuntimeError):
    """The aggregator's proof does not match the chain: claiming with it would revert."""


@dataclass(frozen=True)
class RoundReward:
    round: int
    amount: int  # ngonka this host earned in the round (0: none)
    claimed: bool
    source: str  # where the amount comes from: "chain" | "aggregator" | "local state" | "unknown"
    proof: pb.RewardProof | None = None  # to claim an unclaimed amount

    @property
    def claimable(self) -> bool:
        return self.amount > 0 and not self.claimed and self.proof is not None


def rewards(
    chain: ChainClient, aggregator: AggregatorClient | None, epoch: int, local: Mapping[str, int] | None = None
) -> list[RoundReward]:
    """This account's reward in every finalized round of `epoch`, oldest first."""
    host = chain.address
    claims = chain.claims(epoch, host)
    out = []
    for r in range(1, chain.latest_round(epoch) + 1):
        if r in claims:
            out.append(RoundReward(r, claims[r], True, "chain"))
        elif chain.round_result(epoch, r).total_reward == 0:
            out.append(RoundReward(r, 0, False, "chain"))
        else:
            out.append(_unclaimed(chain, aggregator, epoch, r, local or {}))
    return out


def _unclaimed(
    chain: ChainClient, aggregator: AggregatorClient | None, epoch: int, r: int, local: Mapping[str, int]
) -> RoundReward:
    if aggregator is None:
        known = str(r) in local
        return RoundReward(r, local.get(str(r), 0), False, "local state" if known else "unknown")
    try:
        proof = aggregator.reward_proof(epoch, r, bytes.fromhex(chain.address[2:]))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return RoundReward(r, 0, False, "aggregator")
        raise
    root = chain.round_result(epoch, r).rewards_root
    if bytes(proof.rewards_root) != root:
        raise LedgerError(
            f"round {r}: the aggregator's reward tree has root {bytes(proof.rewards_root).hex()}, the chain "
            f"records {root.hex()}: its proof cannot be claimed (ask another of the epoch's aggregators)"
        )
    return RoundReward(r, int(proof.amount), False, "aggregator", proof)


def claim(chain: ChainClient, epoch: int, reward: RoundReward) -> None:
    assert reward.proof is not None
    chain.claim(epoch, reward.round, int(reward.proof.amount), list(reward.proof.proof))
