"""`gonka-node checkpoint list|pull|export|generate` against a real chain served over JSON-RPC on
127.0.0.1 (embedded py-evm) and a real gRPC Checkpoints server on 127.0.0.1:0 serving files over TLS
(a second port serves the same plaintext, as a pre-TLS aggregator would).

The chain holds epoch 1 with an initial checkpoint (round 0) and two finalized rounds. The gRPC
server can be told to misbehave (serve another file, lie about it, cut the stream) to check that
`pull` keeps nothing it could not verify against the chain.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from checkpoint_kit import GNK, file_chunks, finalize, open_epoch, served_chain

from chain.backends import RpcBackend
from gonka_node.cli import main
from gonka_node.core.recipe import Recipe
from gonka_node.core.tls import create_identity, server_credentials
from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc
from training.checkpoint import save_checkpoint
from training.generate import SamplingConfig, generate_text
from training.hf_export import MODEL_CONFIG_KEY
from training.model import ModelConfig, build_model

TINY = ModelConfig.preset("tiny")


@dataclass
class FileServer(cpb_grpc.CheckpointsServicer):
    """Serves checkpoint files by (epoch, round); `mode` makes it misbehave."""

    files: dict[tuple[int, int], tuple[Path, bytes]] = field(default_factory=dict)  # -> (path, content sha)
    mode: str = "honest"

    def StreamCheckpoint(self, request, context):
        key = (request.epoch, request.round)
        if key not in self.files or self.mode == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint for {key}")
        path, content_sha = self.files[key]
        if self.mode in ("swap-lying", "swap-honest"):  # another real checkpoint instead of this one
            other = next(k for k in self.files if k != key)
            path = self.files[other][0]
            if self.mode == "swap-honest":
                content_sha = self.files[other][1]
        if self.mode == "rewrite-config":  # the same tensors, another model config in the metadata
            path = path.with_name(f"rewritten-{path.name}")
        data = path.read_bytes()
        sent = data
        if self.mode == "truncate":
            sent = data[: len(data) // 2]
        if self.mode == "corrupt":
            sent = data[:-10] + bytes(10)
        yield from file_chunks(request, data, content_sha, sent)


@dataclass
class World:
    deployment: Path
    aggregator: str
    server: FileServer
    files: dict[int, Path]  # round -> checkpoint file
    shas: dict[int, str]
    recipe: Path
    cert: Path  # the server's certificate, what a client pins
    cert_sha256: str
    plaintext: str  # the same service without TLS

    def chain_args(self) -> list[str]:
        return ["--deployment", str(self.deployment)]

    def pull_args(self) -> list[str]:
        return [*self.chain_args(), "--aggregator", self.aggregator, "--tls-cert", str(self.cert)]


def _checkpoint(path: Path, seed: int, with_config: bool) -> str:
    metadata = {MODEL_CONFIG_KEY: json.dumps(TINY.to_dict())} if with_config else {}
    tensors = build_model(TINY, seed).state_dict()
    # What a lying server could serve instead: the very tensors, a rewritten config (same hash).
    lie = dataclasses.replace(TINY, rope_theta=500.0, norm_eps=1e-2)
    save_checkpoint(path.with_name(f"rewritten-{path.name}"), tensors, {MODEL_CONFIG_KEY: json.dumps(lie.to_dict())})
    return save_checkpoint(path, tensors, metadata)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("checkpoint-cli")
    files = {r: tmp / f"served-{r}.safetensors" for r in range(3)}
    shas = {r: _checkpoint(files[r], seed=r, with_config=r != 1) for r in range(3)}  # round 1: no config
    recipe = Recipe(model=TINY)
    recipe.save(tmp / "recipe.json")

    chain = served_chain(tmp)
    epoch = open_epoch(chain, recipe, shas[0], n_rounds=3)
    aggregator = chain.gov.with_account(chain.accounts[1])
    for r, sha, root, n, total in ((1, shas[1], 7, 3, 1000 * GNK), (2, shas[2], 8, 2, 1500 * GNK)):
        finalize(aggregator, epoch, r, sha, bytes([root]) * 32, n, total)

    servicer = FileServer({(epoch, r): (files[r], bytes.fromhex(shas[r])) for r in range(3)})
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    cpb_grpc.add_CheckpointsServicer_to_server(servicer, grpc_server)
    identity = create_identity()
    (tmp / "cert.pem").write_bytes(identity.cert_pem)
    port = grpc_server.add_secure_port("127.0.0.1:0", server_credentials(identity))
    plain_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    # What a running aggregator does at start: its endpoint and certificate, and the epoch's recipe.
    aggregator.announce_aggregator(epoch, f"127.0.0.1:{port}", identity.cert_pem)
    aggregator.publish_recipe(epoch, recipe.canonical_json())
    yield World(tmp / "deployment.json", f"127.0.0.1:{port}", servicer, files, shas, tmp / "recipe.json",
                tmp / "cert.pem", identity.sha256.hex(), f"127.0.0.1:{plain_port}")
    grpc_server.stop(0)
    chain.server.stop()


@pytest.fixture
def server(world: World) -> Iterator[FileServer]:
    yield world.server
    world.server.mode = "honest"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["checkpoint", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------------------------- list


def test_list_shows_each_round_from_the_chain(world: World, capsys):
    code, out, _ = run(capsys, "list", *world.chain_args())
    assert code == 0
    lines = {r: next(line for line in out.splitlines() if world.shas[r] in line) for r in range(3)}
    assert "0 (initial)" in lines[0]
    assert [cell.strip() for cell in lines[1].split("│")[1:6]] == ["1", "1", world.shas[1], "3", "1000 GNK"]
    assert "1500 GNK" in lines[2] and " 2 " in lines[2]


def test_list_unknown_epoch(world: World, capsys):
    code, out, err = run(capsys, "list", *world.chain_args(), "--epoch", "9")
    assert code == 2 and out == ""
    assert "--epoch 9: no such epoch" in err and "epochs 1..1" in err


def test_list_and_pull_need_no_account_on_a_public_node(world: World, server, tmp_path, capsys, monkeypatch):
    # A public node (a testnet, mainnet) has no funded dev accounts: reading must not ask for one.
    # The served chain here is a devnet, so its dev accounts are made unavailable for this test.
    def no_dev_accounts(self: RpcBackend) -> list:
        raise AssertionError("a read-only verb asked the node for dev accounts")

    monkeypatch.setattr(RpcBackend, "dev_accounts", no_dev_accounts)
    code, out, _ = run(capsys, "list", *world.chain_args())
    assert code == 0 and world.shas[2] in out
    out_file = tmp_path / "got.safetensors"
    code, _, err = run(capsys, "pull", *world.pull_args(), "--epoch", "1",
                       "--round", "latest", "--out", str(out_file))
    assert (code, err) == (0, "")
    assert out_file.read_bytes() == world.files[2].read_bytes()


# ---------------------------------------------------------------------------------------------- pull


@pytest.mark.parametrize(("round_arg", "expect"), [("latest", 2), ("1", 1), ("0", 0)])
def test_pull_verifies_against_the_chain(world: World, server, tmp_path, capsys, round_arg, expect):
    out_file = tmp_path / "got.safetensors"
    code, out, err = run(
        capsys, "pull", *world.pull_args(), "--epoch", "1",
        "--round", round_arg, "--out", str(out_file),
    )
    assert (code, err) == (0, "")
    assert out_file.read_bytes() == world.files[expect].read_bytes()
    assert f"round {expect}" in out and world.shas[expect] in out
    assert [p.name for p in tmp_path.iterdir()] == ["got.safetensors"]  # no temporary file left


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("swap-honest", "serves a different checkpoint"),  # refused from the FileMeta, before any byte
        ("swap-lying", "fails verification against the chain"),  # caught by the canonical hash
        ("truncate", "(truncated)"),
        ("corrupt", "corrupted in transfer"),
        ("missing", "StreamCheckpoint epoch 1 round 2 failed: NOT_FOUND"),
    ],
)
def test_pull_keeps_nothing_unverified(world: World, server, tmp_path, capsys, mode, message):
    server.mode = mode
    out_file = tmp_path / "got.safetensors"
    out_file.write_bytes(b"the previous file")
    code, out, err = run(
        capsys, "pull", *world.pull_args(), "--epoch", "1",
        "--round", "2", "--out", str(out_file), "--force",
    )
    assert code == 2 and out == ""
    assert message in err and "epoch 1 round 2" in err
    assert out_file.read_bytes() == b"the previous file"
    assert [p.name for p in tmp_path.iterdir()] == ["got.safetensors"]


def test_pull_refusals(world: World, tmp_path, capsys):
    pull = ["pull", *world.pull_args(), "--epoch", "1"]
    code, _, err = run(capsys, *pull, "--round", "3", "--out", str(tmp_path / "x"))
    assert code == 2 and "no finalized round 3 yet (latest finalized: 2)" in err
    code, _, err = run(capsys, *pull, "--round", "two", "--out", str(tmp_path / "x"))
    assert code == 2 and "--round 'two'" in err
    (tmp_path / "exists").write_bytes(b"mine")
    code, _, err = run(capsys, *pull, "--round", "1", "--out", str(tmp_path / "exists"))
    assert code == 2 and "pass --force" in err
    code, _, err = run(capsys, *pull, "--round", "1", "--out", str(tmp_path / "x"), "--max-bytes", "1000")
    assert code == 2 and "exceeds --max-bytes 1,000" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_pull_fragment_refusals_on_an_unsharded_epoch(world: World, tmp_path, capsys):
    """`--fragment K` needs a sharded epoch's round: here epoch 1's recipe has one shard."""
    pull = ["pull", *world.chain_args(), "--epoch", "1", "--out", str(tmp_path / "x")]
    code, _, err = run(capsys, *pull, "--round", "1", "--fragment", "0")
    assert code == 2 and "--fragment: epoch 1 is not sharded (one aggregator holds the whole model)" in err
    code, _, err = run(capsys, *pull, "--round", "1", "--fragment", "0", "--aggregator", world.aggregator)
    assert code == 2 and "--fragment K is pulled from shard K as announced on chain: leave out --aggregator" in err
    assert list(tmp_path.iterdir()) == []


def test_pull_trusts_only_the_pinned_certificate_over_tls(world: World, tmp_path, capsys):
    other = create_identity()
    (tmp_path / "other.pem").write_bytes(other.cert_pem)
    (tmp_path / "junk.pem").write_text("not a certificate")
    base = ["pull", *world.chain_args(), "--epoch", "1", "--round", "1", "--out", str(tmp_path / "x")]
    code, _, err = run(capsys, *base, "--aggregator", world.aggregator, "--tls-cert", str(tmp_path / "other.pem"))
    assert code == 2 and err.count("\n") == 1  # one line, no traceback
    assert f"presents TLS certificate sha256 {world.cert_sha256}, not the pinned {other.sha256.hex()}" in err
    code, _, err = run(capsys, *base, "--aggregator", world.plaintext, "--tls-cert", str(world.cert))
    assert code == 2 and f"--aggregator: {world.plaintext} did not complete a TLS handshake" in err
    code, _, err = run(capsys, *base, "--aggregator", world.aggregator, "--tls-cert", str(tmp_path / "junk.pem"))
    assert code == 2 and f"--tls-cert {tmp_path / 'junk.pem'}: not a PEM certificate" in err
    code, _, err = run(capsys, *base, "--aggregator", "127.0.0.1:1", "--tls-cert", str(world.cert))
    assert code == 2 and "--aggregator 127.0.0.1:1: cannot connect" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pem", "other.pem"]  # nothing pulled


def test_pull_finds_the_aggregator_and_its_certificate_on_chain(world: World, server, tmp_path, capsys):
    """No --aggregator, no --tls-cert: the endpoint and the pinned certificate are what the aggregator's
    account announced on chain."""
    out_file = tmp_path / "got.safetensors"
    code, out, err = run(capsys, "pull", *world.chain_args(), "--epoch", "1", "--round", "2", "--out", str(out_file))
    assert (code, err) == (0, "")
    assert f"from {world.aggregator} (certificate from the chain (announced by 0x" in out
    assert out_file.read_bytes() == world.files[2].read_bytes()
    code, _, err = run(capsys, "pull", *world.chain_args(), "--aggregator", "127.0.0.1:9", "--epoch", "1",
                       "--round", "2", "--out", str(out_file), "--force")
    assert code == 2 and err.count("\n") == 1
    assert f"127.0.0.1:9 is not an endpoint epoch 1's aggregators announced on chain (they announced: {world.aggregator}" in err


def test_pull_refuses_a_model_config_the_hash_does_not_cover(world: World, server, tmp_path, capsys):
    """The tensors are the chain's, the metadata says another model (RoPE theta, norm eps): the chain's
    hash does not cover metadata, the epoch's recipe on chain does, and they disagree: nothing kept."""
    server.mode = "rewrite-config"
    out_file = tmp_path / "got.safetensors"
    code, out, err = run(capsys, "pull", *world.pull_args(), "--epoch", "1", "--round", "2", "--out", str(out_file))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the file's tensors match the chain but its metadata 'model_config'" in err
    assert "rope_theta=500.0" in err and "is not epoch 1's recipe on chain's model" in err
    assert list(tmp_path.iterdir()) == []


