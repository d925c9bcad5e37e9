"""The aggregator's pure parts: robust rules, pool split, copy detection, config validation."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from gonka_node.aggregator.checks import find_copies, find_resubmissions
from gonka_node.aggregator.close import equal_shares
from gonka_node.aggregator.replay import chosen_for_replay
from gonka_node.aggregator.robust import aggregate
from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import cosine, count_sketch
from gonka_node.core.config import ConfigError, load_aggregator_config, read_env

SPEC = {"a": (64, 32), "b": (100,)}


def updates(n: int, seed: int = 0, scale: float = 1.0) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"{i:02d}": {k: torch.randn(s, generator=gen) * scale for k, s in SPEC.items()} for i in range(n)}


def run(rule: str, ups: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    norms = {k: math.sqrt(sum(float(t.double().square().sum()) for t in u.values())) for k, u in ups.items()}
    return aggregate(rule, lambda: iter(sorted(ups.items())), norms, SPEC).update


def norm(u: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in u.values()))


def test_mean_is_the_plain_average() -> None:
    ups = updates(4)
    got = run("mean", ups)
    for k in SPEC:
        torch.testing.assert_close(
            got[k], torch.stack([u[k] for u in ups.values()]).mean(0), rtol=1e-6, atol=1e-6
        )


def test_clip_median_bounds_one_huge_update() -> None:
    ups = updates(5)
    ups["99"] = {k: t * 1000 for k, t in updates(1, seed=9)["00"].items()}
    honest_norm = max(norm(u) for k, u in ups.items() if k != "99")
    assert norm(run("mean", ups)) > 100 * honest_norm  # the attacker owns the plain mean
    assert norm(run("clip_median", ups)) <= honest_norm  # clipped to the median norm


def test_centered_clip_stays_near_the_honest_mean_under_attack() -> None:
    gen = torch.Generator().manual_seed(3)
    direction = {k: torch.randn(s, generator=gen) for k, s in SPEC.items()}
    ups = {
        f"{i:02d}": {k: direction[k] + 0.1 * torch.randn(s, generator=gen) for k, s in SPEC.items()}
        for i in range(6)
    }
    honest = {k: torch.stack([u[k] for u in ups.values()]).mean(0) for k in SPEC}
    ups["98"] = {k: -direction[k] * 50 for k in SPEC}
    ups["99"] = {k: -direction[k] * 50 for k in SPEC}

    def err(u: dict[str, torch.Tensor]) -> float:
        return norm({k: u[k] - honest[k] for k in SPEC})

    assert err(run("centered_clip", ups)) < 0.5 * err(run("clip_median", ups)) < err(run("mean", ups))


def test_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rule"):
        run("krum", updates(2))


def test_the_pool_is_split_equally_among_the_hosts_that_passed() -> None:
    assert equal_shares(1000, [b"a", b"b", b"c"]) == {b"a": 333, b"b": 333, b"c": 333}  # dust unpaid
    assert equal_shares(1000, [b"a"]) == {b"a": 1000}
    assert equal_shares(0, [b"a"]) == {} and equal_shares(5, []) == {}
    assert equal_shares(2, [b"a", b"b", b"c"]) == {}  # less than one ngonka each


def test_sketch_cosine_tracks_true_cosine_and_finds_near_copies() -> None:
    ups = updates(3, seed=4)
    a, b = ups["00"], ups["01"]
    near = {k: t + 0.01 * torch.randn_like(t) for k, t in a.items()}
    assert cosine(count_sketch(a), count_sketch(near)) > 0.99
    assert abs(cosine(count_sketch(a), count_sketch(b))) < 0.2

    def row(host: bytes, u: dict[str, torch.Tensor], t: int) -> SubmissionRow:
        return SubmissionRow(
            1, 1, host, b"\0" * 32, 0, 0, 0, b"", t, norm(u), count_sketch(u).numpy().tobytes(), ""
        )

    copies = find_copies([row(b"A" * 20, a, 1), row(b"B" * 20, b, 2), row(b"C" * 20, near, 3)], 0.99)
    assert list(copies) == [b"C" * 20] and "cosine" in copies[b"C" * 20]
    # Against earlier rounds: A resubmits (nearly) its round-1 update, B sends new work.
    old = [row(b"A" * 20, a, 1), row(b"B" * 20, updates(1, seed=9)["00"], 2)]
    now = [row(b"A" * 20, near, 5), row(b"B" * 20, b, 6)]
    stale = find_resubmissions(now, [dataclasses.replace(r, round=1) for r in old], 0.99)
    assert list(stale) == [b"A" * 20]
    assert f"with 0x{(b'A' * 20).hex()}, round 1 (its own earlier submission)" in stale[b"A" * 20]
    assert find_resubmissions(now, [], 0.99) == {}


def test_replay_picks_are_a_fraction_decided_by_the_round_seed_alone() -> None:
    hosts = [i.to_bytes(20, "big") for i in range(400)]
    seed = b"s" * 32
    assert chosen_for_replay(0.0, seed, 3, hosts) == set()
    assert chosen_for_replay(1.0, seed, 3, hosts) == set(hosts)
    picked = chosen_for_replay(0.25, seed, 3, hosts)
    assert 70 <= len(picked) <= 130  # binomial(400, 0.25): mean 100, sd 8.7
    assert picked == chosen_for_replay(0.25, seed, 3, list(reversed(hosts)))  # order-free
    # Each host's draw is its own: the other hosts (and their payloads) do not move it, so the last
    # submitter cannot change its fate by what it sends; only the seed, unknown until revealed, does.
    assert {h for h in hosts[:10] if chosen_for_replay(0.25, seed, 3, [h])} == picked & set(hosts[:10])
    assert chosen_for_replay(0.25, b"t" * 32, 3, hosts) != picked
    assert chosen_for_replay(0.25, seed, 4, hosts) != picked


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "agg.toml"
    p.write_text(text)
    return p


def test_config_reads_and_validates(tmp_path: Path) -> None:
    cfg = load_aggregator_config(
        write(
            tmp_path,
            '[aggregator]\ndata_dir = "state"\n[round]\nquorum = 3\nextend_s = 60\n'
            '[aggregation]\nrule = "mean"\n[aggregation.per_epoch]\n2 = "centered_clip"\n',
        ),
        environ={"GONKA_LISTEN": "127.0.0.1:7000"},
    )
    assert cfg.data_dir == tmp_path / "state" and cfg.listen == "127.0.0.1:7000"
    assert cfg.round.quorum == 3 and cfg.round.extend_s == 60.0
    assert cfg.aggregation.rule_for(1) == "mean" and cfg.aggregation.rule_for(2) == "centered_clip"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[round]\nquorum = 0\n", r"\[round\] quorum must be >= 1"),
        ('[round]\nquorum = "3"\n', r"\[round\] quorum must be a int"),
        ("[round]\nmax_chunk_bytes = 4194304\n", r"max_chunk_bytes must be in"),
        ('[aggregation]\nrule = "krum"\n', r"\[aggregation\] rule must be one of"),
        ('[aggregation.per_epoch]\n3 = "krum"\n', r"\[aggregation.per_epoch\] 3 must be one of"),
        ('[chain]\nbackend = "rpc"\n', r"rpc_url is required"),
        ("[sections]\n", r"unknown key\(s\) sections"),
        ("[aggregator\n", r"not valid TOML"),
        ("[aggregation]\nreplay_fraction = 0.5\n", r"replay_fraction: how often hosts are replayed is the epoch's replay_probability on chain"),
        ("[aggregation]\nmix_residual = 1.0\n", r"\[aggregation\] mix_residual must be in \[0, 1\)"),
        ("[aggregation]\nreplay_min_cosine = 0\n", r"\[aggregation\] replay_min_cosine must be in \(0, 1\]"),
        ("[aggregation]\nreplay_norm_tolerance = 1.0\n", r"replay_norm_tolerance must be in \(0, 1\)"),
    ],
)
def test_config_errors_name_the_file_and_field(tmp_path: Path, text: str, match: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as info:
        load_aggregator_config(path, environ={})
    assert str(path) in str(info.value)


def test_unknown_gonka_environment_variables_are_refused() -> None:
    assert read_env({"GONKA_RPC_URL": "http://x", "HOME": "/root"}) == {"GONKA_RPC_URL": "http://x"}
    with pytest.raises(ConfigError, match="GONKA_RPC_ULR"):
        read_env({"GONKA_RPC_ULR": "http://x"})
