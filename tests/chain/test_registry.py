"""Registry rules on both backends: each broken rule must come back as the contract's own reason."""

from __future__ import annotations

import pytest
from conftest import GNK, World, sha

from chain.errors import ChainRevert
from chain.merkle import RewardTree, reward_leaf
from chain.types import HostInfo

HOSTS = (2, 3, 4)  # dev accounts that act as hosts; 0 = governance, 1 = aggregator, 9 = stranger
STAKE = 100 * GNK


def open_epoch(world: World, hosts: tuple[int, ...] = HOSTS, fund: int = 3000 * GNK, **spec: object) -> int:
    gov = world.client(0)
    epoch = gov.create_epoch(world.spec(**spec))
    if fund:
        gov.fund_epoch(epoch, fund)
    for i in hosts:
        world.client(i).join(epoch, STAKE, sha(f"node-key-{i}"))
    return epoch


def start_training(world: World, epoch: int) -> None:
    info = world.client(0).get_epoch(epoch)
    world.backend.increase_time(info.spec.signin_window + 1)


def reverts(reason: str) -> pytest.RaisesExc[ChainRevert]:
    return pytest.raises(ChainRevert, match=f"^reverted: {reason}")


def test_epoch_is_readable_as_written(world: World) -> None:
    gov = world.client(0)
    spec = world.spec(aggregators=(world.address(1), world.address(5)), aggregator_quorum=2)
    epoch = gov.create_epoch(spec)
    info = gov.get_epoch(epoch)
    assert info.spec == spec
    assert (info.n_hosts, info.pool, info.latest_round, info.ended) == (0, 0, 0, False)
    assert info.signin_end == info.created_at + spec.signin_window
    gov.fund_epoch(epoch, 500 * GNK)
    assert gov.get_epoch(epoch).pool == 500 * GNK
    assert gov.epoch_count() == epoch


def test_only_governance_schedules_funds_and_sets_aggregators(world: World) -> None:
    stranger = world.client(9)
    with reverts("registry: only governance"):
        stranger.create_epoch(world.spec())
    epoch = world.client(0).create_epoch(world.spec())
    with reverts("registry: only governance"):
        stranger.fund_epoch(epoch, GNK)
    with reverts("registry: only governance"):
        stranger.set_aggregators(epoch, [world.address(9)])


def test_bad_spec_is_refused_on_chain(world: World) -> None:
    # The Python EpochSpec refuses a zero quorum too; the contract must not rely on it.
    gov = world.client(0)
    bad = list(world.spec().to_abi())
    bad[16] = 0  # aggregator_quorum
    with reverts("registry: aggregator quorum outside"):
        gov.transact(gov.registry, "create_epoch", tuple(bad))
    bad = list(world.spec().to_abi())
    bad[15] = [world.address(1), world.address(1)]
    with reverts("registry: duplicate aggregator"):
        gov.transact(gov.registry, "create_epoch", tuple(bad))


def test_join_assigns_slots_in_signin_order_and_escrows_stake(world: World) -> None:
    epoch = open_epoch(world, hosts=(4, 2, 3))
    gov = world.client(0)
    assert gov.hosts(epoch) == [world.address(4), world.address(2), world.address(3)]
    info = gov.host_info(epoch, world.address(2))
    assert info == HostInfo(joined=True, left=False, withdrawn=False, slot=1, node_key=sha("node-key-2"),
                            stake=STAKE, slashed=0)
    assert gov.get_epoch(epoch).total_stake == 3 * STAKE
    assert gov.gnk_balance(gov.registry.address) == 3 * STAKE + 3000 * GNK


def test_join_rules(world: World) -> None:
    epoch = open_epoch(world, hosts=(2,), max_hosts=2)
    with reverts("registry: already joined"):
        world.client(2).join(epoch, STAKE, sha("another key"))
    with reverts("registry: stake below minimum"):
        world.client(3).join(epoch, STAKE - 1, sha("k3"))
    with reverts("registry: node key already registered"):
        world.client(3).join(epoch, STAKE, sha("node-key-2"))
    with reverts("registry: unknown epoch"):
        world.client(3).join(epoch + 1, STAKE, sha("k3"))
    world.client(3).join(epoch, STAKE, sha("k3"))
    with reverts("registry: epoch full"):
        world.client(4).join(epoch, STAKE, sha("k4"))


def test_join_outside_the_signin_window(world: World) -> None:
    epoch = open_epoch(world, hosts=())
    start_training(world, epoch)
    before = world.client(2).gnk_balance()
    with reverts("registry: sign-in window closed"):
        world.client(2).join(epoch, STAKE, sha("late"))
    assert world.client(2).gnk_balance() == before
    assert not world.client(0).host_info(epoch, world.address(2)).joined


