"""What the aggregator serves of its finalized rounds as file streams: checkpoints (the Checkpoints
service, and the Aggregator service's GetCheckpoint) and round updates, each a `FileMeta` (length,
sha256 of the file, the content hash the chain records) followed by the file's chunks."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.store import STEPPED
from proto.gonka.v1 import checkpoints_pb2 as cpb
from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc
from proto.gonka.v1 import common_pb2 as common

FILE_CHUNK = 1 << 20


async def stream_file(path: Path, meta: common.FileMeta) -> AsyncIterator[common.FileChunk]:
    yield common.FileChunk(meta=meta)
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, FILE_CHUNK):
            yield common.FileChunk(data=chunk)


async def file_meta(path: Path, epoch: int, round_: int, content_sha256: bytes) -> common.FileMeta:
    def digest() -> bytes:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(FILE_CHUNK):
                h.update(block)
        return h.digest()

    return common.FileMeta(
        length=path.stat().st_size,
        file_sha256=await asyncio.to_thread(digest),
        content_sha256=content_sha256,
        epoch=epoch,
        round=round_,
        format="safetensors",
    )


async def checkpoint_stream(
    engine: RoundEngine, epoch: int, round_: int, context: grpc.aio.ServicerContext
) -> AsyncIterator[common.FileChunk]:
    if epoch != engine.ctx.epoch:
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"this aggregator serves epoch {engine.ctx.epoch}, not {epoch}"
        )
    if round_ == 0:
        path, sha = engine.ctx.initial_checkpoint, engine.ctx.initial_sha256
    else:
        row = engine.store.get_round(epoch, round_)
        if row is None or row.state not in STEPPED:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint for round {epoch}/{round_}")
        assert row is not None and row.checkpoint_sha256 is not None
        path, sha = engine.store.checkpoint_path(epoch, round_), row.checkpoint_sha256
    async for chunk in stream_file(path, await file_meta(path, epoch, round_, sha)):
        yield chunk


class CheckpointsService(cpb_grpc.CheckpointsServicer):
    def __init__(self, engine: RoundEngine, model_name: str = "") -> None:
        self.engine = engine
        self.model_name = model_name

    async def ListEpochs(
        self, request: cpb.ListEpochsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ListEpochsResponse:
        e = self.engine
        done = [r for r in e.store.rounds(e.ctx.epoch) if r.state == "finalized"]
        return cpb.ListEpochsResponse(
            epochs=[
                cpb.EpochSummary(
                    epoch=e.ctx.epoch,
                    model=self.model_name,
                    codec=e.ctx.codec_name,
                    rounds_finalized=len(done),
                    initial_checkpoint_sha256=e.ctx.initial_sha256,
                    latest_checkpoint_sha256=done[-1].checkpoint_sha256 if done else e.ctx.initial_sha256,
                )
            ]
        )

    async def ListRounds(
        self, request: cpb.ListRoundsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ListRoundsResponse:
        e = self.engine
        out = []
        for r in e.store.rounds(request.epoch):
            if r.state not in ("finalized", "skipped"):
                continue
            on_chain = await asyncio.to_thread(e.chain.round_result, r.epoch, r.round)
            out.append(
                cpb.RoundSummary(
                    epoch=r.epoch,
                    round=r.round,
                    state=r.state,
                    checkpoint_sha256=bytes(on_chain.checkpoint_sha256),
                    rewards_root=bytes(on_chain.rewards_root),
                    contributors=on_chain.n_contributors,
                    total_reward=on_chain.total_reward,
                )
            )
        return cpb.ListRoundsResponse(rounds=out)

    async def StreamCheckpoint(
        self, request: cpb.StreamCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common.FileChunk]:
        async for chunk in checkpoint_stream(self.engine, request.epoch, request.round, context):
            yield chunk
