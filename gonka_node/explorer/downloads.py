"""A round's checkpoint streamed from an aggregator that serves it (gRPC `GetCheckpoint`, pinned TLS).

The explorer passes the bytes through without keeping them; it checks that the aggregator announces
the content sha256 the chain recorded before it sends anything. The client verifies the file itself
(`gonka-node checkpoint pull` does all of it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from chain.types import AggregatorEndpoint
from gonka_node.core.client import MESSAGE_LIMIT
from gonka_node.core.tls import pinned_channel
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc


class NoSource(LookupError):
    """No announced aggregator serves this checkpoint with the chain's hash."""


@dataclass
class CheckpointStream:
    source: str
    length: int
    chunks: Iterator[bytes]
    channel: grpc.Channel

    def close(self) -> None:
        self.channel.close()


def open_checkpoint(
    endpoints: Sequence[AggregatorEndpoint], epoch: int, round_: int, want_sha256: bytes, timeout_s: float
) -> CheckpointStream:
    """The first aggregator whose stream announces `want_sha256`; raises `NoSource` if none does."""
    tried = []
    for agg in endpoints:
        channel = pinned_channel(agg.endpoint, agg.tls_cert_pem,
                                 options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)])
        try:
            stream = pb_grpc.AggregatorStub(channel).GetCheckpoint(pb.RoundRef(epoch=epoch, round=round_),
                                                                    timeout=timeout_s)
            first = next(iter(stream))
            if first.WhichOneof("part") == "meta" and bytes(first.meta.content_sha256) == want_sha256:
                return CheckpointStream(agg.endpoint, int(first.meta.length), (m.data for m in stream), channel)
            tried.append(f"{agg.endpoint} (another checkpoint)")
        except (grpc.RpcError, StopIteration) as exc:
            tried.append(f"{agg.endpoint} ({type(exc).__name__})")
        channel.close()
    raise NoSource(f"no aggregator serves epoch {epoch} round {round_} with the chain's sha256"
                   + (f": tried {', '.join(tried)}" if tried else ": none announced"))
