"""The `Shard` gRPC servicer: translates protobuf to the shard's `NetExchange` and `Inbox`, and nothing
else (docs/PROTOCOL.md "The Shard service").

A Put is checked in the order that costs an unauthenticated sender least: the envelope's fields, round
and declared size, then the signature under the sender's node key, then the sender's quota for the round
(reserved), and only then is the body read: streamed to a file beside its slot (`shard_receive`), one
chunk in memory at a time, bounded by the signed length and checked against the signed digest. A
refusal ends the call with a status per reason, the reason's name in trailing metadata
`gonka-shard-reason`, and a message; nothing is stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from gonka_node.aggregator.shard_inbox import ShardReason, ShardRefused
from gonka_node.aggregator.shard_net import CHUNK, REASON_KEY, NetExchange, message_from_pb
from gonka_node.aggregator.shard_receive import Incoming
from gonka_node.core.shard_envelope import ShardMessage
from proto.gonka.v1 import shard_pb2 as spb
from proto.gonka.v1 import shard_pb2_grpc as spb_grpc

log = logging.getLogger(__name__)

STATUS: dict[ShardReason, grpc.StatusCode] = {
    ShardReason.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    ShardReason.WRONG_CHAIN: grpc.StatusCode.FAILED_PRECONDITION,
    ShardReason.WRONG_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    ShardReason.UNKNOWN_SHARD: grpc.StatusCode.PERMISSION_DENIED,
    ShardReason.BAD_SIGNATURE: grpc.StatusCode.UNAUTHENTICATED,
    ShardReason.STALE_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
    ShardReason.FUTURE_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
    ShardReason.REPLAYED: grpc.StatusCode.ALREADY_EXISTS,
    ShardReason.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    ShardReason.NOT_PERMITTED: grpc.StatusCode.PERMISSION_DENIED,
    ShardReason.OVERSIZE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShardReason.DIGEST_MISMATCH: grpc.StatusCode.DATA_LOSS,
    ShardReason.QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShardReason.UNHELD_HOST: grpc.StatusCode.FAILED_PRECONDITION,
    ShardReason.SEED_PENDING: grpc.StatusCode.FAILED_PRECONDITION,
    ShardReason.NOT_SAMPLED: grpc.StatusCode.PERMISSION_DENIED,
}


class ShardService(spb_grpc.ShardServicer):
    def __init__(self, exchange: NetExchange) -> None:
        self.exchange = exchange

    async def Hello(self, request: spb.ShardHelloRequest, context: grpc.aio.ServicerContext) -> spb.ShardHello:
        me = self.exchange.me
        return spb.ShardHello(epoch=me.epoch, index=me.index, count=me.count, node_key=self.exchange.node_key_bytes)

    async def Put(self, requests: AsyncIterator[spb.ShardPut], context: grpc.aio.ServicerContext) -> spb.ShardAck:
        try:
            stored = await self._put(requests)
        except ShardRefused as exc:
            log.info("refused a shard message: %s", exc)
            await context.abort(STATUS[exc.reason], exc.message, trailing_metadata=((REASON_KEY, exc.reason.name),))
            raise AssertionError("unreachable: abort raises") from exc
        return spb.ShardAck(stored=stored)

    async def _put(self, requests: AsyncIterator[spb.ShardPut]) -> bool:
        first = await anext(aiter(requests), None)
        if first is None or first.WhichOneof("part") != "envelope":
            raise ShardRefused(ShardReason.MALFORMED, "a Put starts with the signed envelope")
        header = message_from_pb(first.envelope)
        signature = bytes(first.envelope.signature)
        # The store and a peer are read, the quota reserved and the file opened: off the loop.
        admitting = asyncio.ensure_future(asyncio.to_thread(self._admit, header, signature))
        try:
            incoming = await asyncio.shield(admitting)
        except asyncio.CancelledError:
            # The stream ended (the peer reset it) while the thread admits: the thread still finishes, and
            # what it reserved and opened is given back then, never left to outlive the stream.
            admitting.add_done_callback(_discard_admitted)
            raise
        try:
            async for req in requests:
                data = req.data
                if req.WhichOneof("part") != "data" or len(data) > CHUNK:
                    raise ShardRefused(ShardReason.MALFORMED, f"after the envelope come body chunks of at most {CHUNK} bytes")
                await asyncio.to_thread(incoming.write, data)
            return await asyncio.to_thread(incoming.finish)
        finally:  # a refused or broken stream leaves no file and no reservation (off the loop: it takes a lock)
            await asyncio.to_thread(incoming.discard)

    def _admit(self, header: ShardMessage, signature: bytes) -> Incoming:
        inbox = self.exchange.inbox
        inbox.screen(header)  # before the key: a malformed or stale message costs nothing more
        inbox.admit(header, signature, self.exchange.known_key(header.sender))
        return Incoming(inbox, header, signature).open()


def _discard_admitted(done: asyncio.Future[Incoming]) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result().discard()
