"""A sharded aggregator's round (docs/PROTOCOL.md "Sharded aggregators"): its role, what it reports to
the round's verifier, and the verifier's verdict.

Shard i of S owns fragment i of the model (`fragments.plan_fragments`). At close it reports, per host
it accepted, the fragment's per-tensor squared norms and its count sketch at global coordinates;
shard 0, the verifier, sums the S reports into whole-model norms and sketches, runs the checks that
need only those (copies, resubmissions, departures, mixtures, dissent, the norm bound) on every host,
and signs nothing yet: the verdict (who is aggregated, each host's whole norm, the clip norm τ, the
rewards) goes to every shard through a `ShardExchange`. A host is aggregated only if every shard
accepted its fragment. Scoring and replay need the whole update: for each host the replay pick selects
(`replay.chosen_for_replay`, the unsharded rule), every shard puts its fragment payload (and, after
round 1, its fragment of the round's base) in the exchange; the verifier reassembles the whole update
and base and runs the unsharded replay verdict and score on them (`WholeInputs`). Hosts not picked
are not scored (score 1, said in their reasons).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gonka_node.aggregator.close import (
    CHECKS,
    NOT_SAMPLED,
    Closing,
    _scores,
    equal_shares,
    gate,
    reward_tree,
)
from gonka_node.aggregator.replay import chosen_for_replay
from gonka_node.aggregator.store import ContributionRow, RoundRow, Store, SubmissionRow
from gonka_node.core.config import AggregationSettings
from gonka_node.core.envelope import Submission
from gonka_node.core.fragments import Fragment, Spec, global_offsets, plan_fragments
from training.durable import atomic_write

if TYPE_CHECKING:
    from gonka_node.aggregator.engine_types import EpochContext

SHARDABLE_RULES = ("mean", "clip_median")  # centered_clip needs one exchange of distances per iteration


class ShardPending(RuntimeError):
    """Another shard's report, the verdict or a fragment hash is not in yet: the close is retried."""


class ShardMismatch(RuntimeError):
    """A verdict or fragment hashes that contradict what this shard accepted: never finalize on it."""


class VerdictRefused(ShardMismatch):
    """A verdict that does not follow from the signed reports it names (`shard_audit`): never applied."""


class ShardConfigError(ValueError):
    """An epoch this aggregator cannot serve as a shard (not on the list, a rule shards cannot run)."""


@dataclass(frozen=True)
class ShardRole:
    """Shard `index` of `count`: the fragment it owns and where its tensors sit in the whole update."""

    index: int
    count: int
    whole_spec: dict[str, tuple[int, ...]]
    fragment: Fragment
    offsets: dict[str, int]  # each fragment tensor's first coordinate in the whole update

    @property
    def spec(self) -> dict[str, tuple[int, ...]]:
        return self.fragment.spec(self.whole_spec)


def shard_role(whole_spec: Spec, aggregators: Sequence[bytes], me: bytes, rule: str) -> ShardRole | None:
    """This aggregator's role in an epoch naming `aggregators` on chain (None: one aggregator, unsharded)."""
    if len(aggregators) <= 1:
        return None
    if me not in aggregators:
        raise ShardConfigError(f"0x{me.hex()} is not one of the epoch's {len(aggregators)} aggregators")
    if rule not in SHARDABLE_RULES:
        raise ShardConfigError(f"rule {rule!r} cannot run sharded; use one of {', '.join(SHARDABLE_RULES)}")
    index, count = list(aggregators).index(me), len(aggregators)
    fragment = plan_fragments(whole_spec, count)[index]
    everywhere = global_offsets(whole_spec)
    spec = {n: tuple(s) for n, s in whole_spec.items()}
    return ShardRole(index, count, spec, fragment, {n: everywhere[n] for n in fragment.names})


