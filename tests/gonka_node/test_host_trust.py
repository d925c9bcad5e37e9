"""A host refuses an aggregator whose model is not the chain's, before training and before uploading.

The host runs for real (recipe, tiny model, the embedded chain of test_host_node.py) against a small real
gRPC aggregator on 127.0.0.1:0 that offers a chosen base and serves chosen files, and counts uploads.
Two attacks: a round offered on a base other than the chain's; a checkpoint that does not hash to what
the chain records, offered with its own hash as the base (so only the host's check of the pulled file
against the chain stands between it and training on another model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save
from test_host_node import AGG, GNK, World, host_keys, world

from chain.seed import new_secret, seed_commitment
from gonka_node.core.client import AggregatorClient
from gonka_node.core.tls import create_identity, server_credentials
from gonka_node.host.events import HostEvents
from gonka_node.host.follow import FollowError
from gonka_node.host.node import HostError, HostNode, HostSettings
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc
from proto.gonka.v1 import common_pb2 as common
from training.checkpoint import canonical_sha256
from training.diloco import OuterOptimizer
from training.model import build_model

__all__ = ["world"]  # the fixture, shared with test_host_node.py


@dataclass
class Offering(pb_grpc.AggregatorServicer):
    """Offers `info` as the open round and serves `files[(kind, round)]`; refuses every upload."""

    info: pb.RoundInfo
    files: dict[tuple[str, int], bytes] = field(default_factory=dict)
    uploads: int = 0
    served: list[tuple[str, int]] = field(default_factory=list)

    def GetOpenRound(self, request: pb.GetOpenRoundRequest, context: grpc.ServicerContext) -> pb.RoundInfo:
        return self.info

    def Submit(self, request_iterator: Iterator[pb.SubmitRequest], context: grpc.ServicerContext) -> pb.Receipt:
        self.uploads += 1
        for _ in request_iterator:
            pass
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this test aggregator takes no uploads")
        raise AssertionError("unreachable")

    def GetRoundUpdate(self, request: pb.RoundRef, context: grpc.ServicerContext) -> Iterator[common.FileChunk]:
        return self._serve("update", request.round, context)

    def GetCheckpoint(self, request: pb.RoundRef, context: grpc.ServicerContext) -> Iterator[common.FileChunk]:
        return self._serve("checkpoint", request.round, context)

    def _serve(self, kind: str, round_: int, context: grpc.ServicerContext) -> Iterator[common.FileChunk]:
        self.served.append((kind, round_))
        data = self.files.get((kind, round_))
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no {kind} of round {round_} here")
        meta = common.FileMeta(length=len(data), file_sha256=hashlib.sha256(data).digest(), round=round_)
        yield common.FileChunk(meta=meta)
        yield common.FileChunk(data=data)


TLS = create_identity()  # the test aggregator's certificate, which the host pins


@pytest.fixture
def serve() -> Iterator:
    servers: list[grpc.Server] = []

    def start(servicer: Offering) -> str:
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_AggregatorServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(TLS))
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


class Recorder(HostEvents):
    def __init__(self) -> None:
        self.steps = 0

    def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
        self.steps += 1


class Waited(Exception):
    """The node went on to wait for a round result: it trained and uploaded instead of refusing."""


def never_wait(seconds: float) -> None:
    raise Waited


def round_info(w: World, round_: int, base: bytes) -> pb.RoundInfo:
    return pb.RoundInfo(
        chain_id=w.deployment.chain_id, registry=bytes.fromhex(w.deployment.registry[2:]), epoch=w.epoch,
        round=round_, base_checkpoint_sha256=base, codec=w.recipe.codec,
        limits=pb.Limits(max_chunk_bytes=1 << 16), aggregator_key=bytes(32),
    )


def run_host(w: World, target: str, state: Path) -> tuple[HostNode, Recorder]:
    events = Recorder()
    settings = HostSettings(epoch=w.epoch, stake=100 * GNK, state_dir=state, poll_s=0.01)
    node = HostNode(settings, w.recipe, w.client(1), AggregatorClient(target, TLS.cert_pem, 30.0), host_keys(1, w),
                    events, sleep=never_wait)
    return node, events


def initial_params(w: World) -> dict[str, torch.Tensor]:
    model = build_model(w.recipe.model, w.recipe.init_seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sha(params: dict[str, torch.Tensor]) -> bytes:
    return bytes.fromhex(canonical_sha256(params))


def test_a_round_on_a_base_other_than_the_chains_is_refused_before_training(
    world: World, serve, tmp_path: Path
) -> None:
    chains = sha(initial_params(world))  # round 0: the epoch's initial model
    offered = hashlib.sha256(b"another model").digest()
    agg = Offering(round_info(world, 1, offered))
    node, events = run_host(world, serve(agg), tmp_path / "host1")
    with pytest.raises(HostError) as refused:
        node.run()
    assert str(refused.value) == (
        f"round 1: the aggregator's base {offered.hex()[:16]}… differs from the chain's {chains.hex()[:16]}…"
    )
    assert agg.uploads == 0 and events.steps == 0 and agg.served == []


def test_a_checkpoint_the_chain_does_not_vouch_for_is_never_trained_on(
    world: World, serve, tmp_path: Path
) -> None:
    # Round 1 is finalized on chain with the honest outer step's model.
    honest = initial_params(world)
    g = torch.Generator().manual_seed(1)
    OuterOptimizer(world.recipe.outer_lr, world.recipe.outer_momentum).step(
        honest, {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in honest.items()}
    )
    aggregator = world.client(AGG)
    secret = new_secret()  # the round seed's commit–reveal, which finalize_round requires (p > 0)
    aggregator.commit_round_seed(world.epoch, 1, seed_commitment(secret))
    aggregator.reveal_round_seed(world.epoch, 1, secret)
    aggregator.finalize_round(world.epoch, 1, sha(honest), bytes(32), 0, 0)
    # The aggregator withholds the update (so the host must pull the checkpoint), serves another
    # model as round 1's checkpoint and offers round 2 on that model's hash.
    other = {n: t.clone() for n, t in honest.items()}
    first = next(iter(sorted(other)))
    other[first].view(-1)[0] += 1e-3
    agg = Offering(round_info(world, 2, sha(other)), {("checkpoint", 1): save(other)})
    node, events = run_host(world, serve(agg), tmp_path / "host1")
    with pytest.raises(FollowError) as refused:
        node.run()
    assert str(refused.value) == (
        f"checkpoint of round 1 hashes to {sha(other).hex()}, the chain records {sha(honest).hex()}"
    )
    assert agg.served == [("update", 1), ("checkpoint", 1)]
    assert agg.uploads == 0 and events.steps == 0
