"""Two real host nodes against a real aggregator (gRPC on 127.0.0.1:0) and the embedded chain.

The epoch comes from a recipe: its hash is the epoch's model spec hash, its deterministic initial model
the round-0 checkpoint. Hosts run in threads (each with its own chain client and gRPC channel); the
aggregator runs its asyncio server on its own loop. Checks: both rounds finalize, every host holds the
chain's checkpoint bit for bit (it applied the aggregated update itself), loss falls, rewards match the
Merkle tree, and a host restarted from its state directory resumes at the round it had reached.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from eth_account import Account
from nacl.signing import SigningKey
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from stdlib_corpus import write_small_corpus

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.server import ChainServer
from chain.types import Deployment
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.store import Store, now_ms
from gonka_node.cli import main
from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import AggregationSettings, RoundSettings
from gonka_node.core.keys import NodeKeys, NodeSigningKey, init_keys
from gonka_node.core.recipe import Recipe
from gonka_node.core.tls import PeerCertificateError, create_identity
from gonka_node.epoch_setup import EpochTerms, aggregator_context, epoch_spec, initial_checkpoint
from gonka_node.host.challenge import Challenges
from gonka_node.host.events import HostEvents, MetricsEvents, MultiEvents
from gonka_node.host.node import HostError, HostNode, HostSettings
from gonka_node.host.store import HostStore
from gonka_node.testing.byzantine import Aggregator
from training.checkpoint import canonical_sha256
from training.hf_export import MODEL_CONFIG_KEY
from training.inner import evaluate
from training.model import ModelConfig, build_model
from training.residual_commit import ChunkLayout, residual_root, zero_root

GNK = 10**9
AGG = 9
TLS = create_identity()  # the test aggregator's; every client pins TLS.cert_pem


@dataclass
class World:
    backend: EmbeddedBackend
    accounts: list
    deployment: Deployment
    recipe: Recipe
    epoch: int
    init_path: Path

    def client(self, i: int) -> ChainClient:
        return ChainClient(self.backend, self.accounts[i], self.deployment).connect()


def build_world(tmp_path: Path, replay_probability: float = 1.0, **recipe: Any) -> World:
    """A funded epoch (p = 1: every host replayed) of a tiny recipe, `recipe` overriding its fields, with
    hosts 1 and 2 signed in ahead and the sign-in window closed. `replay_probability` 0: no replay and no
    pay (the chain's stake rule)."""
    backend = EmbeddedBackend()
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[0]).connect()
    deployment = gov.deploy_all(initial_mint={a.address: 1_000 * GNK for a in accounts})
    gov = ChainClient(backend, accounts[0], deployment).connect()
    fields: dict[str, Any] = dict(
        model=ModelConfig.preset("tiny"), corpus=str(write_small_corpus(tmp_path)), seq_len=32, micro_batch=4,
        inner_steps=15, inner_lr=3e-3, warmup_steps=3, n_rounds=2, codec="int8",
        round_state="fresh",  # the epoch replays hosts (p = 1): its rounds must be replayable
    )
    recipe_ = Recipe(**{**fields, **recipe}).with_data_manifest()
    init_path = tmp_path / "init.safetensors"
    init_sha = initial_checkpoint(recipe_, init_path)
    terms = EpochTerms(aggregators=[accounts[AGG].address], round_length_s=120, signin_window_s=30,
                       min_stake=100 * GNK, max_hosts=4, reward_per_round=100 * GNK if replay_probability else 0,
                       replay_probability=replay_probability)
    epoch = gov.create_epoch(epoch_spec(recipe_, init_sha, terms, "file:recipe.json"))
    if terms.reward_per_round:
        gov.fund_epoch(epoch, recipe_.n_rounds * terms.reward_per_round)
    world = World(backend, accounts, deployment, recipe_, epoch, init_path)
    # Sign in ahead (the nodes find themselves signed in) and close the sign-in window: rounds can
    # only be finalized after it, and the embedded chain's clock can be moved instead of waited for.
    for i in (1, 2):
        world.client(i).join(epoch, 100 * GNK, host_keys(i, world).node_public_key)
    backend.increase_time(31)
    return world