def test_finalize_rules(world: World) -> None:
    epoch = open_epoch(world)
    agg, stranger = world.client(1), world.client(9)
    with reverts("registry: sign-in window still open"):
        agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 1000 * GNK)
    start_training(world, epoch)
    with reverts("registry: not an aggregator of this epoch"):
        stranger.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 1000 * GNK)
    with reverts("registry: round out of order"):
        agg.finalize_round(epoch, 2, sha("c2"), sha("root"), 3, 1000 * GNK)
    with reverts("registry: total reward exceeds the epoch's pool"):
        agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 3001 * GNK)
    with reverts("registry: empty checkpoint hash"):
        agg.finalize_round(epoch, 1, bytes(32), sha("root"), 3, 1000 * GNK)
    with reverts("registry: rewards without a root"):
        agg.finalize_round(epoch, 1, sha("c1"), bytes(32), 3, 1000 * GNK)
    agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 1000 * GNK)
    with reverts("registry: round out of order"):
        agg.finalize_round(epoch, 1, sha("c1-again"), sha("root"), 3, 1000 * GNK)
    result = agg.round_result(epoch, 1)
    assert (result.checkpoint_sha256, result.n_contributors, result.total_reward) == (sha("c1"), 3, 1000 * GNK)
    assert agg.latest_round(epoch) == 1
    assert agg.get_epoch(epoch).pool == 2000 * GNK


def test_rounds_beyond_n_rounds_are_refused_and_the_epoch_ends(world: World) -> None:
    epoch = open_epoch(world, n_rounds=2)
    start_training(world, epoch)
    agg = world.client(1)
    for r in (1, 2):
        agg.finalize_round(epoch, r, sha(f"c{r}"), sha("root"), 3, 10 * GNK)
    with reverts("registry: round beyond n_rounds"):
        agg.finalize_round(epoch, 3, sha("c3"), sha("root"), 3, 10 * GNK)
    assert agg.get_epoch(epoch).ended


def test_aggregator_quorum_needs_matching_results(world: World) -> None:
    aggs = (world.address(1), world.address(5), world.address(6))
    epoch = open_epoch(world, aggregators=aggs, aggregator_quorum=2)
    start_training(world, epoch)
    a1, a5, a6 = world.client(1), world.client(5), world.client(6)
    a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    assert not a1.round_result(epoch, 1).finalized
    with reverts("registry: aggregator already voted this round"):
        a1.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    a5.finalize_round(epoch, 1, sha("c1-different"), sha("root"), 3, 100 * GNK)
    assert not a5.round_result(epoch, 1).finalized
    a6.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    assert a6.round_result(epoch, 1).checkpoint_sha256 == sha("c1")
    assert a6.latest_round(epoch) == 1


def test_claims_by_merkle_proof(world: World) -> None:
    epoch = open_epoch(world)
    start_training(world, epoch)
    gov = world.client(0)
    rewards = [(world.address(2), 500 * GNK), (world.address(3), 300 * GNK), (world.address(4), 200 * GNK)]
    tree = RewardTree(gov.chain_id, gov.registry.address, epoch, 1, rewards)
    world.client(1).finalize_round(epoch, 1, sha("c1"), tree.root, 3, tree.total)
    host = world.client(3)
    before = host.gnk_balance()
    with reverts("registry: invalid Merkle proof"):
        host.claim(epoch, 1, 301 * GNK, tree.proof(world.address(3)))
    with reverts("registry: invalid Merkle proof"):
        host.claim(epoch, 1, 300 * GNK, tree.proof(world.address(2)))
    with reverts("registry: invalid Merkle proof"):  # someone else's leaf, claimed by a stranger
        world.client(9).claim(epoch, 1, 500 * GNK, tree.proof(world.address(2)))
    host.claim(epoch, 1, 300 * GNK, tree.proof(world.address(3)))
    assert host.gnk_balance() - before == 300 * GNK
    assert host.claimed(epoch, 1) and not host.claimed(epoch, 1, world.address(2))
    with reverts("registry: reward already claimed"):
        host.claim(epoch, 1, 300 * GNK, tree.proof(world.address(3)))
    result = gov.round_result(epoch, 1)
    assert (result.claimed, result.unclaimed) == (300 * GNK, 700 * GNK)


