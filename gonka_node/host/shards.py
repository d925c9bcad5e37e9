"""A host's upload to a sharded epoch (docs/PROTOCOL.md "Sharded aggregators"): the encoded payload cut
by fragment, and the fragments uploaded to every shard at once.

Fragment i's payload is the codec header for fragment i's tensors followed by those tensors' parts,
cut from the whole payload without decoding: a part depends on its tensor only, so this is byte for
byte what encoding the fragment alone gives. The host's submission counts only if every shard accepts
its fragment (the verifier aggregates a host only then): one refusal refuses the round.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc
import torch
from nacl.signing import SigningKey
from safetensors.torch import load, save
from torch import Tensor

from gonka_node.core.client import AggregatorClient, Downloaded, SubmitRejected
from gonka_node.core.discovery import MissingPinError
from gonka_node.core.fragments import plain_metadata, plan_fragments
from gonka_node.core.link import Link
from gonka_node.core.recipe import Recipe
from gonka_node.core.wire import NO_RESIDUAL
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import common_pb2 as common
from training.codecs import HEADER_SIZE, Codec

Spec = Mapping[str, tuple[int, ...]]


class SplitError(ValueError):
    """A payload that is not the codec's encoding of the whole model: it cannot be cut by fragment."""


class ShardClient(Protocol):
    """What the upload needs of `core.client.AggregatorClient`, one per shard."""

    def open_round(self) -> pb.RoundInfo: ...

    def submit(
        self, info: pb.RoundInfo, host: bytes, payload: bytes, key: SigningKey, tokens_trained: int = 0, *,
        residual_root: bytes = NO_RESIDUAL,
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


def join_payload(codec: Codec, fragments: Sequence[bytes], spec: Spec) -> bytes:
    """The whole encoded payload of S fragment payloads in fragment order (`split_payload`'s inverse:
    a sharded epoch's compressed broadcast, one fragment from each shard). Each fragment must be its
    fragment's encoding in length and header; its values are checked where the result is (decoded,
    then the stepped model against the chain's hash)."""
    sections: dict[str, bytes] = {}
    for fragment, data in zip(plan_fragments(spec, len(fragments)), fragments, strict=True):
        own = fragment.spec(spec)
        header = codec.header(own)
        if len(data) != codec.encoded_size(own) or data[:HEADER_SIZE] != header:
            raise SplitError(f"fragment {fragment.index}: not the {codec.name} encoding of its "
                             f"{len(own)} tensors ({len(data)} bytes, {codec.encoded_size(own)} expected)")
        pos = HEADER_SIZE
        for name in fragment.names:  # sorted, as the fragment's payload lays them out
            size = codec.encoded_size({name: spec[name]}) - HEADER_SIZE
            sections[name], pos = data[pos : pos + size], pos + size
    return codec.header(spec) + b"".join(sections[name] for name in sorted(spec))


def submit_fragments(
    clients: Sequence[ShardClient], round_: int, fragments: Sequence[bytes], host: bytes, key: SigningKey,
    tokens: int, *, residual_root: bytes = NO_RESIDUAL,
) -> tuple[bool, str]:
    """Upload fragment i to shard i, all at once; (accepted by every shard, the refusals joined). Every
    fragment's header signs the same `residual_root`: the host's whole residual's."""
    refusals = _refusals(clients, round_, fragments, host, key, tokens, residual_root)
    return not refusals, "; ".join(f"shard {i}: {r.reason or r.code.name}: {r.message}" for i, r in refusals)


def _refusals(
    clients: Sequence[ShardClient], round_: int, fragments: Sequence[bytes], host: bytes, key: SigningKey,
    tokens: int, residual_root: bytes = NO_RESIDUAL,
) -> list[tuple[int, SubmitRejected]]:
    if len(clients) != len(fragments):
        raise SplitError(f"{len(fragments)} fragments for {len(clients)} shards")
    if not clients:  # every shard holds it already (a retry)
        return []

    def one(i: int) -> SubmitRejected | None:
        return _submit_one(clients[i], round_, fragments[i], host, key, tokens, residual_root)

    with ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="shard-upload") as pool:
        return [(i, r) for i, r in enumerate(pool.map(one, range(len(clients)))) if r is not None]


def _submit_one(
    client: ShardClient, round_: int, fragment: bytes, host: bytes, key: SigningKey, tokens: int,
    residual_root: bytes,
) -> SubmitRejected | None:
    """None when the shard holds the fragment (now, or from an earlier upload: DUPLICATE); else its refusal.
    A shard that cannot be reached (down, restarting) is a refusal with its gRPC code, which the host
    daemon retries like any UNAVAILABLE upload, rather than an error that would end it."""
    try:
        info = client.open_round()
    except grpc.RpcError as exc:
        return SubmitRejected(exc.code(), "", f"open_round: {exc.details() or exc.code().name}", None)
    if info.round != round_:
        why = f"round {round_} is not open there (it is at round {info.round})"
        return SubmitRejected(grpc.StatusCode.FAILED_PRECONDITION, "LATE" if info.round > round_ else "", why, None)
    try:
        client.submit(info, host, fragment, key, tokens, residual_root=residual_root)
    except SubmitRejected as exc:
        return None if exc.reason == "DUPLICATE" else exc
    return None


