"""A host's upload to a sharded epoch (docs/PROTOCOL.md "Sharded aggregators"): the encoded payload cut
by fragment, and the fragments uploaded to every shard at once.

Fragment i's payload is the codec header for fragment i's tensors followed by those tensors' parts,
cut from the whole payload without decoding: a part depends on its tensor only, so this is byte for
byte what encoding the fragment alone gives. The host's submission counts only if every shard accepts
its fragment (the verifier aggregates a host only then): one refusal refuses the round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from nacl.signing import SigningKey

from gonka_node.core.client import SubmitRejected
from gonka_node.core.fragments import plan_fragments
from proto.gonka.v1 import aggregator_pb2 as pb
from training.codecs import HEADER_SIZE, Codec

Spec = Mapping[str, tuple[int, ...]]


class SplitError(ValueError):
    """A payload that is not the codec's encoding of the whole model: it cannot be cut by fragment."""


class ShardClient(Protocol):
    """What the upload needs of `core.client.AggregatorClient`, one per shard."""

    def open_round(self) -> pb.RoundInfo: ...

    def submit(
        self, info: pb.RoundInfo, host: bytes, payload: bytes, key: SigningKey, tokens_trained: int = 0
    ) -> pb.Receipt: ...


def split_payload(codec: Codec, payload: bytes, spec: Spec, shards: int) -> list[bytes]:
    """The S fragment payloads of a whole encoded payload, in fragment order."""
    if len(payload) != codec.encoded_size(spec):
        raise SplitError(
            f"payload is {len(payload)} bytes, the model's {codec.name} encoding is {codec.encoded_size(spec)}"
        )
    parts, pos = {}, HEADER_SIZE
    for name in sorted(spec):
        size = codec.encoded_size({name: spec[name]}) - HEADER_SIZE  # numel and section of this tensor
        parts[name], pos = payload[pos : pos + size], pos + size
    return [codec.header(f.spec(spec)) + b"".join(parts[n] for n in f.names) for f in plan_fragments(spec, shards)]


def submit_fragments(
    clients: Sequence[ShardClient], round_: int, fragments: Sequence[bytes], host: bytes, key: SigningKey,
    tokens: int,
) -> tuple[bool, str]:
    """Upload fragment i to shard i, all at once; (accepted by every shard, the refusals joined)."""
    if len(clients) != len(fragments):
        raise SplitError(f"{len(fragments)} fragments for {len(clients)} shards")

    def one(i: int) -> str:
        return _submit_one(i, clients[i], round_, fragments[i], host, key, tokens)

    with ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="shard-upload") as pool:
        refusals = [r for r in pool.map(one, range(len(clients))) if r]
    return not refusals, "; ".join(refusals)


def _submit_one(
    i: int, client: ShardClient, round_: int, fragment: bytes, host: bytes, key: SigningKey, tokens: int
) -> str:
    """"" when shard i holds the fragment (now, or from an earlier upload: DUPLICATE); else its refusal."""
    info = client.open_round()
    if info.round != round_:
        return f"shard {i}: round {round_} is not open there (it is at round {info.round})"
    try:
        client.submit(info, host, fragment, key, tokens)
    except SubmitRejected as exc:
        if exc.reason == "DUPLICATE":
            return ""
        return f"shard {i}: {exc.reason or exc.code.name}: {exc.message}"
    return ""
