"""Evidence against a shard, from its own signed messages (docs/SECURITY.md "Sharded aggregators",
docs/PROTOCOL.md "Shard evidence").

Two contradictions are provable from signatures alone:

- `shard_equivocation`: one shard signed two messages for the same slot (chain, registry, epoch, round,
  kind, sender, count, key) with different body digests, where an honest shard signs one body per
  slot: a REPORT (its account of the round) or a VERDICT (the verifier's decision).
- `verdict_contradicts_reports`: the verifier signed a verdict naming (by `report_digest`) S signed
  reports from which its clip norms, τ or host set do not follow (`shard_audit.contradiction`).

A record holds the signed messages whole (the 179-byte header, the signature, the body when held) and
the node key of each signer; `check_shard_evidence` re-checks it with nothing else. The chain holds no
stake of an aggregator and no node key of one (a shard learns a peer's key over the TLS channel pinned
to the certificate its account announced), so no on-chain rule can slash on a record yet: it is written
so that one could, once aggregators register a node key and stake, as hosts do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gonka_node.aggregator.shard import FragmentReport, Verdict, report_digest
from gonka_node.aggregator.shard_audit import contradiction
from gonka_node.core.envelope import SIGNATURE_BYTES, EnvelopeError
from gonka_node.core.shard_envelope import SHARD_MESSAGE_BYTES, ShardKind, ShardMessage
from training.durable import atomic_write

FORMAT = "gonka/shard-evidence/1"
KIND_EQUIVOCATION = "shard_equivocation"
KIND_VERDICT = "verdict_contradicts_reports"
ONE_PER_SLOT = (ShardKind.REPORT, ShardKind.VERDICT)  # kinds an honest shard signs one body of per round
VERIFIER = 0  # shard_inbox.VERIFIER (the inbox imports this module)
_UNREADABLE = (ValueError, KeyError, TypeError, IndexError, EnvelopeError, struct.error, binascii.Error)


@dataclass(frozen=True)
class SignedPart:
    """One signed shard message as the evidence keeps it; `body` None: not held (a second verdict is
    refused before its body is read; its signed header already commits to the body's digest)."""

    header: ShardMessage
    signature: bytes
    body: bytes | None

    def to_json(self) -> dict[str, Any]:
        body = None if self.body is None else base64.b64encode(self.body).decode("ascii")
        return {"header": self.header.canonical_bytes().hex(), "signature": self.signature.hex(), "body": body}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SignedPart:
        body = None if d["body"] is None else base64.b64decode(d["body"], validate=True)
        header = bytes.fromhex(d["header"])
        if len(header) != SHARD_MESSAGE_BYTES or len(bytes.fromhex(d["signature"])) != SIGNATURE_BYTES:
            raise ValueError(f"a header of {SHARD_MESSAGE_BYTES} bytes and a signature of {SIGNATURE_BYTES}")
        return cls(ShardMessage.from_canonical(header), bytes.fromhex(d["signature"]), body)

    def holds(self, keys: Mapping[int, bytes]) -> bool:
        """Signed by its sender's key in `keys`, and its body (when kept) is the signed one."""
        h, key = self.header, keys.get(self.header.sender)
        if key is None or not h.verify(self.signature, key):
            return False
        return self.body is None or (len(self.body) == h.body_length and _sha(self.body) == bytes(h.body_sha256))


@dataclass(frozen=True)
class ShardEvidence:
    kind: str
    accused: int  # the shard index whose signatures prove it
    node_keys: dict[int, bytes]  # every signer's ed25519 node key, by shard index
    messages: tuple[SignedPart, ...]
    detail: str  # the writer's account; `check_shard_evidence` recomputes rather than reads it

    def canonical(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "kind": self.kind, "accused": self.accused,
            "node_keys": {str(k): v.hex() for k, v in sorted(self.node_keys.items())},
            "messages": [m.to_json() for m in self.messages], "detail": self.detail,
        }, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @property
    def hash(self) -> bytes:
        return _sha(self.canonical())

    @classmethod
    def from_json(cls, text: str) -> ShardEvidence:
        d = json.loads(text)
        if d["format"] != FORMAT:
            raise ValueError(f"format {d['format']!r} is not {FORMAT!r}")
        keys = {int(k): bytes.fromhex(v) for k, v in d["node_keys"].items()}
        parts = tuple(SignedPart.from_json(m) for m in d["messages"])
        return cls(str(d["kind"]), int(d["accused"]), keys, parts, str(d["detail"]))


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# ---- writing -------------------------------------------------------------------------------------


def equivocation(held: SignedPart, new: SignedPart, key: bytes) -> ShardEvidence | None:
    """The record of `new` contradicting the `held` message of its slot (None: no contradiction)."""
    h = new.header
    ev = ShardEvidence(KIND_EQUIVOCATION, h.sender, {h.sender: key}, (held, new),
                       f"shard {h.sender} signed two {h.kind.name} bodies for round {h.epoch}/{h.round}")
    return ev if _equivocates(ev) else None


def verdict_evidence(
    verdict: SignedPart, reports: Sequence[SignedPart], keys: Mapping[int, bytes], why: str
) -> ShardEvidence:
    """The record of a verdict that does not follow from the signed reports it names."""
    h = verdict.header
    return ShardEvidence(KIND_VERDICT, h.sender, dict(keys), (verdict, *reports),
                         f"shard {h.sender}'s verdict for round {h.epoch}/{h.round}: {why}")


def write_evidence(folder: Path, ev: ShardEvidence) -> Path:
    """`<folder>/<sha256 of the record>.json`, written once and atomically; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path, data = folder / f"{ev.hash.hex()}.json", ev.canonical()
    if not path.exists():
        atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return path


# ---- re-checking ---------------------------------------------------------------------------------


def check_shard_evidence(path: Path, node_keys: Mapping[int, bytes] | None = None) -> str | None:
    """What the record at `path` proves against the shard it accuses (one line), or None when it proves
    nothing: unreadable, a signature or body that does not hold, or no contradiction. `node_keys`: the
    keys the checker knows for the shards (each must equal the record's); without, the record's own."""
    try:
        ev = ShardEvidence.from_json(path.read_text())
        if node_keys is not None and any(node_keys.get(k) != v for k, v in ev.node_keys.items()):
            return None
        if not ev.messages or not all(m.holds(ev.node_keys) for m in ev.messages):
            return None
        return _equivocates(ev) if ev.kind == KIND_EQUIVOCATION else _contradicts(ev)
    except (OSError, *_UNREADABLE):
        return None


def _equivocates(ev: ShardEvidence) -> str | None:
    if ev.kind != KIND_EQUIVOCATION or len(ev.messages) != 2:
        return None
    a, b = (m.header for m in ev.messages)
    same_slot = (a.slot, a.chain_id, bytes(a.registry), a.count) == (b.slot, b.chain_id, bytes(b.registry), b.count)
    if not same_slot or a.kind not in ONE_PER_SLOT or a.sender != ev.accused:
        return None
    if bytes(a.body_sha256) == bytes(b.body_sha256):
        return None
    return (f"shard {a.sender} signed two different {a.kind.name}s for round {a.epoch}/{a.round} "
            f"(body sha256 {bytes(a.body_sha256).hex()[:16]}… and {bytes(b.body_sha256).hex()[:16]}…)")


def _contradicts(ev: ShardEvidence) -> str | None:
    if ev.kind != KIND_VERDICT or ev.accused != VERIFIER or any(m.body is None for m in ev.messages):
        return None
    v = ev.messages[0].header
    if v.kind != ShardKind.VERDICT or v.sender != VERIFIER:
        return None
    verdict = Verdict.from_json(_text(ev.messages[0]))
    reports = [_report_of(m, v) for m in ev.messages[1:]]
    if (verdict.epoch, verdict.round) != (v.epoch, v.round) or [r.index if r else -1 for r in reports] != list(
        range(v.count)
    ):
        return None  # one report per shard, in shard order, each about the verdict's round
    whole = [r for r in reports if r is not None]
    if list(verdict.reports) != [report_digest(r) for r in whole]:
        return None  # not the reports the verdict names
    why = contradiction(verdict, whole)
    return None if why is None else (f"shard {VERIFIER}'s verdict for round {v.epoch}/{v.round} does not "
                                     f"follow from the signed reports it names: {why}")


def _report_of(m: SignedPart, verdict: ShardMessage) -> FragmentReport | None:
    """The report in `m` when it is its signer's report of the verdict's round and deployment, else None."""
    h = m.header
    if h.kind != ShardKind.REPORT or (h.chain_id, bytes(h.registry), h.epoch, h.round, h.count) != (
        verdict.chain_id, bytes(verdict.registry), verdict.epoch, verdict.round, verdict.count
    ):
        return None
    r = FragmentReport.from_json(_text(m))
    return r if (r.epoch, r.round, r.index, r.count) == (h.epoch, h.round, h.sender, h.count) else None


def _text(m: SignedPart) -> str:
    assert m.body is not None  # `_contradicts` takes only records whose messages are whole
    return m.body.decode("utf-8")