@pytest.fixture
def world(tmp_path: Path) -> World:
    return build_world(tmp_path)


class AggregatorThread:
    """A real RoundEngine on its own store, served by the Byzantine runner's `Aggregator` (TLS: `TLS`)."""

    last_store: Store  # the store of the latest one entered (the fixtures' tests read what it kept)

    def __init__(
        self, world: World, root: Path, aggregation: AggregationSettings | None = None,
        rounds: RoundSettings | None = None, clock: Callable[[], int] = now_ms,
    ) -> None:
        self.world, self.root, self.aggregation = world, root, aggregation or AggregationSettings()
        self.rounds, self.clock = rounds or RoundSettings(quorum=2), clock

    def __enter__(self) -> str:
        w = self.world
        chain = w.client(AGG)
        ctx = aggregator_context(
            w.recipe, chain.get_epoch(w.epoch), chain_id=w.deployment.chain_id,
            registry=w.deployment.registry, init_path=w.init_path,
        )
        self.store = AggregatorThread.last_store = Store(self.root).open()
        engine = RoundEngine(
            ctx, self.rounds, self.aggregation, self.store,
            ChainView(chain), TrainingCheckpoints(), SigningKey(b"\x09" * 32), self.clock,
        )
        self.served = Aggregator(engine, TLS)
        return self.served.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.served.__exit__(*exc)
        self.store.close()


def host_keys(i: int, world: World) -> NodeKeys:
    return NodeKeys(NodeSigningKey(bytes([i]) * 32), Account.from_key(world.accounts[i].key))


def make_node(
    world: World, i: int, target: str, state: Path, stop_after: int | None = None, events: HostEvents | None = None,
    cls: type[HostNode] = HostNode,
) -> HostNode:
    settings = HostSettings(epoch=world.epoch, stake=5 * GNK, state_dir=state, poll_s=0.05,
                            stop_after_rounds=stop_after)
    return cls(
        settings, world.recipe, world.client(i), AggregatorClient(target, TLS.cert_pem, 60.0), host_keys(i, world), events
    )