def test_pulled_metadata_nothing_vouches_for_is_stripped(world: World, tmp_path):
    """Without a recipe on chain or --recipe, a file's model config is an unverified claim: the pull
    removes it (the tensors, and so the hash, are untouched)."""
    from gonka_node.cli.checkpoint_chain import ChainCheckpoint
    from gonka_node.cli.checkpoint_pull import _settle_metadata
    from training.checkpoint import load_checkpoint

    path = tmp_path / "x.safetensors"
    path.write_bytes((world.files[2].parent / f"rewritten-{world.files[2].name}").read_bytes())
    want = ChainCheckpoint(1, 2, bytes.fromhex(world.shas[2]), 1, "0x")
    note = _settle_metadata(path, want, None, "")
    assert "'model_config' was removed: no recipe on chain or --recipe vouches for it" in note
    loaded = load_checkpoint(path, expected_sha256=world.shas[2])
    assert MODEL_CONFIG_KEY not in loaded.metadata


# ---------------------------------------------------------------------------------------------- export


def test_export_checked_against_the_chain(world: World, tmp_path, capsys):
    out_dir = tmp_path / "hf"
    code, out, err = run(
        capsys, "export", *world.chain_args(), "--checkpoint", str(world.files[2]), "--epoch", "1",
        "--round", "latest", "--format", "hf", "--out", str(out_dir),
    )
    assert (code, err) == (0, "")
    assert world.shas[2] in out
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"], config["max_position_embeddings"]) == (
        TINY.dim, TINY.n_kv_heads, TINY.max_seq_len
    )
    card = (out_dir / "README.md").read_text()
    assert world.shas[2] in card and "- round: `2`" in card and "- epoch: `1`" in card