def test_a_bad_root_cannot_pay_more_than_the_round_total(world: World) -> None:
    epoch = open_epoch(world)
    start_training(world, epoch)
    gov = world.client(0)
    # The aggregator publishes a root whose leaves add up to more than the declared total.
    tree = RewardTree(gov.chain_id, gov.registry.address, epoch, 1, [(world.address(2), 80 * GNK), (world.address(3), 80 * GNK)])
    world.client(1).finalize_round(epoch, 1, sha("c1"), tree.root, 2, 100 * GNK)
    world.client(2).claim(epoch, 1, 80 * GNK, tree.proof(world.address(2)))
    with reverts("registry: claims exceed the round's total reward"):
        world.client(3).claim(epoch, 1, 80 * GNK, tree.proof(world.address(3)))


def test_python_leaf_and_proofs_match_the_contract(world: World) -> None:
    gov = world.client(0)
    epoch = open_epoch(world, hosts=())
    args = (epoch, 7, world.address(2), 123 * GNK)
    assert gov.read(gov.registry, "reward_leaf", *args) == reward_leaf(gov.chain_id, gov.registry.address, *args)
    start_training(world, epoch)
    rewards = [(f"0x{i:040x}", i + 1) for i in range(1, 1025)]
    tree = RewardTree(gov.chain_id, gov.registry.address, epoch, 1, rewards)
    world.client(1).finalize_round(epoch, 1, sha("c1"), tree.root, 0, 0)
    for host, amount in (rewards[0], rewards[511], rewards[-1]):
        assert gov.read(gov.registry, "verify_reward", epoch, 1, host, amount, tree.proof(host))
        assert not gov.read(gov.registry, "verify_reward", epoch, 1, host, amount + 1, tree.proof(host))


def test_slash_rules_and_slashed_stake_refills_the_pool(world: World) -> None:
    epoch = open_epoch(world)
    gov = world.client(0)
    with reverts("registry: only governance"):
        world.client(9).slash(epoch, world.address(2), GNK, sha("evidence"))
    with reverts("registry: only governance"):  # aggregators report evidence; governance slashes
        world.client(1).slash(epoch, world.address(2), GNK, sha("evidence"))
    with reverts("registry: slash exceeds remaining stake"):
        gov.slash(epoch, world.address(2), STAKE + 1, sha("evidence"))
    with reverts("registry: not a host of this epoch"):
        gov.slash(epoch, world.address(9), GNK, sha("evidence"))
    pool = gov.get_epoch(epoch).pool
    gov.slash(epoch, world.address(2), 40 * GNK, sha("evidence"))
    assert gov.host_info(epoch, world.address(2)).slashed == 40 * GNK
    assert gov.get_epoch(epoch).pool == pool + 40 * GNK
    events = gov.registry.events.Slashed().get_logs(from_block=0, argument_filters={"epoch": epoch})
    assert events[-1]["args"]["evidence_hash"] == sha("evidence")


def test_leave_and_withdraw_after_the_epoch(world: World) -> None:
    epoch = open_epoch(world, n_rounds=1)
    host = world.client(2)
    host.leave(epoch)
    with reverts("registry: already left"):
        host.leave(epoch)
    assert world.client(0).hosts(epoch)[0] == world.address(2)  # slots never move
    world.client(0).slash(epoch, world.address(3), 30 * GNK, sha("evidence"))
    with reverts("registry: epoch still running"):
        host.withdraw_stake(epoch)
    start_training(world, epoch)
    world.client(1).finalize_round(epoch, 1, sha("c1"), sha("root"), 2, 0)
    before = host.gnk_balance()
    assert host.withdraw_stake(epoch) == STAKE
    assert host.gnk_balance() - before == STAKE
    with reverts("registry: stake already withdrawn"):
        host.withdraw_stake(epoch)
    assert world.client(3).withdraw_stake(epoch) == STAKE - 30 * GNK
    with reverts("registry: stake already withdrawn"):
        world.client(0).slash(epoch, world.address(3), GNK, sha("evidence"))


def test_stake_comes_back_after_the_deadline_without_results(world: World) -> None:
    epoch = open_epoch(world, hosts=(2,), n_rounds=2, round_length=600)
    start_training(world, epoch)
    with reverts("registry: epoch still running"):
        world.client(2).withdraw_stake(epoch)
    world.backend.increase_time(2 * 600)
    assert world.client(2).withdraw_stake(epoch) == STAKE


def test_set_aggregators_replaces_the_set(world: World) -> None:
    epoch = open_epoch(world)
    gov = world.client(0)
    gov.set_aggregators(epoch, [world.address(5)], 1)
    start_training(world, epoch)
    with reverts("registry: not an aggregator of this epoch"):
        world.client(1).finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 0)
    world.client(5).finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 0)
    assert gov.get_epoch(epoch).spec.aggregators == (world.address(5),)
