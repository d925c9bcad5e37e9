"""A round's checkpoint streamed from the aggregators that serve it (gRPC `GetCheckpoint`, pinned TLS).

The explorer passes the bytes through without keeping them; it checks that each aggregator announces
the content sha256 the chain recorded before it sends anything. The client verifies the file itself
(`gonka-node checkpoint pull` does all of it).

In a sharded epoch each shard serves its fragment of the round (its file's metadata says
`"fragment": "k/S"`) and announces the chain's Merkle root; the explorer then takes one fragment from
each shard and streams them as one safetensors file: a header of its own (each fragment's tensors,
their offsets moved past the fragments before it, the round's metadata without the fragment's own),
then every fragment's data in turn, as it arrives. Only the headers are held.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from chain.types import AggregatorEndpoint
from gonka_node.core.client import MESSAGE_LIMIT
from gonka_node.core.fragments import FragmentError, merged_header
from gonka_node.core.tls import pinned_channel
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc

MAX_HEADER = 100 << 20  # safetensors' own bound on a header


class NoSource(LookupError):
    """No announced aggregator serves this checkpoint with the chain's hash."""


@dataclass
class CheckpointStream:
    source: str
    length: int
    chunks: Iterator[bytes]
    channels: list[grpc.Channel] = field(default_factory=list)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


@dataclass
class _Opened:
    """One aggregator's stream, its safetensors header read (and the data bytes read with it)."""

    endpoint: str
    channel: grpc.Channel
    length: int
    header: dict[str, Any]
    raw: bytes  # the bytes read so far: the 8-byte length, the header and maybe some data
    stream: Iterator[Any]

    @property
    def fragment(self) -> tuple[int, int] | None:
        meta = self.header.get("__metadata__")
        text = meta.get("fragment") if isinstance(meta, dict) else None
        if not isinstance(text, str):
            return None
        k, _, s = text.partition("/")
        return (int(k), int(s)) if k.isdigit() and s.isdigit() and int(k) < int(s) else None

    @property
    def header_size(self) -> int:
        return 8 + int(struct.unpack_from("<Q", self.raw)[0])

    def data(self, whole: bool = False) -> Iterator[bytes]:
        """The file's bytes from its data (or, `whole`, from its start) to its end."""
        yield self.raw if whole else self.raw[self.header_size :]
        for message in self.stream:
            yield message.data


def open_checkpoint(
    endpoints: Sequence[AggregatorEndpoint], epoch: int, round_: int, want_sha256: bytes, timeout_s: float
) -> CheckpointStream:
    """The first whole file whose stream announces `want_sha256`, or a sharded epoch's fragments (one
    per shard) merged; raises `NoSource` if neither can be had."""
    tried: list[str] = []
    fragments: dict[int, _Opened] = {}
    count = 0
    for agg in endpoints:
        opened = _open(agg, epoch, round_, want_sha256, timeout_s, tried)
        if opened is None:
            continue
        where = opened.fragment
        if where is None:
            for part in fragments.values():
                part.channel.close()
            return CheckpointStream(agg.endpoint, opened.length, opened.data(whole=True), [opened.channel])
        k, of = where
        if k in fragments or (fragments and of != count):
            tried.append(f"{agg.endpoint} (a fragment already held, or of another split)")
            opened.channel.close()
            continue
        fragments[k], count = opened, of
    if fragments and len(fragments) == count:
        try:
            return _merged([fragments[k] for k in range(count)])
        except (FragmentError, KeyError, TypeError, ValueError) as exc:  # headers that do not fit together
            tried.append(f"fragments that do not merge ({exc})")
    for part in fragments.values():
        part.channel.close()
    if fragments and len(fragments) < count:
        tried.append(f"fragments {sorted(fragments)} of {count} only")
    raise NoSource(f"no aggregator serves epoch {epoch} round {round_} with the chain's sha256"
                   + (f": tried {', '.join(tried)}" if tried else ": none announced"))


def _open(agg: AggregatorEndpoint, epoch: int, round_: int, want_sha256: bytes, timeout_s: float,
          tried: list[str]) -> _Opened | None:
    channel = pinned_channel(agg.endpoint, agg.tls_cert_pem, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)])
    try:
        stream = iter(pb_grpc.AggregatorStub(channel).GetCheckpoint(pb.RoundRef(epoch=epoch, round=round_),
                                                                    timeout=timeout_s))
        first = next(stream)
        if first.WhichOneof("part") != "meta" or bytes(first.meta.content_sha256) != want_sha256:
            tried.append(f"{agg.endpoint} (another checkpoint)")
        else:
            header, raw = _read_header(stream)
            return _Opened(agg.endpoint, channel, int(first.meta.length), header, raw, stream)
    except (grpc.RpcError, StopIteration) as exc:
        tried.append(f"{agg.endpoint} ({type(exc).__name__})")
    except ValueError as exc:
        tried.append(f"{agg.endpoint} (not a safetensors file: {exc})")
    channel.close()
    return None


def _read_header(stream: Iterator[Any]) -> tuple[dict[str, Any], bytes]:
    """The file's safetensors header, read from the stream's first chunks, and the bytes read."""
    buf = b""
    while len(buf) < 8:
        buf += next(stream).data
    (n,) = struct.unpack_from("<Q", buf)
    if n > MAX_HEADER:
        raise ValueError(f"a {n:,}-byte header")
    while len(buf) < 8 + n:
        buf += next(stream).data
    header = json.loads(buf[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, buf


def _merged(parts: list[_Opened]) -> CheckpointStream:
    """The fragments as one safetensors file: a merged header, then each fragment's data in turn."""
    head = merged_header([(part.header, part.length - part.header_size) for part in parts])

    def chunks() -> Iterator[bytes]:
        yield head
        for part in parts:
            yield from part.data()

    length = len(head) + sum(part.length - part.header_size for part in parts)
    return CheckpointStream(", ".join(p.endpoint for p in parts), length, chunks(), [p.channel for p in parts])
