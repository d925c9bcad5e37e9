"""Governance from the command line alone, against a chain served over JSON-RPC on 127.0.0.1 with the
Governor holding governance: plan a spec from a recipe (hashes filled in), validate it, fill the treasury,
create and fund an epoch in one proposal, list proposals, vote, execute; and the refusals that name the
fix before a transaction is spent (voting still open, a treasury that cannot pay, a fund action aimed at
an epoch number another proposal took)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from stdlib_corpus import write_small_corpus

from chain.backends import EmbeddedBackend, RpcBackend
from chain.client import ChainClient
from chain.server import ChainServer
from chain.spec_file import load_epoch_spec
from chain.types import Deployment
from gonka_node.cli import main
from gonka_node.core.recipe import Recipe
from gonka_node.spec_builder import initial_sha256

GNK = 10**9
VOTING_S = 600


@dataclass
class Chain:
    url: str
    deployment: Path
    backend: RpcBackend

    def args(self, account: int = 0) -> list[str]:
        return ["--deployment", str(self.deployment), "--dev-account", str(account)]

    def client(self, account: int = 0) -> ChainClient:
        return ChainClient(self.backend, self.backend.dev_accounts()[account], Deployment.load(self.deployment)).connect()


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[Chain]:
    server = ChainServer(EmbeddedBackend()).start()
    deployment = tmp_path / "deployment.json"
    assert main(["chain", "deploy", "--rpc-url", server.url, "--governor", "--voting-period", str(VOTING_S),
                 "--quorum-bps", "1000", "--mint-dev", "100000", "--deployment", str(deployment)]) == 0
    yield Chain(server.url, deployment, RpcBackend(server.url))
    server.stop()


@pytest.fixture
def recipe_toml(tmp_path: Path) -> Path:
    """`init epoch`'s template for the tiny preset, on a small corpus (the built-in one takes seconds)."""
    out = tmp_path / "recipe.toml"
    assert main(["init", "epoch", "--out", str(out), "--preset", "tiny", "--rounds", "2", "--inner-steps", "3"]) == 0
    corpus = write_small_corpus(tmp_path)
    out.write_text(out.read_text().replace('corpus = "builtin"', f'corpus = "{corpus}"'))
    return out


def build(chain: Chain, recipe: Path, out: Path, *extra: str) -> None:
    aggregator = chain.backend.dev_accounts()[9].address
    assert main(["gov", "build-spec", "--recipe", str(recipe), "--aggregator", aggregator, "--reward-per-round",
                 "50", "--replay-probability", "0.5", "--out", str(out), *extra]) == 0