def sharded_aggregator(chain: Any, epoch: int, recipe: Recipe, link: Link | None = None) -> ShardedAggregator:
    """The epoch's shards as announced on chain (the spec's order is the shards' order), each pinned to
    its announced certificate; refused with one line until every shard has announced."""
    from training.codecs import get_codec, round_seed
    from training.model import Llama

    announced = chain.aggregator_endpoints(epoch)
    if len(announced) != recipe.shards:
        raise MissingPinError(
            f"epoch {epoch} has {recipe.shards} aggregator shards and {len(announced)} announced their endpoint "
            "on chain: a host uploads to every shard, so it waits until all have announced"
        )
    with torch.device("meta"):  # shapes only
        spec = {n: tuple(p.shape) for n, p in Llama(recipe.model).named_parameters()}
    codec = get_codec(recipe.codec)
    clients = [AggregatorClient(a.endpoint, a.tls_cert_pem, link=link) for a in announced]
    return ShardedAggregator(clients, lambda r: codec.for_round(round_seed(recipe.epoch_seed, r)), spec,
                             recipe.broadcast)


class ShardedAggregator:
    """An epoch's S shards behind the one-aggregator surface the host calls (`AggregatorClient`'s):
    rounds are opened and results read at shard 0; a payload goes to every shard by fragment; a
    round's update and checkpoint are every shard's fragment merged (check them with
    `core.fragments.model_root` against the chain)."""

    def __init__(self, clients: Sequence[AggregatorClient], codec_for: Callable[[int], Codec], spec: Spec,
                 broadcast: str = "dense") -> None:
        self.clients, self.codec_for, self.spec = list(clients), codec_for, dict(spec)
        self.broadcast = broadcast  # the recipe's: "codec" updates are payloads joined, not files merged
        self.target = ", ".join(c.target for c in self.clients)
        # (round, host) -> the shards that hold its fragment: a retry skips them (one that reached its
        # quorum is closing and refuses even to open the round, so it cannot answer DUPLICATE)
        self._held: dict[tuple[int, bytes], set[int]] = {}

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def open_round(self) -> pb.RoundInfo:
        return self.clients[0].open_round()

    def submit(
        self, info: pb.RoundInfo, host: bytes, payload: bytes, key: SigningKey, tokens_trained: int = 0, *,
        residual_root: bytes = NO_RESIDUAL,
    ) -> None:
        """Every shard's fragment accepted, or the first refusal raised (its code and reason kept, so a
        retry re-sends only what is missing: shards that accepted it before are skipped)."""
        fragments = split_payload(self.codec_for(info.round), payload, self.spec, len(self.clients))
        held = self._held.setdefault((info.round, host), set())
        todo = [i for i in range(len(self.clients)) if i not in held]
        found = _refusals([self.clients[i] for i in todo], info.round, [fragments[i] for i in todo], host, key,
                          tokens_trained, residual_root)
        refusals = [(todo[j], r) for j, r in found]
        held.update(set(todo) - {i for i, _ in refusals})
        for i, r in refusals:
            if r.code == grpc.StatusCode.UNAVAILABLE:
                self._redial(i)
        if refusals:
            i, first = refusals[0]
            raise SubmitRejected(first.code, first.reason, f"shard {i}: {first.message}", first.receipt)

    def _redial(self, i: int) -> None:
        """A fresh channel to shard i, so that a restarted shard is reached at the host's next retry
        rather than after the old channel's reconnect backoff (gRPC's grows towards minutes)."""
        old = self.clients[i]
        self.clients[i] = AggregatorClient(old.target, old.tls_cert_pem, old.timeout_s, old.link)
        old.close()

    def round_result(self, epoch: int, round_: int) -> pb.RoundResult:
        return self.clients[0].round_result(epoch, round_)

    def reward_proof(self, epoch: int, round_: int, host: bytes) -> pb.RewardProof:
        return self.clients[0].reward_proof(epoch, round_, host)

    def round_update(self, epoch: int, round_: int) -> Downloaded:
        parts = [c.round_update(epoch, round_) for c in self.clients]
        if self.broadcast != "codec":
            return _merged(parts)
        data = join_payload(self.codec_for(round_), [p.data for p in parts], self.spec)
        return Downloaded(_meta_of(parts[0].meta, data), data)

    def checkpoint(self, epoch: int, round_: int) -> Downloaded:
        return _merged([c.checkpoint(epoch, round_) for c in self.clients])


def _merged(parts: Sequence[Downloaded]) -> Downloaded:
    """The shards' safetensors files as one (their tensors are disjoint), described by a FileMeta of its own."""
    tensors: dict[str, Tensor] = {}
    for part in parts:
        tensors.update(load(part.data))
    data = save(tensors, metadata=_plain_metadata(parts[0].data))
    return Downloaded(_meta_of(parts[0].meta, data), data)


def _meta_of(first: common.FileMeta, data: bytes) -> common.FileMeta:
    """The first part's FileMeta (epoch, round, content hash), describing `data`'s bytes."""
    meta = common.FileMeta()
    meta.CopyFrom(first)
    meta.length, meta.file_sha256 = len(data), hashlib.sha256(data).digest()
    return meta


def _plain_metadata(data: bytes) -> dict[str, str]:
    (size,) = struct.unpack_from("<Q", data, 0)
    return plain_metadata(json.loads(data[8 : 8 + size]).get("__metadata__") or {})

