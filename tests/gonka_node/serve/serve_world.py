"""A tiny real world for the model server's tests: the embedded chain served over JSON-RPC on
127.0.0.1, epoch 1 with its recipe published, rounds 0..2 finalized, and a TLS gRPC Checkpoints
service on 127.0.0.1:0 that the aggregator's account announced on chain, serving real checkpoint
files of the tiny model (round r: `build_model(tiny, seed=r)`). `finalize(r)` writes and finalizes a
further round while servers run, as an aggregator does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from checkpoint_kit import GNK, file_chunks, finalize, open_epoch, served_chain

from chain.client import ChainClient
from gonka_node.core.recipe import Recipe
from gonka_node.core.tls import create_identity, server_credentials
from gonka_node.serve.server import ModelServerHandle, ServeSettings, start_model_server
from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc
from proto.gonka.v1 import common_pb2 as common
from training.checkpoint import save_checkpoint
from training.hf_export import MODEL_CONFIG_KEY
from training.model import ModelConfig, build_model

TINY = ModelConfig.preset("tiny")


@dataclass
class FileServer(cpb_grpc.CheckpointsServicer):
    """Serves checkpoint files by (epoch, round), honestly."""

    files: dict[tuple[int, int], tuple[Path, bytes]] = field(default_factory=dict)  # -> (path, content sha)

    def StreamCheckpoint(self, request: Any, context: grpc.ServicerContext) -> Iterator[common.FileChunk]:
        key = (request.epoch, request.round)
        if key not in self.files:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint for {key}")
        path, content_sha = self.files[key]
        yield from file_chunks(request, path.read_bytes(), content_sha)


@dataclass
class ServeWorld:
    root: Path
    deployment: Path
    rpc_url: str
    epoch: int
    files: dict[int, Path]
    shas: dict[int, str]
    servicer: FileServer
    aggregator: ChainClient  # the aggregator's account: finalizes rounds
    stops: list[Any]
    model: ModelConfig = TINY

    def write_round(self, round_: int) -> str:
        path = self.root / f"served-{round_}.safetensors"
        tensors = build_model(self.model, seed=round_).state_dict()
        sha = save_checkpoint(path, tensors, {MODEL_CONFIG_KEY: json.dumps(self.model.to_dict())})
        self.files[round_], self.shas[round_] = path, sha
        self.servicer.files[(self.epoch, round_)] = (path, bytes.fromhex(sha))
        return sha

    def finalize(self, round_: int) -> str:
        """Write round `round_`'s checkpoint where the aggregator serves it, then finalize it on chain."""
        sha = self.write_round(round_)
        finalize(self.aggregator, self.epoch, round_, sha, bytes([round_]) * 32, 2, 1000 * GNK)
        return sha

    def close(self) -> None:
        for stop in reversed(self.stops):
            stop()


def build_world(root: Path, rounds: int = 2, n_rounds: int = 6, recipe: Recipe | None = None) -> ServeWorld:
    """`recipe` (default: the tiny model on bytes) is published on chain; its model is served."""
    recipe = recipe or Recipe(model=TINY)
    chain = served_chain(root)
    servicer = FileServer()
    world = ServeWorld(root, chain.deployment_file, chain.server.url, 0, {}, {}, servicer,
                       chain.gov.with_account(chain.accounts[1]), [chain.server.stop], recipe.model)
    init_sha = world.write_round(0)
    world.epoch = open_epoch(chain, recipe, init_sha, n_rounds)
    servicer.files = {(world.epoch, 0): servicer.files.pop((0, 0))}
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    cpb_grpc.add_CheckpointsServicer_to_server(servicer, grpc_server)
    identity = create_identity()
    port = grpc_server.add_secure_port("127.0.0.1:0", server_credentials(identity))
    grpc_server.start()
    world.stops.append(lambda: grpc_server.stop(0))
    # What a running aggregator does at start: its endpoint and certificate, and the epoch's recipe.
    world.aggregator.announce_aggregator(world.epoch, f"127.0.0.1:{port}", identity.cert_pem)
    world.aggregator.publish_recipe(world.epoch, recipe.canonical_json())
    for round_ in range(1, rounds + 1):
        world.finalize(round_)
    return world


def serve(world: ServeWorld, cache: Path, round_: str = "latest", tokenizer: Path | None = None,
          **settings: Any) -> ModelServerHandle:
    """A model server on 127.0.0.1 port 0 for `world`'s epoch, found through the chain."""
    return start_model_server(
        None, world.deployment, world.epoch, 0, round_=round_, cache_dir=cache,
        settings=ServeSettings(device="cpu", **settings), tokenizer=tokenizer,
    )