def test_build_spec_fills_every_hash_and_check_spec_recomputes_them(
    chain: Chain, recipe_toml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "epoch.toml"
    build(chain, recipe_toml, spec_file)
    out = capsys.readouterr().out
    recipe = Recipe.load(tmp_path / "recipe.json")  # the completed recipe, written beside the spec
    assert recipe.data_manifest_sha256 and recipe.model == Recipe.load(recipe_toml).model
    spec = load_epoch_spec(spec_file)
    assert spec.model_spec_hash == recipe.sha256()
    assert spec.data_manifest_hash.hex() == recipe.data_manifest_sha256
    assert spec.init_checkpoint_hash == initial_sha256(recipe)
    assert (spec.n_rounds, spec.inner_steps, spec.reward_per_round) == (2, 3, 50 * GNK)
    assert spec.min_stake == 100 * GNK  # the stake rule's least: reward / p
    assert "# sha256 of the recipe's canonical JSON" in spec_file.read_text()
    assert "next: gonka-node gov create-epoch --spec" in out and "--fund 100" in out

    assert main(["gov", "check-spec", "--spec", str(spec_file), "--recipe", str(tmp_path / "recipe.json")]) == 0
    assert "a valid epoch spec and matches" in capsys.readouterr().out
    # Another recipe (one more round): the spec is not its epoch, and the error says which field.
    other = tmp_path / "other.json"
    other.write_text((tmp_path / "recipe.json").read_text().replace('"n_rounds":2', '"n_rounds":3'))
    assert main(["gov", "check-spec", "--spec", str(spec_file), "--recipe", str(other)]) == 2
    err = capsys.readouterr().err
    assert "does not describe this recipe: model_spec_hash: the chain records" in err and "Traceback" not in err
    # A rule-breaking spec is refused when read, with the file and the field.
    spec_file.write_text(spec_file.read_text().replace('min_stake_gnk = "100"', 'min_stake_gnk = "10"'))
    assert main(["gov", "check-spec", "--spec", str(spec_file)]) == 2
    assert f"{spec_file}: field 'min_stake_gnk'" in capsys.readouterr().err
    # No overwrite without --force; a carry recipe cannot be replayed, so p > 0 is refused.
    build_again = ["gov", "build-spec", "--recipe", str(recipe_toml), "--aggregator", "0x" + "11" * 20,
                   "--out", str(spec_file)]
    assert main(build_again) == 2 and "exists; pass --force" in capsys.readouterr().err
    recipe_toml.write_text(recipe_toml.read_text().replace('round_state = "fresh"', 'round_state = "carry"'))
    assert main([*build_again, "--force"]) == 2
    assert "round_state: replay probability 1 needs round_state" in capsys.readouterr().err
    # A streamed recipe (carry, p = 0: never replayed) builds an epoch the network serves.
    recipe_toml.write_text(re.sub(r"(?m)^stream_fragments = 1\b", "stream_fragments = 2", recipe_toml.read_text()))
    assert main([*build_again, "--force", "--replay-probability", "0"]) == 0, capsys.readouterr().err
    streamed = Recipe.load(tmp_path / "recipe.json")
    assert (streamed.stream_fragments, streamed.round_state) == (2, "carry")
    assert load_epoch_spec(spec_file).model_spec_hash == streamed.sha256() != recipe.sha256()


def test_create_and_fund_in_one_proposal_vote_and_execute(
    chain: Chain, recipe_toml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "epoch.toml"
    build(chain, recipe_toml, spec_file)
    assert main(["gov", "create-epoch", "--spec", str(spec_file), "--fund", "100", "--propose", "epoch 1: tiny",
                 *chain.args()]) == 0
    out = capsys.readouterr().out
    assert "proposing: create epoch 1 and fund it with 100 GNK" in out
    assert "note: the Governor's treasury holds 0 GNK; deposit 100 GNK" in out
    assert re.search(r"proposal 1 created; voting ends \d{4}-\d\d-\d\d \d\d:\d\d:\d\d .*\(in 10 min\)", out), out

    for voter in (0, 1):
        assert main(["gov", "deposit", "--amount", "60000", *chain.args(voter)]) == 0
        assert main(["gov", "vote", "--proposal", "1", "--support", "yes", *chain.args(voter)]) == 0
    assert "voting weight now 60000 GNK" in capsys.readouterr().out
    # Before the vote ends: one line naming when it does, nothing sent.
    assert main(["gov", "execute", "--proposal", "1", *chain.args(2)]) == 2
    err = capsys.readouterr().err
    assert "proposal 1: voting is open until" in err and "execute it after that" in err and err.count("\n") == 1

    chain.backend.increase_time(VOTING_S + 1)
    # Passed, but the treasury is empty: the Governor would refuse to spend its voters' escrow.
    assert main(["gov", "execute", "--proposal", "1", *chain.args(2)]) == 2
    err = capsys.readouterr().err
    assert "spends 100 GNK but the Governor's treasury holds 0 GNK: deposit 100 GNK" in err
    assert main(["gov", "treasury-deposit", "--amount", "100", *chain.args(3)]) == 0
    assert "treasury now holds 100 GNK" in capsys.readouterr().out

    assert main(["gov", "proposals", "--deployment", str(chain.deployment)]) == 0
    listing = capsys.readouterr().out
    assert "passed" in listing and "epoch 1: tiny" in listing
    assert "create epoch 1: 2 rounds, 50 GNK per round" in listing
    assert "fund epoch 1 with 100 GNK from the treasury" in listing
    assert main(["gov", "proposals", "--ngonka", "--deployment", str(chain.deployment)]) == 0
    assert "100,000,000,000 ngonka" in capsys.readouterr().out

    assert main(["gov", "execute", "--proposal", "1", *chain.args(2)]) == 0
    assert "proposal 1 executed; epoch(s) 1 created" in capsys.readouterr().out
    info = chain.client().get_epoch(1)
    assert info.pool == 100 * GNK and info.spec == load_epoch_spec(spec_file)
    assert main(["gov", "execute", "--proposal", "1", *chain.args(2)]) == 2
    assert "proposal 1 was already executed" in capsys.readouterr().err


def test_a_fund_action_aimed_at_an_epoch_another_proposal_created_is_refused(
    chain: Chain, recipe_toml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "epoch.toml"
    build(chain, recipe_toml, spec_file)
    dep = chain.args()
    assert main(["gov", "treasury-deposit", "--amount", "500", *dep]) == 0
    assert main(["gov", "create-epoch", "--spec", str(spec_file), "--fund", "100", "--propose", "a", *dep]) == 0
    assert main(["gov", "create-epoch", "--spec", str(spec_file), "--propose", "b", *dep]) == 0
    for voter in (0, 1):
        assert main(["gov", "deposit", "--amount", "60000", *chain.args(voter)]) == 0
        for pid in ("1", "2"):
            assert main(["gov", "vote", "--proposal", pid, "--support", "yes", *chain.args(voter)]) == 0
    chain.backend.increase_time(VOTING_S + 1)
    assert main(["gov", "execute", "--proposal", "2", *dep]) == 0  # takes epoch number 1
    capsys.readouterr()
    assert main(["gov", "execute", "--proposal", "1", *dep]) == 2
    err = capsys.readouterr().err
    assert "proposal 1 funds epoch 1, but executed now it would create epoch(s) 2" in err
    assert chain.client().epoch_count() == 1 and chain.client().get_epoch(1).pool == 0


def test_spec_toml_round_trips(chain: Chain, recipe_toml: Path, tmp_path: Path) -> None:
    from chain.spec_file import format_epoch_spec, parse_epoch_spec

    spec_file = tmp_path / "epoch.toml"
    build(chain, recipe_toml, spec_file, "--challenge-bond", "2.5", "--min-stake", "123.456789")
    spec = load_epoch_spec(spec_file)
    assert (spec.challenge_bond, spec.min_stake) == (2_500_000_000, 123_456_789_000)
    assert parse_epoch_spec(tomllib.loads(format_epoch_spec(spec, header="x\ny"))) == spec


def test_build_spec_seeds_the_assignment_after_sign_in_unless_told(
    chain: Chain, recipe_toml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare.toml"  # a hand-written recipe that names no assignment_seed
    bare.write_text("".join(line for line in recipe_toml.read_text().splitlines(keepends=True)
                            if not line.startswith("assignment_seed")))
    assert Recipe.load(bare).assignment_seed == "epoch"  # the dataclass default: old recipes keep their hash
    for name in "abc":
        (tmp_path / name).mkdir()
    build(chain, bare, tmp_path / "a" / "epoch.toml")
    completed = Recipe.load(tmp_path / "a" / "recipe.json")
    assert completed.assignment_seed == "signin-block"
    assert load_epoch_spec(tmp_path / "a" / "epoch.toml").model_spec_hash == completed.sha256()
    stripped = tmp_path / "a" / "stripped.json"  # check-spec reads a recipe as build-spec does
    stripped.write_text((tmp_path / "a" / "recipe.json").read_text().replace('"assignment_seed":"signin-block",', ""))
    assert "assignment_seed" not in stripped.read_text()
    assert main(["gov", "check-spec", "--spec", str(tmp_path / "a" / "epoch.toml"), "--recipe", str(stripped)]) == 0
    build(chain, bare, tmp_path / "b" / "epoch.toml", "--assignment-seed", "epoch")
    assert Recipe.load(tmp_path / "b" / "recipe.json").assignment_seed == "epoch"
    explicit = tmp_path / "explicit.toml"  # a file that asks for "epoch" keeps it
    explicit.write_text(bare.read_text() + 'assignment_seed = "epoch"\n')
    build(chain, explicit, tmp_path / "c" / "epoch.toml")
    assert (tmp_path / "c" / "recipe.json").read_bytes() == (tmp_path / "b" / "recipe.json").read_bytes()