@pytest.fixture
def two_hosts_finished(world: World, tmp_path: Path) -> Iterator[tuple[World, list, list[HostNode], Store]]:
    with AggregatorThread(world, tmp_path / "agg") as target:
        nodes = [make_node(world, i, target, tmp_path / f"host{i}") for i in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            results = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        yield world, results, nodes, AggregatorThread.last_store


def test_two_hosts_train_an_epoch_and_hold_the_chains_model(two_hosts_finished, tmp_path: Path) -> None:
    world, progresses, _, _ = two_hosts_finished

    chain = world.client(0)
    assert chain.latest_round(world.epoch) == 2
    final = chain.round_result(world.epoch, 2).checkpoint_sha256
    for i, progress in zip((1, 2), progresses, strict=True):
        assert progress.round_done == 2
        assert progress.model_sha256 == final.hex()  # applied the updates itself, bit for bit
        assert progress.outer_steps == 2  # never had to fall back to a checkpoint download
        assert set(progress.submitted) == {"1", "2"}
        snap = HostStore(tmp_path / f"host{i}").load()
        assert snap is not None and canonical_sha256(snap.global_params) == final.hex()
    # Rewards recorded by each host add up to what the chain says was paid per round.
    for r in (1, 2):
        total = chain.round_result(world.epoch, r).total_reward
        assert total > 0
        assert sum(p.rewards[str(r)] for p in progresses) == total
    # The model trained: held-out loss of the final checkpoint is below the initial model's.
    windows = world.recipe.windows()
    held = windows.sample_heldout(0, 32)
    init = build_model(world.recipe.model, world.recipe.init_seed)
    trained = build_model(world.recipe.model, world.recipe.init_seed)
    trained.load_state_dict(HostStore(tmp_path / "host1").load().global_params)
    assert evaluate(trained, windows.batches(held, 8)) < evaluate(init, windows.batches(held, 8)) - 0.05


def test_each_host_signs_the_root_of_its_residual_and_keeps_the_last_two(two_hosts_finished, tmp_path: Path) -> None:
    """The root a host signed with each round's payload (stored by the aggregator) is residual_root of
    its error feedback after that round: round 2's of e_2, round 1's of e_1, which the host still holds
    as `previous`, in memory and in the state it saved (int8 keeps a residual: no zero root)."""
    world, _, nodes, store = two_hosts_finished
    layout = ChunkLayout.of({n: tuple(p.shape) for n, p in build_model(world.recipe.model, 0).named_parameters()})
    roots = []
    for i, node in zip((1, 2), nodes, strict=True):
        signed = {r: store.submission(world.epoch, r, node.host_bytes) for r in (1, 2)}
        assert all(row is not None for row in signed.values())
        feedback = node._local_worker().feedback
        assert signed[2].residual_root == residual_root(feedback.residual, layout)
        assert signed[1].residual_root == residual_root(feedback.previous, layout)
        saved = HostStore(tmp_path / f"host{i}").load()
        assert saved is not None and saved.worker_state is not None
        kept = saved.worker_state["feedback"]
        assert residual_root(kept["residual"], layout) == signed[2].residual_root
        assert residual_root(kept["previous"], layout) == signed[1].residual_root
        roots += [signed[1].residual_root, signed[2].residual_root]
    assert len(set(roots)) == 4 and zero_root(layout) not in roots


class Killed(Exception):
    """The daemon's death (what a SIGKILL would be), raised where the test kills it."""


class KilledAfterVerdict(Challenges):
    def await_verdict(self, *args: Any) -> None:  # what follows an accepted upload
        raise Killed()


class KilledAfterUpload(HostNode):
    """Dies once its upload of a round was accepted, before the round's result: nothing recorded since."""

    challenges_type = KilledAfterVerdict


class Trained(HostEvents):
    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.notes: list[str] = []

    def round_trained(self, round_: int, loss: float, tokens: int, seconds: float, payload_bytes: int) -> None:
        self.rounds.append(round_)

    def note(self, message: str) -> None:
        self.notes.append(message)


def test_a_host_killed_after_its_upload_resumes_from_what_it_kept_without_training_again(
    world: World, tmp_path: Path
) -> None:
    """Killed after round 1's upload was accepted and before anything was recorded (no snapshot at all),
    restarted once round 1 closed: it adopts the payload, root and worker state it kept before the
    upload (the aggregator holds that payload), so it does not train round 1 again (on a GPU the residual
    would differ from the one whose root it signed), and still counts round 1's reward and bytes."""
    with AggregatorThread(world, tmp_path / "agg") as target:
        killed = make_node(world, 1, target, tmp_path / "host1", cls=KilledAfterUpload)
        other = make_node(world, 2, target, tmp_path / "host2")
        with ThreadPoolExecutor(2) as pool:
            other_done = pool.submit(other.run)
            with pytest.raises(Killed):
                killed.run()
            kept_store = HostStore(tmp_path / "host1")
            assert kept_store.load() is None  # nothing recorded: only the kept round
            kept = kept_store.load_sent(1)
            assert kept is not None and kept.residual_root == killed.residual_roots[1]
            kept_state = kept_store.load_sent_state(1)
            kept_residual = kept_state["feedback"]["residual"]
            assert kept_state["inner"] == {"step": 15}  # a fresh epoch: no AdamW moments, only the clock
            chain = world.client(0)
            while chain.latest_round(world.epoch) < 1:
                time.sleep(0.05)
            events = Trained()
            again = make_node(world, 1, target, tmp_path / "host1", events=events)
            progress = pool.submit(again.run).result(timeout=300)
            other_done.result(timeout=300)
        signed = {r: AggregatorThread.last_store.submission(world.epoch, r, again.host_bytes) for r in (1, 2)}
    assert events.rounds == [2]  # round 1 was not trained again
    assert any(n.startswith("round 1: the aggregator holds the payload this host kept") for n in events.notes)
    layout = ChunkLayout.of({n: tuple(t.shape) for n, t in build_model(world.recipe.model, 0).named_parameters()})
    assert residual_root(kept_residual, layout) == kept.residual_root == signed[1].residual_root  # saved = signed
    # Round 2 compressed from the residual restored from the kept state: e_1, whose root round 1 signed
    # (a fresh worker's would be zero), as recorded for round 2's opening.
    feedback = again._local_worker().feedback
    assert residual_root(feedback.previous, layout) == signed[1].residual_root != zero_root(layout)
    assert residual_root(feedback.residual, layout) == signed[2].residual_root
    assert progress.residual_roots == {str(r): signed[r].residual_root.hex() for r in (1, 2)}
    assert set(progress.submitted) == {"1", "2"}
    assert progress.bytes_sent == signed[1].payload_length + signed[2].payload_length
    assert progress.rewards["1"] > 0
    assert progress.model_sha256 == world.client(0).round_result(world.epoch, 2).checkpoint_sha256.hex()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def test_metrics_port_and_checkpoint_metadata_after_a_round(world: World, tmp_path: Path) -> None:
    metrics = MetricsEvents()
    port = metrics.serve(0)  # what `metrics_port` in host.toml turns on
    with AggregatorThread(world, tmp_path / "agg") as target:
        nodes = [make_node(world, 1, target, tmp_path / "host1", 1, MultiEvents([HostEvents(), metrics])),
                 make_node(world, 2, target, tmp_path / "host2", 1)]
        with ThreadPoolExecutor(2) as pool:
            progress, _ = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        with AggregatorClient(target, TLS.cert_pem) as agg:
            pulled = tmp_path / "round1.safetensors"
            pulled.write_bytes(agg.checkpoint(world.epoch, 1).data)

    got = scrape(port)
    assert got["gonka_host_rounds_total"] == 1
    assert got["gonka_host_round"] == 1
    assert got["gonka_host_submissions_total{result=accepted}"] == 1
    assert progress.rewards["1"] > 0 and got["gonka_host_rewards_ngonka_total"] == progress.rewards["1"]
    assert progress.bytes_sent > 0 and got["gonka_host_payload_bytes_total"] == progress.bytes_sent
    assert progress.bytes_received > 0 and got["gonka_host_download_bytes_total"] == progress.bytes_received
    assert 0 < got["gonka_host_inner_loss"] < 6  # nats per byte; ln 256 = 5.55 at random init
    assert got["gonka_host_tokens_per_second"] > 0 and got["gonka_host_round_latency_seconds"] >= 0

    # The aggregator's checkpoints name their model: export works without --recipe or --preset.
    with safe_open(str(pulled), "pt") as f:
        recorded = f.metadata()[MODEL_CONFIG_KEY]
    assert ModelConfig.from_dict(json.loads(recorded)) == world.recipe.model
    with safe_open(str(world.init_path), "pt") as f:
        assert f.metadata()[MODEL_CONFIG_KEY] == recorded
    assert main(["checkpoint", "export", "--checkpoint", str(pulled), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == world.recipe.model.dim


def test_a_rig_that_cannot_split_the_recipes_batch_is_refused(world: World, tmp_path: Path) -> None:
    # The epoch's recipe takes one micro-batch per step: two processes cannot share it equally.
    settings = HostSettings(epoch=world.epoch, stake=5 * GNK, state_dir=tmp_path / "host1", procs=2)
    node = HostNode(settings, world.recipe, world.client(1), AggregatorClient("127.0.0.1:1", TLS.cert_pem),
                    host_keys(1, world))
    with pytest.raises(HostError, match=r"--gpus 2: the epoch's recipe accumulates 1 micro-batches per step"):
        node.run()
    assert not (tmp_path / "host1").exists()  # refused before anything was written


def test_a_host_pinning_another_certificate_stops_and_says_so(world: World, tmp_path: Path) -> None:
    other = create_identity()
    with AggregatorThread(world, tmp_path / "agg") as target:
        settings = HostSettings(epoch=world.epoch, stake=5 * GNK, state_dir=tmp_path / "host1", poll_s=0.05)
        node = HostNode(settings, world.recipe, world.client(1), AggregatorClient(target, other.cert_pem, 60.0),
                        host_keys(1, world))
        with pytest.raises(PeerCertificateError, match=f"presents TLS certificate sha256 {TLS.sha256.hex()}, "
                           f"not the pinned {other.sha256.hex()}"):
            node.run()  # not retried like an outage: the daemon would wait forever


@pytest.fixture
def rpc_url(world: World) -> Iterator[str]:
    """The world's chain served over JSON-RPC, as `gonka-node run` reaches it."""
    server = ChainServer(world.backend).start()
    yield server.url
    server.stop()


def host_cli_files(world: World, tmp_path: Path, target: str, tls_cert: str, rpc_url: str) -> Path:
    """What `gonka-node run` reads: keys of host 1 (signed in: preflight finds nothing else to refuse),
    recipe, deployment, host.toml."""
    init_keys(tmp_path / "keys", None, insecure_plaintext=True, node_seed=bytes([1]) * 32,
              evm_private_key=bytes(world.accounts[1].key))
    world.recipe.save(tmp_path / "recipe.json")
    world.deployment.save(tmp_path / "deployment.json")
    (tmp_path / "host.toml").write_text(
        f'[host]\nkey_dir = "keys"\nstate_dir = "state"\naggregator = "{target}"\nrecipe = "recipe.json"\n'
        f'deployment = "deployment.json"\nepoch = {world.epoch}\nstake_gnk = 5\n\n'
        f'[aggregator]\ntls_cert = "{tls_cert}"\n\n[chain]\nrpc_url = "{rpc_url}"\n'
    )
    return tmp_path / "host.toml"


def test_the_host_cli_checks_its_pin_before_anything_else(
    world: World, rpc_url: str, tmp_path: Path, capsys
) -> None:
    (tmp_path / "other.pem").write_bytes(create_identity().cert_pem)
    with AggregatorThread(world, tmp_path / "agg") as target:
        config = host_cli_files(world, tmp_path, target, "other.pem", rpc_url)
        assert main(["run", "--config", str(config), "--quiet"]) == 2
        wrong = capsys.readouterr().err
        (tmp_path / "host.toml").write_text(config.read_text().replace('tls_cert = "other.pem"\n', ""))
        assert main(["run", "--config", str(config), "--quiet"]) == 2
        missing = capsys.readouterr().err
        assert not (tmp_path / "state").exists()  # stopped before the node was built
        # The aggregator's account announces its endpoint and certificate: the host needs no file.
        world.client(AGG).announce_aggregator(world.epoch, target, TLS.cert_pem)
        assert main(["rewards", "--config", str(config)]) == 0
        found = capsys.readouterr()
    # One line for the problem, one saying nothing was staked (the preflight runs before any transaction).
    assert wrong.count("\n") == 2 and f"presents TLS certificate sha256 {TLS.sha256.hex()}" in wrong
    assert wrong.endswith("gonka-node run: error: preflight: 1 problem(s); nothing was staked\n")
    assert missing.startswith(f"gonka-node run: error: no aggregator of epoch {world.epoch} has announced")
    assert "give the aggregator's certificate file" in missing and missing.count("\n") == 2
    assert found.err == ""
