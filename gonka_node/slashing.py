"""Evidence of provable cheating, and turning it into governance `slash` calls (docs/SECURITY.md).

The chain lets only governance slash, naming an `evidence_hash`. This module is the off-chain half:

1. `EvidenceLog` (the aggregator's `EvidenceSink`) keeps, for each refused submission that honest
   software never produces, the host's signed header fields, its signature and — when the payload was
   received — the payload bytes, whose sha256 is the signed digest. One record per (epoch, host, kind)
   is enough to slash, so a host flooding garbage cannot fill the disk.
2. `collect_evidence` adds what the aggregator's store proves after the fact: a payload digest signed
   twice (another host's payload, or one's own from an earlier round, re-signed = copy/replay),
   near-copies excluded at close by sketch cosine — of the same round or an earlier one (both signed
   submissions are kept in the store) — and replay mismatches: updates the recomputation of the host's
   own round does not reproduce (whoever votes can run the same replay from public inputs); in a top-k
   round with the host's signed residual opening it was judged on, kept beside the record.
3. `evidence_hash` is the sha256 of a record's canonical JSON; the record is written to
   `<dir>/<hash>.json`, so whoever votes can fetch the file the chain names and re-check it.
4. `challenge_all` applies the documented rule (`SLASHABLE`: the host's whole remaining stake) through
   the chain's bonded challenges: anyone holding the bond files, the epoch's aggregators (or governance)
   rule, and the stake stays locked until then (docs/PROTOCOL.md "Challenges").

Not evidence (never slashed): refusals that a network attacker can cause or that honest clients hit
(bad signature, unknown host, late, replayed old envelope, truncated stream, wrong codec) — their
signature either does not verify or proves nothing the host did wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from eth_utils import to_checksum_address

from gonka_node.aggregator.challenges import challenges_round
from gonka_node.aggregator.checks import arrival_order
from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.reasons import Reason
from gonka_node.aggregator.replay import MISMATCH
from gonka_node.aggregator.store import Store, SubmissionRow
from gonka_node.core.envelope import Submission
from gonka_node.core.opening import OpeningError, OpeningRecord, challenge, decode_body
from training.residual_commit import ChunkLayout, commitment_layout, verify_opening

# Evidence kinds and why each is proof: a signature over a digest that honest software never signs.
KIND_COPY = "copy"  # signed a payload whose digest another host had signed earlier (any round)
KIND_REPLAY = "replay"  # signed, for a later round, the same payload digest it signed before
KIND_NEAR_COPY = "near_copy"  # update within the copy cosine of an earlier-received host's update
KIND_GARBAGE = "garbage"  # signed a payload that fails decoding, shapes, finiteness or the norm bound
# signed an update that the replay of its own round (public inputs: base checkpoint, slot, round, recipe)
# does not reproduce: trained on something other than its assignment (gonka_node/aggregator/replay.py)
KIND_REPLAY_MISMATCH = "replay_mismatch"
GARBAGE_REASONS = (Reason.UNDECODABLE, Reason.WRONG_SHAPE, Reason.NON_FINITE, Reason.NORM_TOO_LARGE)
SLASHABLE = (KIND_COPY, KIND_REPLAY, KIND_NEAR_COPY, KIND_GARBAGE, KIND_REPLAY_MISMATCH)
OPENING_HEX = ("registry", "host", "previous_root", "residual_root", "body_sha256")  # an opening record's bytes


@dataclass(frozen=True)
class Evidence:
    kind: str
    epoch: int
    round: int
    host: str  # checksummed EVM address of the accused
    header: dict[str, Any]  # the signed Submission fields (bytes as hex)
    signature: str  # hex ed25519 signature over the header's canonical bytes
    detail: str
    other: dict[str, Any] | None = None  # the earlier submission it copies (host, round, digest, signature)
    payload_file: str = ""  # name of the kept payload (garbage, a replay mismatch), next to the record

    def canonical(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @property
    def hash(self) -> bytes:
        return hashlib.sha256(self.canonical()).digest()


def header_fields(sub: Submission | OpeningRecord) -> dict[str, Any]:
    return {
        k: (v.hex() if isinstance(v, bytes | bytearray) else v) for k, v in asdict(sub).items()
    }


@dataclass(frozen=True)
class ChallengeTerms:
    """What a top-k round's challenge was drawn from, as a verifier knows it independently of the
    record: the round's seed from the chain, the residual's layout (`commitment_layout` of the recipe's
    model and codec) and the recipe's sample."""

    round_seed: bytes
    layout: ChunkLayout
    fraction: float
    min_elements: int

    def as_record(self) -> dict[str, Any]:
        return {"round_seed": self.round_seed.hex(), "chunk": self.layout.chunk,
                "tensors": [[n, numel] for n, numel in self.layout.tensors],
                "fraction": self.fraction, "min_elements": self.min_elements}


