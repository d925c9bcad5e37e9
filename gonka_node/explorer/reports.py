"""What the chain does not hold about a round, from the epoch's aggregators, checked against the chain.

The chain keeps a finalized round's checkpoint sha256, reward Merkle root and total; each host's
score, reward, verdict, reasons and upload size, and the held-out loss, come from the aggregator that
served the round (gRPC `GetRoundResult` over TLS, pinning the certificate it announced on chain). A
report is *verified* when its checkpoint equals the chain's and the reward tree rebuilt from its
per-host rewards has the chain's root and total: then every reward shown is exactly what that host
can claim. An answer that does not verify is kept with the reason (pages say so) unless another
aggregator's does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from eth_utils import to_checksum_address

from chain.client import ChainClient
from chain.errors import ChainError
from chain.merkle import RewardTree
from chain.types import AggregatorEndpoint
from gonka_node.core.client import AggregatorClient
from gonka_node.explorer.db import ContributionRow, IndexDb, ReportRow
from proto.gonka.v1 import aggregator_pb2 as pb

log = logging.getLogger(__name__)
RETRY_S = 10.0  # an aggregator that did not answer is asked again after this long
ENDPOINTS_TTL_S = 30.0


@dataclass(frozen=True)
class Finalized:
    """A RoundFinalized event, as indexed."""

    epoch: int
    round: int
    block: int
    checkpoint_sha256: bytes
    rewards_root: bytes
    total_reward: int


def pending_rounds(db: IndexDb) -> list[Finalized]:
    """Finalized rounds with no report yet, oldest first."""
    rows = db.db.execute(
        "SELECT e.epoch, e.round, e.block, e.args FROM events e LEFT JOIN reports r "
        "ON r.epoch = e.epoch AND r.round = e.round WHERE e.name = 'RoundFinalized' AND r.epoch IS NULL "
        "AND e.epoch IS NOT NULL AND e.round IS NOT NULL ORDER BY e.block, e.log_index"
    ).fetchall()
    out = []
    for epoch, round_, block, args in rows:
        a = json.loads(args)
        out.append(Finalized(epoch, round_, block, bytes.fromhex(a["checkpoint_sha256"][2:]),
                             bytes.fromhex(a["rewards_root"][2:]), int(a["total_reward"])))
    return out


def check_report(chain_id: int, registry: str, want: Finalized, result: pb.RoundResult) -> str:
    """"" when `result` says what the chain says about the round, else why not (one line)."""
    if bytes(result.checkpoint_sha256) != want.checkpoint_sha256:
        return f"its checkpoint {bytes(result.checkpoint_sha256).hex()[:16]}… is not the chain's"
    paid = [(to_checksum_address(bytes(c.host)), int(c.reward)) for c in result.contributions if c.reward > 0]
    if sum(amount for _, amount in paid) != want.total_reward:
        return f"its rewards add up to {sum(a for _, a in paid)} ngonka, the chain's total is {want.total_reward}"
    try:
        root = RewardTree(chain_id, registry, want.epoch, want.round, paid).root if paid else bytes(32)
    except ValueError as exc:  # a host listed twice
        return f"its rewards do not form a reward tree ({exc})"
    if root != want.rewards_root:
        return "the reward tree of its per-host rewards does not have the chain's root"
    return ""


def to_report(want: Finalized, source: str, result: pb.RoundResult, note: str) -> ReportRow:
    contributions = [
        ContributionRow(
            host=to_checksum_address(bytes(c.host)) if len(c.host) == 20 else "0x" + bytes(c.host).hex(),
            score=float(c.score), reward=int(c.reward), aggregated=bool(c.aggregated),
            reasons=list(c.reasons), payload_length=int(c.payload_length),
        )
        for c in result.contributions
    ]
    return ReportRow(
        epoch=want.epoch, round=want.round, block=want.block, source=source,
        base_sha256=bytes(result.base_checkpoint_sha256), aggregation=result.aggregation,
        heldout_loss_base=result.heldout_loss_base if result.HasField("heldout_loss_base") else None,
        heldout_loss=result.heldout_loss if result.HasField("heldout_loss") else None,
        verified=note == "", note=note, contributions=contributions,
    )


class ReportFetcher:
    """Asks the epoch's announced aggregators (only `targets`, when given) for finalized rounds' results."""

    def __init__(
        self, chain: ChainClient, db: IndexDb, targets: Sequence[str] = (), timeout_s: float = 10.0
    ) -> None:
        self.chain = chain
        self.db = db
        self.targets = tuple(targets)
        self.timeout_s = timeout_s
        self._failed: dict[tuple[int, int], float] = {}
        self._endpoints: dict[int, tuple[float, list[AggregatorEndpoint]]] = {}

    def step(self) -> int:
        """Fetch what is missing and due; returns the number of reports saved."""
        saved = 0
        for want in pending_rounds(self.db):
            if time.monotonic() < self._failed.get((want.epoch, want.round), 0.0):
                continue
            report = self._fetch(want)
            if report is None:
                self._failed[(want.epoch, want.round)] = time.monotonic() + RETRY_S
                continue
            self.db.save_report(report)
            saved += 1
        return saved

    def endpoints(self, epoch: int) -> list[AggregatorEndpoint]:
        """The epoch's announced aggregators (cached briefly), restricted to `targets` when given."""
        cached = self._endpoints.get(epoch)
        if cached is None or time.monotonic() - cached[0] > ENDPOINTS_TTL_S:
            cached = (time.monotonic(), self.chain.aggregator_endpoints(epoch))
            self._endpoints[epoch] = cached
        return [a for a in cached[1] if not self.targets or a.endpoint in self.targets]

    def _fetch(self, want: Finalized) -> ReportRow | None:
        deployment = self.chain.deployment
        assert deployment is not None
        fallback: ReportRow | None = None
        try:
            endpoints = self.endpoints(want.epoch)
        except ChainError as exc:
            log.warning("epoch %d: aggregator announcements unreadable: %s", want.epoch, exc)
            return None
        for agg in endpoints:
            try:
                with AggregatorClient(agg.endpoint, agg.tls_cert_pem, self.timeout_s) as client:
                    result = client.round_result(want.epoch, want.round)
            except (grpc.RpcError, OSError, ValueError) as exc:
                log.info("round %d/%d: no result from %s (%s)", want.epoch, want.round, agg.endpoint, exc)
                continue
            note = check_report(deployment.chain_id, deployment.registry, want, result)
            report = to_report(want, agg.endpoint, result, note and f"{agg.endpoint}: {note}")
            if report.verified:
                return report
            fallback = report
        return fallback
