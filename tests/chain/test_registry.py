"""Registry rules on both backends: each broken rule must come back as the contract's own reason."""

from __future__ import annotations

from conftest import GNK, World, reverts, settle_seed, sha

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


def finalize(world: World, epoch: int, round_: int, total: int = 0, root: bytes = sha("root")) -> None:
    settle_seed(world, epoch, round_)
    world.client(1).finalize_round(epoch, round_, sha(f"c{round_}"), root, 3, total)


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
    for index, value, reason in (
        (18, 10**9 + 1, "registry: replay probability above 1"),
        (19, 0, "registry: challenge_window must be > 0"),
        (20, 0, "registry: challenge_bond must be > 0"),
    ):
        bad = list(world.spec().to_abi())
        bad[index] = value
        with reverts(reason):
            gov.transact(gov.registry, "create_epoch", tuple(bad))
    assert gov.epoch_count() == 0


def create_raw(world: World, min_stake: int, reward: int, p_e9: int) -> int:
    """create_epoch with the stake-rule fields set directly (EpochSpec refuses a bad one in Python)."""
    gov = world.client(0)
    spec = list(world.spec(reward_per_round=0).to_abi())
    spec[13], spec[17], spec[18] = min_stake, reward, p_e9
    return gov.epochs_created(gov.transact(gov.registry, "create_epoch", tuple(spec)))[0]


def test_stake_must_cover_the_round_reward_at_the_replay_probability(world: World) -> None:
    rule = "registry: min_stake x replay probability below reward_per_round"
    # p = 0.25: a cheat is caught once in four rounds, so stake must be >= 4 x the round reward.
    with reverts(rule):
        create_raw(world, min_stake=400 * GNK - 1, reward=100 * GNK, p_e9=250_000_000)
    epoch = create_raw(world, min_stake=400 * GNK, reward=100 * GNK, p_e9=250_000_000)  # the boundary
    spec = world.client(0).get_epoch(epoch).spec
    assert (spec.min_stake, spec.reward_per_round, spec.replay_probability) == (400 * GNK, 100 * GNK, 0.25)
    with reverts(rule):  # unverifiable (p = 0) epochs cannot pay
        create_raw(world, min_stake=10**6 * GNK, reward=1, p_e9=0)
    assert create_raw(world, min_stake=0, reward=0, p_e9=0) == epoch + 1
    assert world.client(0).epoch_count() == epoch + 1


def test_join_assigns_slots_in_signin_order_and_escrows_stake(world: World) -> None:
    epoch = open_epoch(world, hosts=(4, 2, 3))
    gov = world.client(0)
    assert gov.hosts(epoch) == [world.address(4), world.address(2), world.address(3)]
    info = gov.host_info(epoch, world.address(2))
    assert info == HostInfo(joined=True, left=False, withdrawn=False, slot=1, node_key=sha("node-key-2"),
                            stake=STAKE, slashed=0, open_challenges=0)
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
    epoch = open_epoch(world, fund=150 * GNK)
    agg, stranger = world.client(1), world.client(9)
    with reverts("registry: sign-in window still open"):
        agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    start_training(world, epoch)
    with reverts("registry: not an aggregator of this epoch"):
        stranger.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    with reverts("registry: round out of order"):
        agg.finalize_round(epoch, 2, sha("c2"), sha("root"), 3, 100 * GNK)
    with reverts("registry: round seed not revealed"):
        agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    settle_seed(world, epoch, 1)
    with reverts("registry: total reward above reward_per_round"):
        agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK + 1)
    with reverts("registry: empty checkpoint hash"):
        agg.finalize_round(epoch, 1, bytes(32), sha("root"), 3, 100 * GNK)
    with reverts("registry: rewards without a root"):
        agg.finalize_round(epoch, 1, sha("c1"), bytes(32), 3, 100 * GNK)
    agg.finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 100 * GNK)
    with reverts("registry: round out of order"):
        agg.finalize_round(epoch, 1, sha("c1-again"), sha("root"), 3, 100 * GNK)
    result = agg.round_result(epoch, 1)
    assert (result.checkpoint_sha256, result.n_contributors, result.total_reward) == (sha("c1"), 3, 100 * GNK)
    assert agg.latest_round(epoch) == 1
    assert agg.get_epoch(epoch).pool == 50 * GNK
    settle_seed(world, epoch, 2)
    with reverts("registry: total reward exceeds the epoch's pool"):
        agg.finalize_round(epoch, 2, sha("c2"), sha("root"), 3, 50 * GNK + 1)


def test_rounds_beyond_n_rounds_are_refused_and_the_epoch_ends(world: World) -> None:
    epoch = open_epoch(world, n_rounds=2)
    start_training(world, epoch)
    agg = world.client(1)
    for r in (1, 2):
        finalize(world, epoch, r, 10 * GNK)
    with reverts("registry: round beyond n_rounds"):
        agg.finalize_round(epoch, 3, sha("c3"), sha("root"), 3, 10 * GNK)
    assert agg.get_epoch(epoch).ended