@dataclass(frozen=True)
class SignedFragment:
    """The fields of a host's signed header for its fragment payload at one shard that the round does not
    fix, and the signature: with the epoch's and the round's (chain, registry, base, codec) they are the
    `Submission` the host signed, so the verifier can check that a payload blob a shard puts is the one
    the host signed there, not one the shard made up."""

    payload_sha256: bytes
    payload_length: int
    tokens_trained: int
    timestamp_ms: int
    residual_root: bytes
    signature: bytes

    @classmethod
    def of(cls, row: SubmissionRow) -> SignedFragment:
        return cls(row.payload_sha256, row.payload_length, row.tokens_trained, row.timestamp_ms,
                   row.residual_root, row.signature)

    def submission(self, ctx: EpochContext, row: RoundRow, host: bytes) -> Submission:
        return Submission(
            chain_id=ctx.chain_id, registry=ctx.registry, epoch=row.epoch, round=row.round, host=host,
            base_checkpoint_sha256=row.base_sha256, codec=ctx.codec_name, payload_sha256=self.payload_sha256,
            payload_length=self.payload_length, tokens_trained=self.tokens_trained, timestamp_ms=self.timestamp_ms,
            residual_root=self.residual_root,
        )

    def to_list(self) -> list[Any]:
        return [self.payload_sha256.hex(), self.payload_length, self.tokens_trained, self.timestamp_ms,
                self.residual_root.hex(), self.signature.hex()]

    @classmethod
    def from_list(cls, d: list[Any]) -> SignedFragment:
        sha, length, tokens, ts, root, sig = d
        return cls(bytes.fromhex(sha), int(length), int(tokens), int(ts), bytes.fromhex(root), bytes.fromhex(sig))


@dataclass(frozen=True)
class HostFragment:
    """What shard i knows of one host's accepted fragment."""

    host: bytes
    started_ms: int
    received_ms: int
    scan_sq: tuple[float, ...]  # per fragment tensor (sorted): squared norm as the ingest check sums it
    clip_sq: tuple[float, ...]  # per fragment tensor: squared norm as the aggregate's clip sums it
    sketch: bytes  # fp32 count sketch of the fragment at global coordinates
    signed: SignedFragment | None = None  # its signed header (None: a report of a version without it)


@dataclass(frozen=True)
class FragmentReport:
    """Shard `index`'s account of a round at its close."""

    epoch: int
    round: int
    index: int
    count: int
    names: tuple[str, ...]
    skip: bool  # the shard's deadline passed below quorum: the round aggregates nobody
    hosts: tuple[HostFragment, ...]
    earlier: tuple[tuple[int, bytes, bytes], ...]  # (round, host, fragment sketch) of earlier rounds
    public: tuple[tuple[str, bytes], ...]  # (label, fragment sketch): the base model, earlier aggregates

    def to_json(self) -> str:
        return json.dumps({
            "epoch": self.epoch, "round": self.round, "index": self.index, "count": self.count,
            "names": list(self.names), "skip": self.skip,
            "hosts": [[h.host.hex(), h.started_ms, h.received_ms, list(h.scan_sq), list(h.clip_sq), _b64(h.sketch),
                       *([] if h.signed is None else [h.signed.to_list()])] for h in self.hosts],
            "earlier": [[n, h.hex(), _b64(s)] for n, h, s in self.earlier],
            "public": [[label, _b64(s)] for label, s in self.public],
        })

    @classmethod
    def from_json(cls, text: str) -> FragmentReport:
        d: dict[str, Any] = json.loads(text)
        hosts = tuple(
            HostFragment(bytes.fromhex(h), a, b, tuple(map(float, sq)), tuple(map(float, cl)), _unb64(k),
                         SignedFragment.from_list(signed[0]) if signed else None)
            for h, a, b, sq, cl, k, *signed in d["hosts"]
        )
        return cls(
            d["epoch"], d["round"], d["index"], d["count"], tuple(d["names"]), bool(d["skip"]), hosts,
            tuple((n, bytes.fromhex(h), _unb64(s)) for n, h, s in d["earlier"]),
            tuple((label, _unb64(s)) for label, s in d["public"]),
        )


def report_digest(report: FragmentReport) -> bytes:
    """What a verdict names a report by: the sha256 of its JSON as `to_json` writes it (a parsed report
    writes the same bytes again, so every shard computes the same digest from what it holds)."""
    return hashlib.sha256(report.to_json().encode("utf-8")).digest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


