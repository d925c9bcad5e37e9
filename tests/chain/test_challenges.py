"""Bonded challenges on both backends: filing freezes the stake; governance or an aggregator quorum
rules; upheld slashes the whole remaining stake and pays the challenger, rejected pays the host."""

from __future__ import annotations

from conftest import GNK, World, reverts, sha

from chain.types import CHALLENGER_SHARE_BPS, Challenge

STAKE = 100 * GNK
BOND = 7 * GNK
POOL = 300 * GNK
URI = "s3://evidence/0xabc.json"
HOST, OTHER, CHALLENGER = 2, 3, 9  # dev accounts; 0 = governance, 1/5/6 = aggregators


def open_epoch(world: World, aggregators: tuple[int, ...] = (1,), quorum: int = 1) -> int:
    gov = world.client(0)
    spec = world.spec(
        aggregators=tuple(world.address(i) for i in aggregators), aggregator_quorum=quorum,
        n_rounds=1, round_length=600, challenge_window=3600, challenge_bond=BOND,
    )
    epoch = gov.create_epoch(spec)
    gov.fund_epoch(epoch, POOL)
    for i in (HOST, OTHER):
        world.client(i).join(epoch, STAKE, sha(f"node-key-{i}"))
    return epoch


def end_epoch(world: World) -> None:
    world.backend.increase_time(3600 + 600)  # sign-in window + the one round's deadline


def file(world: World, epoch: int, host: int = HOST, evidence: str = "evidence") -> int:
    return world.client(CHALLENGER).challenge(epoch, world.address(host), sha(evidence), URI)


def test_upheld_by_governance_slashes_everything_left_and_pays_bond_plus_share(world: World) -> None:
    epoch = open_epoch(world)
    gov, challenger = world.client(0), world.client(CHALLENGER)
    gov.slash(epoch, world.address(HOST), 30 * GNK, sha("earlier"))
    start = challenger.gnk_balance()
    cid = file(world, epoch)  # while the epoch runs
    filed_at = gov.chain_time()
    assert challenger.gnk_balance() == start - BOND
    assert gov.host_info(epoch, world.address(HOST)).open_challenges == 1
    assert gov.get_challenge(cid) == Challenge(
        challenge_id=cid, epoch=epoch, host=world.address(HOST), challenger=world.address(CHALLENGER), bond=BOND,
        evidence_hash=sha("evidence"), evidence_uri=URI, filed_at=filed_at,
        status="open", uphold_votes=0, reject_votes=0, slashed=0,
    )
    with reverts("registry: only governance"):
        challenger.resolve_challenge(cid, True)
    pool, held = gov.get_epoch(epoch).pool, gov.gnk_balance(gov.registry.address)
    gov.resolve_challenge(cid, True)
    remaining = STAKE - 30 * GNK
    share = remaining * CHALLENGER_SHARE_BPS // 10_000
    assert (CHALLENGER_SHARE_BPS, gov.read(gov.registry, "CHALLENGER_SHARE_BPS")) == (5000, 5000)
    assert challenger.gnk_balance() == start + share  # bond back plus half of the 70 GNK slashed
    assert gov.get_epoch(epoch).pool == pool + remaining - share
    assert gov.gnk_balance(gov.registry.address) == held - BOND - share
    info = gov.host_info(epoch, world.address(HOST))
    assert (info.slashed, info.open_challenges) == (STAKE, 0)
    resolved = gov.get_challenge(cid)
    assert (resolved.status, resolved.slashed) == ("upheld", remaining)
    slashed = gov.registry.events.Slashed().get_logs(from_block=0, argument_filters={"epoch": epoch})
    assert (slashed[-1]["args"]["amount"], slashed[-1]["args"]["evidence_hash"]) == (remaining, sha("evidence"))
    with reverts("registry: challenge already resolved"):
        gov.resolve_challenge(cid, False)
    with reverts("registry: challenge already resolved"):
        world.client(1).vote_challenge(cid, False)
    with reverts("registry: no stake left to slash"):
        file(world, epoch, evidence="again")
    end_epoch(world)
    world.backend.increase_time(3600)
    assert world.client(HOST).withdraw_stake(epoch) == 0
    assert [c.challenge_id for c in gov.challenges(epoch)] == [cid]