def test_aggregator_quorum_needs_matching_results(world: World) -> None:
    aggs = (world.address(1), world.address(5), world.address(6))
    epoch = open_epoch(world, aggregators=aggs, aggregator_quorum=2)
    start_training(world, epoch)
    settle_seed(world, epoch, 1)
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
    rewards = [(world.address(2), 50 * GNK), (world.address(3), 30 * GNK), (world.address(4), 20 * GNK)]
    tree = RewardTree(gov.chain_id, gov.registry.address, epoch, 1, rewards)
    finalize(world, epoch, 1, tree.total, tree.root)
    host = world.client(3)
    before = host.gnk_balance()
    with reverts("registry: invalid Merkle proof"):
        host.claim(epoch, 1, 31 * GNK, tree.proof(world.address(3)))
    with reverts("registry: invalid Merkle proof"):
        host.claim(epoch, 1, 30 * GNK, tree.proof(world.address(2)))
    with reverts("registry: invalid Merkle proof"):  # someone else's leaf, claimed by a stranger
        world.client(9).claim(epoch, 1, 50 * GNK, tree.proof(world.address(2)))
    host.claim(epoch, 1, 30 * GNK, tree.proof(world.address(3)))
    assert host.gnk_balance() - before == 30 * GNK
    assert host.claimed(epoch, 1) and not host.claimed(epoch, 1, world.address(2))
    with reverts("registry: reward already claimed"):
        host.claim(epoch, 1, 30 * GNK, tree.proof(world.address(3)))
    result = gov.round_result(epoch, 1)
    assert (result.claimed, result.unclaimed) == (30 * GNK, 70 * GNK)


def test_a_bad_root_cannot_pay_more_than_the_round_total(world: World) -> None:
    epoch = open_epoch(world)
    start_training(world, epoch)
    gov = world.client(0)
    # The aggregator publishes a root whose leaves add up to more than the declared total.
    tree = RewardTree(gov.chain_id, gov.registry.address, epoch, 1, [(world.address(2), 80 * GNK), (world.address(3), 80 * GNK)])
    finalize(world, epoch, 1, 100 * GNK, tree.root)
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
    finalize(world, epoch, 1, 0, tree.root)
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


def test_leave_and_withdraw_after_the_epoch_and_its_challenge_window(world: World) -> None:
    epoch = open_epoch(world, n_rounds=1)
    host, gov = world.client(2), world.client(0)
    host.leave(epoch)
    with reverts("registry: already left"):
        host.leave(epoch)
    assert gov.hosts(epoch)[0] == world.address(2)  # slots never move
    gov.slash(epoch, world.address(3), 30 * GNK, sha("evidence"))
    with reverts("registry: epoch still running"):
        host.withdraw_stake(epoch)
    start_training(world, epoch)
    finalize(world, epoch, 1)
    end = gov.round_result(epoch, 1).finalized_at
    assert (gov.epoch_end(epoch), gov.stake_unlock_time(epoch)) == (end, end + 3600)
    # The epoch is over, but a slash for what it did may still come: the stake stays locked.
    with reverts("registry: stake locked until the challenge window closes"):
        host.withdraw_stake(epoch)
    world.backend.increase_time(3600)
    before = host.gnk_balance()
    assert host.withdraw_stake(epoch) == STAKE
    assert host.gnk_balance() - before == STAKE
    with reverts("registry: stake already withdrawn"):
        host.withdraw_stake(epoch)
    assert world.client(3).withdraw_stake(epoch) == STAKE - 30 * GNK
    with reverts("registry: stake already withdrawn"):
        gov.slash(epoch, world.address(3), GNK, sha("evidence"))


def test_stake_comes_back_after_the_deadline_and_window_without_results(world: World) -> None:
    epoch = open_epoch(world, hosts=(2,), n_rounds=2, round_length=600, challenge_window=900)
    start_training(world, epoch)
    with reverts("registry: epoch still running"):
        world.client(2).withdraw_stake(epoch)
    gov = world.client(0)
    deadline = gov.get_epoch(epoch).signin_end + 2 * 600
    assert (gov.epoch_end(epoch), gov.stake_unlock_time(epoch)) == (deadline, deadline + 900)
    world.backend.increase_time(2 * 600)
    with reverts("registry: stake locked until the challenge window closes"):
        world.client(2).withdraw_stake(epoch)
    world.backend.increase_time(900)
    assert world.client(2).withdraw_stake(epoch) == STAKE


def test_set_aggregators_replaces_the_set(world: World) -> None:
    epoch = open_epoch(world)
    gov = world.client(0)
    gov.set_aggregators(epoch, [world.address(5)], 1)
    start_training(world, epoch)
    with reverts("registry: not an aggregator of this epoch"):
        world.client(1).finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 0)
    settle_seed(world, epoch, 1, aggregators=(5,))
    world.client(5).finalize_round(epoch, 1, sha("c1"), sha("root"), 3, 0)
    assert gov.get_epoch(epoch).spec.aggregators == (world.address(5),)
