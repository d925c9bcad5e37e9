"""The round seed's commit–reveal on both backends: who may commit and reveal, the formula, finalization."""

from __future__ import annotations

from conftest import GNK, World, reverts, seed_secret, settle_seed, sha

from chain.seed import combine_seed, seed_commitment
from chain.types import RoundSeed

AGGS = (1, 5)  # dev accounts acting as the epoch's aggregators; 9 = stranger


def open_epoch(world: World, **spec: object) -> int:
    aggregators = tuple(world.address(i) for i in AGGS)
    epoch = world.client(0).create_epoch(world.spec(aggregators=aggregators, **spec))
    world.client(0).fund_epoch(epoch, 300 * GNK)
    world.backend.increase_time(3601)  # past sign-in: rounds can be finalized
    return epoch


def test_the_seed_is_the_xor_of_the_revealed_shares(world: World) -> None:
    epoch = open_epoch(world)
    a1, a5 = world.client(1), world.client(5)
    s1, s5 = seed_secret(epoch, 1, 1), seed_secret(epoch, 1, 5)
    a1.commit_round_seed(epoch, 1, seed_commitment(s1))
    a5.commit_round_seed(epoch, 1, seed_commitment(s5))
    assert a1.seed_commitment(epoch, 1) == seed_commitment(s1)
    assert a1.seed_commitment(epoch, 1, world.address(5)) == seed_commitment(s5)
    assert a1.round_seed(epoch, 1) == RoundSeed(epoch, 1, bytes(32), commits=2, reveals=0)
    a5.reveal_round_seed(epoch, 1, s5)  # order does not matter
    assert a1.round_seed(epoch, 1).seed == combine_seed([(s5, world.address(5))])
    assert a5.seed_revealed(epoch, 1) and not a1.seed_revealed(epoch, 1)
    a1.reveal_round_seed(epoch, 1, s1)
    seed = a1.round_seed(epoch, 1)
    assert seed.seed == combine_seed([(s1, world.address(1)), (s5, world.address(5))]) != bytes(32)
    assert (seed.commits, seed.reveals, seed.complete) == (2, 2, True)
    a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 2, 100 * GNK)
    assert a1.round_result(epoch, 1).seed == seed.seed
    events = a1.registry.events.SeedRevealed().get_logs(from_block=0, argument_filters={"epoch": epoch})
    assert [(e["args"]["secret"], e["args"]["seed"]) for e in events][-1] == (s1, seed.seed)


def test_commit_rules(world: World) -> None:
    epoch = open_epoch(world, n_rounds=2)
    a1 = world.client(1)
    with reverts("registry: not an aggregator of this epoch"):
        world.client(9).commit_round_seed(epoch, 1, seed_commitment(sha("s")))
    with reverts("registry: empty seed commitment"):
        a1.commit_round_seed(epoch, 1, bytes(32))
    with reverts("registry: round beyond n_rounds"):
        a1.commit_round_seed(epoch, 3, seed_commitment(sha("s")))
    a1.commit_round_seed(epoch, 2, seed_commitment(sha("s2")))  # a later open round may be committed early
    a1.commit_round_seed(epoch, 1, seed_commitment(sha("s")))
    with reverts("registry: seed already committed"):  # never overwritten
        a1.commit_round_seed(epoch, 1, seed_commitment(sha("other")))
    a1.reveal_round_seed(epoch, 1, sha("s"))
    # Once a secret is out, a new commitment could be chosen knowing the seed: refused.
    with reverts("registry: seed reveals already started"):
        world.client(5).commit_round_seed(epoch, 1, seed_commitment(sha("late")))
    a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 0, 0)
    with reverts("registry: round already final"):
        world.client(5).commit_round_seed(epoch, 1, seed_commitment(sha("s5")))
    assert a1.round_seed(epoch, 1) == RoundSeed(epoch, 1, combine_seed([(sha("s"), world.address(1))]), 1, 1)


def test_reveal_rules(world: World) -> None:
    epoch = open_epoch(world)
    a1, a5 = world.client(1), world.client(5)
    a1.commit_round_seed(epoch, 1, seed_commitment(sha("s")))
    with reverts("registry: secret does not match the commitment"):
        a1.reveal_round_seed(epoch, 1, sha("not s"))
    with reverts("registry: no seed commitment"):  # an aggregator cannot reveal what it did not commit
        a5.reveal_round_seed(epoch, 1, sha("s"))
    with reverts("registry: not an aggregator of this epoch"):  # nor can a stranger who learnt the secret
        world.client(9).reveal_round_seed(epoch, 1, sha("s"))
    assert a1.round_seed(epoch, 1).reveals == 0
    a1.reveal_round_seed(epoch, 1, sha("s"))
    with reverts("registry: seed already revealed"):
        a1.reveal_round_seed(epoch, 1, sha("s"))
    assert a1.round_seed(epoch, 1).reveals == 1


def test_finalize_waits_for_every_reveal(world: World) -> None:
    epoch = open_epoch(world)
    a1, a5 = world.client(1), world.client(5)
    with reverts("registry: round seed not revealed"):  # no commitment at all
        a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 0, 0)
    a1.commit_round_seed(epoch, 1, seed_commitment(seed_secret(epoch, 1, 1)))
    a5.commit_round_seed(epoch, 1, seed_commitment(seed_secret(epoch, 1, 5)))
    a1.reveal_round_seed(epoch, 1, seed_secret(epoch, 1, 1))
    with reverts("registry: round seed not revealed"):  # one of two commitments still hidden
        a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 0, 0)
    a5.reveal_round_seed(epoch, 1, seed_secret(epoch, 1, 5))
    a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 0, 0)
    assert a1.latest_round(epoch) == 1


def test_an_epoch_without_replay_needs_no_seed(world: World) -> None:
    epoch = open_epoch(world, replay_probability=0.0, reward_per_round=0)
    world.client(1).finalize_round(epoch, 1, sha("c1"), sha("root"), 2, 0)
    result = world.client(1).round_result(epoch, 1)
    assert result.finalized and result.seed == bytes(32)


def test_replacing_the_aggregators_unblocks_a_withheld_reveal(world: World) -> None:
    epoch = open_epoch(world)
    a1 = world.client(1)
    a1.commit_round_seed(epoch, 1, seed_commitment(sha("never revealed")))
    with reverts("registry: round seed not revealed"):
        a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 0, 0)
    world.client(0).set_aggregators(epoch, [world.address(5), world.address(6)], 1)
    # A new aggregator set restarts the commit-reveal: the withheld commitment no longer counts.
    assert a1.round_seed(epoch, 1) == RoundSeed(epoch, 1, bytes(32), 0, 0)
    assert a1.seed_commitment(epoch, 1) == bytes(32)
    settle_seed(world, epoch, 1, aggregators=(5,))
    world.client(5).finalize_round(epoch, 1, sha("c1"), sha("root"), 0, 0)
    assert a1.round_result(epoch, 1).seed == combine_seed([(seed_secret(epoch, 1, 5), world.address(5))])