def verify_evidence(
    ev: Evidence, node_key: bytes, evidence_dir: Path | None = None, terms: ChallengeTerms | None = None
) -> bool:
    """What a voter checks: the signature is the accused's node key over the header; a kept payload
    hashes to the signed digest. A top-k mismatch claimed on an opening that does not answer its
    challenge is checked against `terms` (the chain's seed, the recipe's layout and sample): without
    them, or when the record names others, it does not verify — those fields are the aggregator's
    words, and another seed or sample would make any honest opening "not answer"."""
    h = dict(ev.header)
    if "residual_root" not in h:  # a layout-1 header (before residual commitments): verifies nowhere now
        return False
    for name in ("registry", "host", "base_checkpoint_sha256", "payload_sha256", "residual_root"):
        h[name] = bytes.fromhex(h[name])
    sub = Submission(**h)
    if not sub.verify(bytes.fromhex(ev.signature), node_key) or not _opening_holds(
            ev, sub, node_key, evidence_dir, terms):
        return False
    if ev.payload_file and evidence_dir is not None:
        if ev.payload_file != f"{sub.payload_sha256.hex()}.payload":  # a record names no other file
            return False
        return _file_sha256(evidence_dir / ev.payload_file) == sub.payload_sha256
    return True


def _file_sha256(path: Path) -> bytes | None:
    """A kept file's sha256, read in chunks (a payload may be gigabytes); None: it is not there."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.digest()


class EvidenceLog:
    """Evidence records under one folder (the aggregator's `evidence/`); thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()

    def signed_rejection(
        self, sub: Submission, signature: bytes, reason: Reason, detail: str, payload: Path | None
    ) -> None:
        if reason == Reason.COPY:
            other = {"host": to_checksum_address("0x" + detail[2:]), "round": sub.round,
                     "payload_sha256": sub.payload_sha256.hex()}
            self.add(self._evidence(KIND_COPY, sub, signature, "identical payload digest", other))
        elif reason in GARBAGE_REASONS and payload is not None:
            name = f"{sub.payload_sha256.hex()}.payload"
            self.add(self._evidence(KIND_GARBAGE, sub, signature, f"{reason.name}: {detail}", None, name),
                     {name: payload})

    @staticmethod
    def _evidence(
        kind: str, sub: Submission, sig: bytes, detail: str, other: dict[str, Any] | None, file: str = ""
    ) -> Evidence:
        return Evidence(kind, sub.epoch, sub.round, to_checksum_address(sub.host), header_fields(sub),
                        sig.hex(), detail, other, file)

    def add(self, ev: Evidence, files: Mapping[str, Path] | None = None) -> bool:
        """Record `ev` unless the host already has evidence of this kind in this epoch; True if new.
        `files` (name → source: a payload, an opening's body) are copied beside it first, each written
        whole and renamed into place, so a crash never leaves a record naming a file missing or cut short
        (their names are their content's digest: a second copy of one is the same bytes)."""
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            if any((e.epoch, e.host, e.kind) == (ev.epoch, ev.host, ev.kind) for e in self.records()):
                return False
            for name, source in (files or {}).items():
                part = self.root / f"{name}.part"
                shutil.copyfile(source, part)
                part.replace(self.root / name)
            tmp = self.root / f"{ev.hash.hex()}.tmp"
            tmp.write_bytes(ev.canonical())
            tmp.replace(self.root / f"{ev.hash.hex()}.json")
            return True

    def records(self) -> list[Evidence]:
        if not self.root.exists():
            return []
        return [Evidence(**json.loads(p.read_text())) for p in sorted(self.root.glob("*.json"))]


@dataclass(frozen=True)
class RoundIdentity:
    """The signed header fields the aggregator's store does not keep per row (fixed for its epoch), and
    what a top-k challenge was drawn with: the residual's layout and the recipe's sample (None: an epoch
    without openings)."""

    chain_id: int
    registry: bytes
    codec: str
    layout: ChunkLayout | None = None
    sample: tuple[float, int] = (0.01, 1 << 20)  # the recipe's residual_sample, residual_sample_min

    @classmethod
    def of(cls, ctx: EpochContext) -> RoundIdentity:
        layout = commitment_layout(ctx.spec, ctx.codec) if challenges_round(ctx) else None
        return cls(ctx.chain_id, ctx.registry, ctx.codec_name, layout, (ctx.residual_sample, ctx.residual_sample_min))


def collect_evidence(store: Store, epoch: int, ident: RoundIdentity, log: EvidenceLog) -> list[Evidence]:
    """Add what the store proves (re-signed digests, near-copies) to `log`; returns the epoch's records."""
    first: dict[bytes, SubmissionRow] = {}
    for row in store.rounds(epoch):
        subs = arrival_order(store.submissions(epoch, row.round))
        by_host = {s.host: s for s in subs}
        for s in subs:
            earlier = first.setdefault(s.payload_sha256, s)
            if earlier is not s:
                kind = KIND_REPLAY if earlier.host == s.host else KIND_COPY
                log.add(_from_row(kind, s, row.base_sha256, ident, "payload digest signed before", _ref(earlier)))
        for c in store.contributions(epoch, row.round):
            if c.host not in by_host:
                continue
            for why in c.reasons:
                if why.startswith("copy: sketch cosine"):
                    source = _copied_from(store, epoch, row.round, why)
                    ref = _ref(source) if source is not None else None
                    log.add(_from_row(KIND_NEAR_COPY, by_host[c.host], row.base_sha256, ident, why, ref))
                elif why.startswith(MISMATCH):
                    mismatch = _from_row(KIND_REPLAY_MISMATCH, by_host[c.host], row.base_sha256, ident, why, None)
                    _add_mismatch(store, log, mismatch, ident, row.round_seed, Path(by_host[c.host].path))
    return [e for e in log.records() if e.epoch == epoch]


def _add_mismatch(
    store: Store, log: EvidenceLog, ev: Evidence, ident: RoundIdentity, seed: bytes | None, payload: Path
) -> None:
    """A replay mismatch, with the host's payload kept beside the record (`payload_file`, which a voter
    checks against the signed digest), so a voter re-runs the replay and the payload check from the
    record and public inputs (the base checkpoint and the recipe on chain) alone; in a top-k round also
    the host's signed opening it was judged on (its record under `other` and its body kept beside the
    record), so a voter checks that the opening is the host's, and what its challenge was drawn from (the
    round's seed, the residual's layout, the sample), so a voter recomputes the challenged chunks and
    re-checks an opening claimed not to answer them (`claim` "unverified"); one that answers them
    ("judged") failed on its payload or its replay, which a voter re-runs as for any replay mismatch."""
    files: dict[str, Path] = {}
    if payload.is_file():
        ev = replace(ev, payload_file=f"{ev.header['payload_sha256']}.payload")
        files[ev.payload_file] = payload
    opened = store.opening(ev.epoch, ev.round, bytes.fromhex(ev.header["host"]))
    if opened is None or ident.layout is None or seed is None:
        log.add(ev, files)
        return
    name = f"{opened.body_sha256.hex()}.opening"
    record = OpeningRecord(
        chain_id=ev.header["chain_id"], registry=bytes.fromhex(ev.header["registry"]), epoch=opened.epoch,
        round=opened.round, host=bytes(opened.host), previous_root=bytes(opened.previous_root),
        residual_root=bytes(opened.residual_root), body_sha256=bytes(opened.body_sha256),
        body_length=opened.body_length, timestamp_ms=opened.timestamp_ms,
    )
    drawn = ChallengeTerms(seed, ident.layout, *ident.sample).as_record()
    answers = _answers(record, Path(opened.path).read_bytes(), drawn)
    other = {"opening": header_fields(record), "signature": bytes(opened.signature).hex(), "body_file": name,
             "challenge": drawn, "claim": "judged" if answers else "unverified"}
    log.add(replace(ev, other=other), {**files, name: Path(opened.path)})


def _answers(record: OpeningRecord, body: bytes, drawn: dict[str, Any]) -> bool:
    """Whether `body` answers the challenge `drawn` describes: it opens exactly the chunks drawn from the
    seed for this host and round, and both openings verify against the roots the record signs."""
    layout = ChunkLayout(tuple((str(n), int(k)) for n, k in drawn["tensors"]), int(drawn["chunk"]))
    sample = challenge(bytes.fromhex(drawn["round_seed"]), record.round, record.host, layout,
                       float(drawn["fraction"]), int(drawn["min_elements"]))
    try:
        previous, current = decode_body(body, sample)
    except OpeningError:
        return False
    return (verify_opening(record.previous_root, previous, layout, sample)
            and verify_opening(record.residual_root, current, layout, sample))


def _opening_holds(
    ev: Evidence, sub: Submission, node_key: bytes, evidence_dir: Path | None, terms: ChallengeTerms | None
) -> bool:
    """A mismatch judged on an opening: the opening is signed by the same key, opens this submission's
    signed root in its round, and the kept body hashes to the signed digest and length."""
    other = ev.other or {}
    if "opening" not in other:
        return True
    fields: dict[str, Any] = {k: bytes.fromhex(v) if k in OPENING_HEX else v for k, v in other["opening"].items()}
    record = OpeningRecord(**fields)
    if not record.verify(bytes.fromhex(other["signature"]), node_key):
        return False
    if (record.epoch, record.round, record.host, record.residual_root) != (
            sub.epoch, sub.round, sub.host, sub.residual_root):
        return False
    if evidence_dir is None:
        return True
    if other["body_file"] != f"{record.body_sha256.hex()}.opening":  # a record names no other file
        return False
    data = (evidence_dir / other["body_file"]).read_bytes()
    if hashlib.sha256(data).digest() != record.body_sha256 or len(data) != record.body_length:
        return False
    # A claim that the opening does not answer its challenge is re-checked here, against the challenge
    # the verifier knows; a "judged" one (it answers, and failed on its payload or replay, which a voter
    # re-runs with the payloads as for any replay mismatch) only as far as that it does answer.
    if other.get("claim") == "judged":
        return _answers(record, data, other["challenge"])
    return terms is not None and other["challenge"] == terms.as_record() and not _answers(record, data, other["challenge"])


def _copied_from(store: Store, epoch: int, round_: int, reason: str) -> SubmissionRow | None:
    """The submission a near-copy reason names: "… with 0x<host>, round <r> …" (an earlier round) or
    "… with 0x<host>, whose header arrived earlier" (the same round)."""
    found = re.search(r"with 0x([0-9a-f]{40}), (?:round (\d+))?", reason)
    if found is None:
        return None
    host, source_round = bytes.fromhex(found.group(1)), int(found.group(2) or round_)
    return next((s for s in store.submissions(epoch, source_round) if s.host == host), None)


def _ref(s: SubmissionRow) -> dict[str, Any]:
    return {"host": to_checksum_address(s.host), "round": s.round, "payload_sha256": s.payload_sha256.hex(),
            "signature": bytes(s.signature).hex()}


def _from_row(
    kind: str, s: SubmissionRow, base: bytes, ident: RoundIdentity, detail: str, other: dict[str, Any] | None
) -> Evidence:
    sub = Submission(
        chain_id=ident.chain_id, registry=ident.registry, epoch=s.epoch, round=s.round, host=bytes(s.host),
        base_checkpoint_sha256=base, codec=ident.codec, payload_sha256=bytes(s.payload_sha256),
        payload_length=s.payload_length, tokens_trained=s.tokens_trained, timestamp_ms=s.timestamp_ms,
        residual_root=bytes(s.residual_root),
    )
    return Evidence(kind, s.epoch, s.round, to_checksum_address(s.host), header_fields(sub),
                    bytes(s.signature).hex(), detail, other)


@dataclass(frozen=True)
class SlashDecision:
    host: str
    amount: int
    evidence: Evidence


def decide(records: Iterable[Evidence], remaining_stake: dict[str, int]) -> list[SlashDecision]:
    """The documented rule: a host with any SLASHABLE evidence loses its whole remaining stake,
    once, citing its first record (by round, then kind)."""
    out: dict[str, SlashDecision] = {}
    for ev in sorted(records, key=lambda e: (e.round, e.kind, e.hash)):
        if ev.kind in SLASHABLE and ev.host not in out and remaining_stake.get(ev.host, 0) > 0:
            out[ev.host] = SlashDecision(ev.host, remaining_stake[ev.host], ev)
    return list(out.values())


def challengeable_stakes(chain: Any, epoch: int, hosts: Iterable[str]) -> dict[str, int]:
    """Each host's stake still at risk: 0 once withdrawn, and 0 while a challenge against it is open or
    after one was upheld (a second challenge on the same stake would only tie up a bond)."""
    challenged = {c.host for c in chain.challenges(epoch) if c.status in ("open", "upheld")}
    stakes = {}
    for host in set(hosts):
        info = chain.host_info(epoch, host)
        at_risk = not info.withdrawn and host not in challenged
        stakes[host] = info.stake - info.slashed if at_risk else 0
    return stakes


def challenge_all(
    challenger: Any, voters: Sequence[Any], epoch: int, records: Sequence[Evidence], evidence_uri: str = ""
) -> list[SlashDecision]:
    """Apply the rule through the chain's bonded challenges: `challenger` (any account holding the epoch's
    challenge bond) files one challenge per host the rule names, citing the evidence's sha256, and each of
    `voters` (aggregators of the epoch; `aggregator_quorum` of them resolve it) votes to uphold. Upheld,
    the host's whole remaining stake is slashed and the challenger gets its bond back with a share of it
    (Registry rules). Hosts already under an open or upheld challenge are skipped."""
    mine = [r for r in records if r.epoch == epoch]
    decisions = decide(mine, challengeable_stakes(challenger, epoch, (r.host for r in mine)))
    for d in decisions:
        challenge_id = challenger.challenge(epoch, d.host, d.evidence.hash, evidence_uri)
        for voter in voters:
            if voter.get_challenge(challenge_id).status != "open":
                break
            voter.vote_challenge(challenge_id, True)
    return decisions
