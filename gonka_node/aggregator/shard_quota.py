"""How much one peer shard may have a receiver hold for one round (docs/PROTOCOL.md "The Shard
service", "Quotas"): at most as many messages (distinct slots) and bytes as an honest shard sends in a
round, so a stranger who staked as an aggregator cannot fill a receiver's disk with keys or bodies.

An honest shard k sends, per round: one report, one fragment hash, one verdict (shard 0 alone), and
blobs (`shard_close.put_sampled`): its fragment payload of each picked host (at most the epoch's
`max_hosts`; a fragment payload has exactly the codec's size for fragment k) and its fragment of the
round's base checkpoint (fp32 safetensors). The JSON bodies are bounded from their fields with room to
spare: a quota an honest round exceeds would stall it, one a little loose costs a little disk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gonka_node.aggregator.close import PUBLIC_ROUNDS
from gonka_node.aggregator.validate import SKETCH_BUCKETS, Codec
from gonka_node.core.fragments import plan_fragments
from gonka_node.core.shard_envelope import ShardKind, ShardMessage

if TYPE_CHECKING:
    from gonka_node.aggregator.engine_types import EpochContext

HASH_BYTES = 32
KINDS_BESIDE_PAYLOADS = 4  # report, hash, verdict, base
SKETCH_JSON = 4 * math.ceil(4 * SKETCH_BUCKETS / 3)  # an fp32 count sketch in base64
FLOAT_JSON = 32  # a float's repr with its separator
SIGNED_JSON = 384  # the host's signed header in a report entry: digest, length, tokens, time, root, signature
HOST_JSON = 256 + SKETCH_JSON + SIGNED_JSON  # one report host entry without its norms: address, times, brackets
SKETCH_ENTRY_JSON = 256 + SKETCH_JSON  # one earlier-round or public entry: its round, host or label
VERDICT_FIXED = 4 << 10
VERDICT_PER_SHARD = 70  # the digest of one shard's report the verdict names, in hex with its separator
VERDICT_PER_HOST = 16 << 10  # a row (score, reward, its reasons), the address aggregated, its clip norm
SAFETENSORS_SLACK = 64 << 10  # a fragment file's header beyond its tensors' entries: the metadata


def _json_name(name: str) -> int:
    return 6 * len(name) + 4  # every character escaped (\uXXXX), quotes and separator


@dataclass(frozen=True)
class Quota:
    """What one sender may have a receiver hold for one round: slots, bytes, and each body's largest."""

    keys: int
    bytes: int
    report: int
    verdict: int
    payload: int
    base: int

    def largest(self, h: ShardMessage) -> int:
        """The largest body an honest sender puts in `h`'s slot."""
        if h.kind == ShardKind.BLOB:
            return self.base if h.key == "base" else self.payload
        return {ShardKind.REPORT: self.report, ShardKind.VERDICT: self.verdict}.get(h.kind, HASH_BYTES)


QuotaRule = Callable[[int, int], Quota]  # (sender, round) -> its quota


@dataclass(frozen=True)
class ShardBudget:
    """The epoch's facts a quota is sized from: its host limit, codec and each shard's fragment."""

    max_hosts: int
    codec_for: Callable[[int], Codec]  # the codec as used in a round (its sizes may differ per round)
    fragments: tuple[Mapping[str, tuple[int, ...]], ...]  # shard k's fragment spec
    metadata_bytes: int = 0  # the checkpoint metadata's variable part (the model config JSON)
    _payload: dict[tuple[int, int], int] = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, ctx: EpochContext, max_hosts: int) -> ShardBudget:
        assert ctx.shard is not None, "a quota is for a sharded epoch"
        whole = ctx.shard.whole_spec
        fragments = tuple(f.spec(whole) for f in plan_fragments(whole, ctx.shard.count))
        return cls(max_hosts, ctx.codec_for, fragments, len(ctx.model_config or ""))

    def __call__(self, sender: int, round_: int) -> Quota:
        report, verdict = self.report_bytes(sender, round_), self.verdict_bytes()
        payload, base = self.payload_bytes(sender, round_), self.base_bytes(sender)
        total = self.max_hosts * payload + base + report + verdict + HASH_BYTES
        return Quota(self.max_hosts + KINDS_BESIDE_PAYLOADS, total, report, verdict, payload, base)

    def payload_bytes(self, sender: int, round_: int) -> int:
        """Shard `sender`'s fragment payload of one host: exactly the codec's size (cached per round)."""
        if (sender, round_) not in self._payload:
            self._payload[(sender, round_)] = self.codec_for(round_).encoded_size(self.fragments[sender])
        return self._payload[(sender, round_)]

    def base_bytes(self, sender: int) -> int:
        """Shard `sender`'s fragment of a checkpoint: fp32 tensors and a safetensors header."""
        spec = self.fragments[sender]
        entries = sum(128 + _json_name(n) + 24 * len(s) for n, s in spec.items())
        return 4 * sum(math.prod(s) for s in spec.values()) + entries + SAFETENSORS_SLACK + 6 * self.metadata_bytes

    def report_bytes(self, sender: int, round_: int) -> int:
        """A `FragmentReport`: per host its norms and sketch, the earlier rounds' sketches, the public ones."""
        spec = self.fragments[sender]
        hosts = self.max_hosts * (HOST_JSON + 2 * len(spec) * FLOAT_JSON)
        earlier = max(0, round_ - 1) * self.max_hosts * SKETCH_ENTRY_JSON
        fixed = 1024 + sum(_json_name(n) for n in spec)
        return fixed + hosts + earlier + (1 + PUBLIC_ROUNDS) * SKETCH_ENTRY_JSON

    def verdict_bytes(self) -> int:
        return VERDICT_FIXED + len(self.fragments) * VERDICT_PER_SHARD + self.max_hosts * VERDICT_PER_HOST


def over_quota(q: Quota, h: ShardMessage, slot: str, held: Mapping[str, int], pending: Mapping[int, tuple[str, int]]) -> str:
    """Why holding `h` in `slot` would put its sender over `q` ("" when it fits), given the sender's
    bodies `held` for the round (slot -> bytes; the one in `slot` is replaced) and those still streaming."""
    slots = set(held) | {s for s, _ in pending.values()} | {slot}
    if len(slots) > q.keys:
        return f"shard {h.sender} would hold {len(slots)} messages for round {h.epoch}/{h.round}, its quota is {q.keys}"
    total = sum(n for s, n in held.items() if s != slot) + sum(n for _, n in pending.values()) + h.body_length
    if total > q.bytes:
        return f"shard {h.sender} would hold {total} bytes for round {h.epoch}/{h.round}, its quota is {q.bytes}"
    return ""