@dataclass(frozen=True)
class Verdict:
    """The verifier's decision for a round, the same for every shard."""

    epoch: int
    round: int
    rule: str
    aggregated: tuple[bytes, ...]  # increasing address: the averaging order
    clip_norms: dict[bytes, float]  # each aggregated host's whole-update norm, as the clip computes it
    tau: float | None  # the clip norm (clip_median), None for mean
    rows: tuple[ContributionRow, ...]  # every host any shard accepted, increasing address
    rewards_root: bytes
    total_reward: int
    reports: tuple[bytes, ...] = ()  # `report_digest` of each shard's report it was decided from, by index

    def to_json(self) -> str:
        return json.dumps({
            "epoch": self.epoch, "round": self.round, "rule": self.rule,
            "aggregated": [h.hex() for h in self.aggregated],
            "clip_norms": {h.hex(): v for h, v in self.clip_norms.items()}, "tau": self.tau,
            "rows": [[r.host.hex(), r.score, r.reward, r.aggregated, list(r.reasons)] for r in self.rows],
            "rewards_root": self.rewards_root.hex(), "total_reward": self.total_reward,
            "reports": [d.hex() for d in self.reports],
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        d = json.loads(text)
        rows = tuple(ContributionRow(bytes.fromhex(h), s, r, a, list(w)) for h, s, r, a, w in d["rows"])
        return cls(
            d["epoch"], d["round"], d["rule"], tuple(bytes.fromhex(h) for h in d["aggregated"]),
            {bytes.fromhex(h): float(v) for h, v in d["clip_norms"].items()}, d["tau"], rows,
            bytes.fromhex(d["rewards_root"]), d["total_reward"], tuple(bytes.fromhex(h) for h in d["reports"]),
        )


class ShardExchange(Protocol):
    """How a round's shards reach each other (in-process: `LocalExchange`)."""

    def put_report(self, report: FragmentReport) -> None: ...

    def reports(self, epoch: int, round_: int) -> list[FragmentReport]: ...

    def put_verdict(self, verdict: Verdict) -> None: ...

    def verdict(self, epoch: int, round_: int) -> Verdict | None: ...

    def put_hash(self, epoch: int, round_: int, index: int, sha256: bytes) -> None: ...

    def hashes(self, epoch: int, round_: int) -> dict[int, bytes]: ...

    def put_blob(self, epoch: int, round_: int, index: int, key: str, data: bytes) -> None:
        """Shard `index`'s bytes under `key` (a picked host's fragment payload, its base fragment)."""

    def blob(self, epoch: int, round_: int, index: int, key: str) -> bytes | None: ...

    def file_contradiction(self, epoch: int, round_: int, why: str) -> Path | None:
        """Keep the round's verdict and the reports it names, as signed, as evidence against the verifier
        (`shard_evidence`); the record's path, or None where messages are not signed."""


def payload_key(host: bytes) -> str:
    """The exchange key of a host's fragment payload."""
    return f"payload-{host.hex()}"


def payload_host(key: str) -> bytes:
    """The host whose fragment payload `key` names (a key a BLOB message carries other than `BASE_KEY`:
    its envelope holds it to `payload_key`'s form)."""
    return bytes.fromhex(key.removeprefix("payload-"))


BASE_KEY = "base"  # the exchange key of a shard's fragment of the round's base model


class LocalExchange:
    """Shards in one process (tests, a single-machine devnet): a shared table, latest write wins."""

    def __init__(self) -> None:
        self._reports: dict[tuple[int, int, int], FragmentReport] = {}
        self._verdicts: dict[tuple[int, int], Verdict] = {}
        self._hashes: dict[tuple[int, int], dict[int, bytes]] = {}
        self._blobs: dict[tuple[int, int, int, str], bytes] = {}

    def put_report(self, report: FragmentReport) -> None:
        self._reports[(report.epoch, report.round, report.index)] = report

    def reports(self, epoch: int, round_: int) -> list[FragmentReport]:
        return [r for (e, n, _), r in sorted(self._reports.items()) if (e, n) == (epoch, round_)]

    def put_verdict(self, verdict: Verdict) -> None:
        self._verdicts.setdefault((verdict.epoch, verdict.round), verdict)

    def verdict(self, epoch: int, round_: int) -> Verdict | None:
        return self._verdicts.get((epoch, round_))

    def put_hash(self, epoch: int, round_: int, index: int, sha256: bytes) -> None:
        self._hashes.setdefault((epoch, round_), {})[index] = sha256

    def hashes(self, epoch: int, round_: int) -> dict[int, bytes]:
        return dict(self._hashes.get((epoch, round_), {}))

    def put_blob(self, epoch: int, round_: int, index: int, key: str, data: bytes) -> None:
        self._blobs[(epoch, round_, index, key)] = bytes(data)

    def blob(self, epoch: int, round_: int, index: int, key: str) -> bytes | None:
        return self._blobs.get((epoch, round_, index, key))

    def file_contradiction(self, epoch: int, round_: int, why: str) -> Path | None:
        return None  # unsigned: nothing in it proves who wrote what


class DirExchange:
    """Shards on one machine (the devnet, the benchmark): a shared directory, one file per report,
    verdict and fragment hash, each written atomically (a reader sees a whole file or none)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, epoch: int, round_: int) -> Path:
        path = self.root / str(epoch) / str(round_)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def put_report(self, report: FragmentReport) -> None:
        text = report.to_json()
        atomic_write(self._dir(report.epoch, report.round) / f"report-{report.index}.json", lambda t: t.write_text(text))

    def reports(self, epoch: int, round_: int) -> list[FragmentReport]:
        found = sorted(self._dir(epoch, round_).glob("report-*.json"))
        return sorted((FragmentReport.from_json(p.read_text()) for p in found), key=lambda r: r.index)

    def put_verdict(self, verdict: Verdict) -> None:
        path, text = self._dir(verdict.epoch, verdict.round) / "verdict.json", verdict.to_json()
        if not path.exists():  # the first verdict stands: a retried close re-sends, never replaces
            atomic_write(path, lambda t: t.write_text(text))

    def verdict(self, epoch: int, round_: int) -> Verdict | None:
        path = self._dir(epoch, round_) / "verdict.json"
        return Verdict.from_json(path.read_text()) if path.exists() else None

    def put_hash(self, epoch: int, round_: int, index: int, sha256: bytes) -> None:
        atomic_write(self._dir(epoch, round_) / f"hash-{index}", lambda t: t.write_text(sha256.hex()))

    def hashes(self, epoch: int, round_: int) -> dict[int, bytes]:
        found = self._dir(epoch, round_).glob("hash-*")
        return {int(p.name.split("-")[1]): bytes.fromhex(p.read_text()) for p in found if p.name[5:].isdigit()}

    def put_blob(self, epoch: int, round_: int, index: int, key: str, data: bytes) -> None:
        atomic_write(self._dir(epoch, round_) / f"blob-{index}-{key}", lambda t: t.write_bytes(data))

    def blob(self, epoch: int, round_: int, index: int, key: str) -> bytes | None:
        path = self._dir(epoch, round_) / f"blob-{index}-{key}"
        return path.read_bytes() if path.exists() else None

    def file_contradiction(self, epoch: int, round_: int, why: str) -> Path | None:
        return None  # unsigned: nothing in it proves who wrote what


# ---- the verifier --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WholeInputs:
    """How the verifier reads whole updates and the whole base for its sampled checks: `base()` is
    called only when some host is picked, `decode` only for a picked host."""

    base: Callable[[], Mapping[str, torch.Tensor]]
    decode: Callable[[SubmissionRow], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class VerifierInputs:
    ctx: EpochContext  # the shard's context (its spec is the fragment's; the whole spec is the role's)
    role: ShardRole
    round_row: RoundRow
    seed: bytes
    slots: Mapping[bytes, int]
    aggregation: AggregationSettings
    max_update_norm: float
    whole: WholeInputs | None = None  # None: no whole-model checks (an unscored, unreplayed epoch)


def sampled(ctx: EpochContext, seed: bytes, round_: int, hosts: Sequence[bytes]) -> set[bytes]:
    """The hosts whose whole update the verifier checks: the round's replay pick (none when the
    epoch neither replays nor scores)."""
    if ctx.replay is None and ctx.scoring is None:
        return set()
    return chosen_for_replay(ctx.replay_probability, seed, round_, hosts)


def sampled_by_seed(ctx: EpochContext, store: Store) -> Callable[[int, int, bytes], bool | None]:
    """`(epoch, round, host)` -> whether `sampled` picks the host by the round's seed as this shard
    stored it once complete (None: not complete here yet): what the inbox takes payload blobs of."""
    def picked(epoch: int, round_: int, host: bytes) -> bool | None:
        row = store.get_round(epoch, round_)
        if row is None or row.round_seed is None:
            return None
        return host in sampled(ctx, row.round_seed, round_, [host])

    return picked


def misfit(reports: Sequence[FragmentReport], role: ShardRole) -> str | None:
    """Why a report does not fit the epoch's fragment plan, or None: each names exactly its own
    fragment's tensors (sorted) and gives every host one finite, non-negative squared norm per tensor.
    Whole norms are summed over the reports by tensor name, so a shard naming another's tensors, or a
    negative square, would set a host's norm below its honest size (past the norm bound and the clip)."""
    plan = plan_fragments(role.whole_spec, role.count)
    for r in reports:
        names = tuple(sorted(plan[r.index].names)) if 0 <= r.index < len(plan) else None
        if r.names != names:
            return f"shard {r.index}'s report names tensors {list(r.names)[:3]}…, not its fragment's"
        for h in r.hosts:
            for sq in (h.scan_sq, h.clip_sq):
                if len(sq) != len(names) or not all(math.isfinite(x) and x >= 0 for x in sq):
                    return (f"shard {r.index}'s report gives 0x{h.host.hex()} {len(sq)} squared norms for its "
                            f"{len(names)} tensors, or one that is negative or not finite")
    return None


def decide(v: VerifierInputs, reports: Sequence[FragmentReport]) -> Verdict:
    """The round's verdict from all S shards' reports: every host checked on whole-model sketches and norms."""
    if sorted(r.index for r in reports) != list(range(v.role.count)):
        raise ShardPending(f"{len(reports)} of {v.role.count} shard reports in")
    why = misfit(reports, v.role)
    if why is not None:
        raise ShardMismatch(f"round {v.round_row.epoch}/{v.round_row.round}: {why}; no verdict can follow from it")
    everyone = sorted({h.host for r in reports for h in r.hosts})
    complete = [h for h in everyone if all(h in _by_host(r) for r in reports)]
    whole = [_whole_row(v, reports, h) for h in complete]
    picked = sampled(v.ctx, v.seed, v.round_row.round, complete)
    checked = v.whole is not None and bool(picked)
    ctx = dataclasses.replace(v.ctx, spec=v.role.whole_spec)
    if not checked:
        ctx = dataclasses.replace(ctx, replay=None, model_factory=None, scoring=None)
    base = v.whole.base() if checked and v.whole is not None else {}
    decode = v.whole.decode if v.whole is not None else _no_decode
    c = Closing(ctx, v.round_row, v.seed, whole, _earlier(reports), v.slots, base, _public(reports),
                decode, v.aggregation)
    skipped = [r.index for r in reports if r.skip]
    if skipped:
        c.exclude({s.host: f"round skipped: shard {skipped[0]} was below quorum at its deadline" for s in whole})
    c.exclude({s.host: _too_large(s.norm, v.max_update_norm) for s in whole if s.norm > v.max_update_norm})
    for check in CHECKS:
        c.exclude(check(c))
    consensus_checked = len(c.live()) >= 4 and v.aggregation.consensus_fraction > 0
    scored = v.whole is not None and v.ctx.scoring is not None and v.ctx.model_factory is not None
    scores = score_sampled(c, picked, scored)
    c.exclude(gate(c, scores, consensus_checked))
    return _verdict(v, reports, c, everyone, scores)


def score_sampled(c: Closing, picked: set[bytes], scored: bool) -> dict[bytes, float]:
    """`close._scores` on the picked hosts (the score's clip norm and step are the round's, over every
    live host, as unsharded); a host not picked scores 1, its reasons say why."""
    if not scored:
        for s in c.submissions:
            c.reasons[s.host].append("scoring disabled for this epoch: every valid update scores 1")
        return {s.host: 1.0 for s in c.submissions}
    if picked:
        return _scores(c, only=picked)
    out = {s.host: 0.0 for s in c.submissions}  # nobody picked: no whole model is read at all
    for s in c.live():
        out[s.host] = 1.0
        c.reasons[s.host].append(NOT_SAMPLED)
    return out


def _verdict(
    v: VerifierInputs, reports: Sequence[FragmentReport], c: Closing, everyone: list[bytes], scores: Mapping[bytes, float]
) -> Verdict:
    eligible = [s.host for s in c.live()]
    rule = v.aggregation.rule_for(v.round_row.epoch)
    rewards = equal_shares(v.ctx.reward_per_round, eligible)
    rows = [_row(h, c, rewards, reports, scores) for h in everyone]
    tree = reward_tree(v.ctx, v.round_row.epoch, v.round_row.round, rewards) if eligible else None
    clip = {h: _clip_norm(reports, h) for h in eligible}
    tau = None if rule == "mean" or not eligible else float(statistics.median(s.norm for s in c.live()))
    return Verdict(
        v.round_row.epoch, v.round_row.round, rule, tuple(eligible), clip, tau, tuple(rows),
        tree.root if tree is not None else bytes(32), sum(rewards.values()),
        tuple(report_digest(r) for r in sorted(reports, key=lambda r: r.index)),
    )


def _row(
    host: bytes, c: Closing, rewards: Mapping[bytes, int], reports: Sequence[FragmentReport],
    scores: Mapping[bytes, float],
) -> ContributionRow:
    if host in c.reasons:
        return ContributionRow(host, scores.get(host, 0.0), rewards.get(host, 0), host not in c.excluded, c.reasons[host])
    missing = [r.index for r in reports if host not in _by_host(r)]
    return ContributionRow(host, 0.0, 0, False, [f"fragment refused or missing at shard(s) {missing}: not aggregated"])


def _by_host(report: FragmentReport) -> dict[bytes, HostFragment]:
    return {h.host: h for h in report.hosts}


def _sq_by_name(reports: Sequence[FragmentReport], host: bytes, clip: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in reports:
        h = _by_host(r)[host]
        out.update(zip(r.names, h.clip_sq if clip else h.scan_sq, strict=True))
    return out


def _whole_norm(reports: Sequence[FragmentReport], host: bytes, clip: bool) -> float:
    """The whole update's norm, summed in sorted tensor order exactly as the unsharded code sums it (so
    the clip factor and τ are the unsharded ones bit for bit)."""
    sq = _sq_by_name(reports, host, clip)
    return math.sqrt(sum(sq[n] for n in sorted(sq)))


def _clip_norm(reports: Sequence[FragmentReport], host: bytes) -> float:
    return _whole_norm(reports, host, clip=True)


def _sum_sketches(parts: Sequence[bytes]) -> bytes:
    total = torch.zeros(len(parts[0]) // 4, dtype=torch.float64)
    for p in parts:
        total += torch.frombuffer(bytearray(p), dtype=torch.float32).double()
    return total.float().numpy().tobytes()


def _whole_row(v: VerifierInputs, reports: Sequence[FragmentReport], host: bytes) -> SubmissionRow:
    """A host's whole submission as the checks see it: summed sketch and norm; its header counts as
    arrived when its last fragment's did (a copier must beat the honest host at every shard)."""
    parts = [_by_host(r)[host] for r in reports]
    return SubmissionRow(
        epoch=v.round_row.epoch, round=v.round_row.round, host=host, payload_sha256=bytes(32),
        payload_length=0, tokens_trained=0, timestamp_ms=0, signature=b"",
        received_ms=max(p.received_ms for p in parts), norm=_whole_norm(reports, host, clip=False),
        sketch=_sum_sketches([p.sketch for p in parts]), path="", started_ms=max(p.started_ms for p in parts),
    )


def _earlier(reports: Sequence[FragmentReport]) -> list[SubmissionRow]:
    """Earlier rounds' submissions that every shard accepted, with their summed sketches."""
    tables = [{(n, h): s for n, h, s in r.earlier} for r in reports]
    keys = sorted(set.intersection(*(set(t) for t in tables)))
    return [
        SubmissionRow(0, n, h, bytes(32), 0, 0, 0, b"", 0, 0.0, _sum_sketches([t[(n, h)] for t in tables]), "")
        for n, h in keys
    ]


def _public(reports: Sequence[FragmentReport]) -> list[tuple[str, torch.Tensor]]:
    tables = [dict(r.public) for r in reports]
    labels = [label for label, _ in reports[0].public if all(label in t for t in tables)]
    return [
        (label, torch.frombuffer(bytearray(_sum_sketches([t[label] for t in tables])), dtype=torch.float32))
        for label in labels
    ]


def _too_large(norm: float, bound: float) -> str:
    return f"update L2 norm {norm:.4g} exceeds the epoch's bound {bound:.4g} (summed over fragments)"


def _no_decode(sub: SubmissionRow) -> dict[str, torch.Tensor]:
    raise RuntimeError("the verifier reads no whole update in an unscored, unreplayed epoch")