def test_upheld_by_a_quorum_of_aggregator_votes(world: World) -> None:
    epoch = open_epoch(world, aggregators=(1, 5, 6), quorum=2)
    gov, challenger = world.client(0), world.client(CHALLENGER)
    start = challenger.gnk_balance()
    cid = file(world, epoch)
    pool = gov.get_epoch(epoch).pool
    world.client(1).vote_challenge(cid, True)
    with reverts("registry: aggregator already voted on this challenge"):
        world.client(1).vote_challenge(cid, True)
    with reverts("registry: not an aggregator of this epoch"):
        world.client(OTHER).vote_challenge(cid, True)
    world.client(5).vote_challenge(cid, False)
    progress = gov.get_challenge(cid)
    assert (progress.status, progress.uphold_votes, progress.reject_votes) == ("open", 1, 1)
    assert gov.host_info(epoch, world.address(HOST)).slashed == 0
    world.client(6).vote_challenge(cid, True)  # the second uphold vote reaches the quorum of 2
    assert gov.get_challenge(cid).status == "upheld"
    assert challenger.gnk_balance() == start + STAKE // 2
    assert gov.get_epoch(epoch).pool == pool + STAKE // 2
    assert gov.host_info(epoch, world.address(HOST)).slashed == STAKE


def test_rejected_by_aggregator_vote(world: World) -> None:
    epoch = open_epoch(world)
    host_before = world.client(HOST).gnk_balance()
    cid = file(world, epoch)
    world.client(1).vote_challenge(cid, False)  # quorum 1: one vote rules
    assert world.client(0).get_challenge(cid).status == "rejected"
    assert world.client(HOST).gnk_balance() == host_before + BOND
    assert world.client(0).host_info(epoch, world.address(HOST)).slashed == 0


def test_a_challenge_freezes_the_stake_and_a_rejected_one_pays_the_bond_to_the_host(world: World) -> None:
    epoch = open_epoch(world)
    gov, host, challenger = world.client(0), world.client(HOST), world.client(CHALLENGER)
    end_epoch(world)
    cid = file(world, epoch)  # within the window after the epoch
    world.backend.increase_time(3600)
    with reverts("registry: stake frozen by an open challenge"):
        host.withdraw_stake(epoch)
    with reverts("registry: challenge window closed"):
        world.client(CHALLENGER).challenge(epoch, world.address(OTHER), sha("late"), URI)
    assert world.client(OTHER).withdraw_stake(epoch) == STAKE  # the unchallenged host is free
    host_before, challenger_before = host.gnk_balance(), challenger.gnk_balance()
    gov.resolve_challenge(cid, False)
    assert host.gnk_balance() == host_before + BOND  # compensation for the freeze
    assert challenger.gnk_balance() == challenger_before
    assert gov.get_challenge(cid).status == "rejected"
    assert host.withdraw_stake(epoch) == STAKE
    with reverts("registry: challenge already resolved"):
        gov.resolve_challenge(cid, True)


def test_a_second_challenge_upheld_after_everything_was_slashed_gets_its_bond_back(world: World) -> None:
    epoch = open_epoch(world)
    gov, challenger = world.client(0), world.client(CHALLENGER)
    start = challenger.gnk_balance()
    first, second = file(world, epoch, evidence="one"), file(world, epoch, evidence="two")
    assert gov.host_info(epoch, world.address(HOST)).open_challenges == 2
    gov.resolve_challenge(first, True)
    gov.resolve_challenge(second, True)
    assert gov.get_challenge(second).slashed == 0
    assert challenger.gnk_balance() == start + STAKE // 2
    assert gov.host_info(epoch, world.address(HOST)).open_challenges == 0


def test_challenge_rules(world: World) -> None:
    epoch = open_epoch(world)
    challenger = world.client(CHALLENGER)
    with reverts("registry: not a host of this epoch"):
        challenger.challenge(epoch, world.address(7), sha("e"), URI)
    with reverts("registry: empty evidence_hash"):
        challenger.challenge(epoch, world.address(HOST), bytes(32), URI)
    with reverts("registry: unknown epoch"):
        challenger.challenge(epoch + 1, world.address(HOST), sha("e"), URI)
    with reverts("registry: unknown challenge"):
        world.client(0).resolve_challenge(42, True)
    end_epoch(world)
    world.backend.increase_time(3600)
    world.client(HOST).withdraw_stake(epoch)
    with reverts("registry: stake already withdrawn"):
        challenger.challenge(epoch, world.address(HOST), sha("e"), URI)
    assert world.client(0).challenges(epoch) == []