def test_export_refuses_a_file_the_chain_does_not_record(world: World, tmp_path, capsys):
    code, _, err = run(
        capsys, "export", *world.chain_args(), "--checkpoint", str(world.files[2]), "--epoch", "1",
        "--round", "1", "--out", str(tmp_path / "hf"),
    )
    assert code == 2
    assert f"expected {world.shas[1]}" in err and "--checkpoint" in err
    assert list(tmp_path.iterdir()) == []


def test_export_model_config_sources(world: World, tmp_path, capsys):
    no_config = ["export", "--checkpoint", str(world.files[1])]
    code, _, err = run(capsys, *no_config, "--out", str(tmp_path / "a"))
    assert code == 2 and "records no model config" in err and "--preset" in err
    code, _, err = run(capsys, *no_config, "--out", str(tmp_path / "a"), "--preset", "devnet")
    assert code == 2 and "do not fit the model config: missing" in err and "model.layers.2." in err
    assert list(tmp_path.iterdir()) == []
    assert run(capsys, *no_config, "--out", str(tmp_path / "b"), "--preset", "tiny")[0] == 0
    # A recipe is checked against the epoch's model spec hash when the chain is consulted.
    code, _, err = run(
        capsys, *no_config, "--out", str(tmp_path / "c"), "--recipe", str(world.recipe), *world.chain_args(),
        "--epoch", "1", "--round", "1",
    )
    assert (code, err) == (0, "")
    other = tmp_path / "other-recipe.json"
    Recipe(model=TINY, init_seed=5).save(other)
    code, _, err = run(
        capsys, *no_config, "--out", str(tmp_path / "d"), "--recipe", str(other), *world.chain_args(),
        "--epoch", "1", "--round", "1",
    )
    assert code == 2 and f"--recipe {other}" in err and "model_spec_hash" in err
    # The checkpoint's own config and a different preset disagree.
    code, _, err = run(
        capsys, "export", "--checkpoint", str(world.files[2]), "--out", str(tmp_path / "e"), "--preset", "devnet"
    )
    assert code == 2 and "describes a different model" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c", "other-recipe.json"]


def test_export_damaged_file(tmp_path, capsys):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    code, _, err = run(capsys, "export", "--checkpoint", str(path), "--out", str(tmp_path / "hf"))
    assert code == 2 and str(path) in err
    code, _, err = run(capsys, "export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "hf"))
    assert code == 2 and "no checkpoint file" in err


# ---------------------------------------------------------------------------------------------- generate


def test_generate_greedy_and_seeded(world: World, capsys, one_thread):
    base = ["generate", "--checkpoint", str(world.files[2]), "--prompt", "def ", "--max-new-tokens", "24"]
    code, out, err = run(capsys, *base, "--greedy")
    assert (code, err) == (0, "")
    model = build_model(TINY, seed=2)  # the model the file was written from
    expected = generate_text(model, "def ", SamplingConfig(max_new_tokens=24, temperature=0.0))
    # Control bytes (an untrained model emits any byte) are shown as U+FFFD, never sent to the terminal.
    shown = "".join("\ufffd" if (ord(c) < 32 and c not in "\n\t") or 127 <= ord(c) < 160 else c for c in expected)
    assert out == "def " + shown + "\n"
    runs = [run(capsys, *base, "--temperature", "1.0", "--seed", seed)[1] for seed in ("1", "1", "2")]
    assert runs[0] == runs[1] != runs[2]
    assert all(r.startswith("def ") for r in runs)


def test_generate_bad_settings(world: World, capsys):
    base = ["generate", "--checkpoint", str(world.files[2])]
    code, _, err = run(capsys, *base, "--temperature", "-1")
    assert code == 2 and "temperature" in err
    code, _, err = run(capsys, *base, "--epoch", "1")
    assert code == 2 and "--epoch and --round go together" in err
