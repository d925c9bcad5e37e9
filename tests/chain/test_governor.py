"""Governance through the Governor contract: proposal → GNK-weighted vote → execute, on both backends."""

from __future__ import annotations

import pytest
from conftest import DEV_BALANCE, GNK, World, sha

from chain.errors import ChainRevert

VOTING_PERIOD = 3600


def escrow(world: World, *voters: int, amount: int = 600_000 * GNK) -> None:
    for i in voters:
        world.client(i, governed=True).gov_deposit(amount)


def reverts(reason: str) -> pytest.RaisesExc[ChainRevert]:
    return pytest.raises(ChainRevert, match=f"^reverted: {reason}")


def test_an_epoch_is_scheduled_and_funded_by_a_vote(world: World) -> None:
    gov = world.client(2, governed=True)
    assert gov.read(gov.registry, "governance") == gov.governor.address
    with reverts("registry: only governance"):  # not even the deployer can act alone now
        world.client(0, governed=True).create_epoch(world.spec())
    # Fund the treasury (the Governor's own GNK) by a plain transfer; voters escrow their GNK.
    gov.transfer(gov.governor.address, 5000 * GNK)
    escrow(world, 2, 3)
    spec = world.spec()
    actions = [gov.action_create_epoch(spec), *gov.action_fund_epoch(1, 3000 * GNK)]
    pid = gov.propose(actions, "epoch 1: tiny llama, 3 rounds")
    world.client(2, governed=True).vote(pid, True)
    world.client(3, governed=True).vote(pid, True)
    with reverts("governor: voting still open"):
        gov.execute(pid)
    world.backend.increase_time(VOTING_PERIOD)
    assert gov.proposal(pid).state == "passed"
    receipt = world.client(9, governed=True).execute(pid)  # anyone may execute a passed proposal
    assert gov.epochs_created(receipt) == [1]
    info = gov.get_epoch(1)
    assert info.spec == spec and info.pool == 3000 * GNK
    assert gov.proposal(pid).state == "executed"
    with reverts("governor: already executed"):
        gov.execute(pid)


def test_quorum_failure(world: World) -> None:
    gov = world.client(2, governed=True)
    # 10% of the supply (10 dev accounts × DEV_BALANCE) is the quorum; one voter with 5% falls short.
    gov.gov_deposit(DEV_BALANCE // 2)
    pid = gov.propose([gov.action_create_epoch(world.spec())], "too few voters")
    gov.vote(pid, True)
    world.backend.increase_time(VOTING_PERIOD)
    assert gov.proposal(pid).state == "no-quorum"
    with reverts("governor: quorum not reached"):
        gov.execute(pid)
    assert gov.epoch_count() == 0


def test_defeated_proposal_and_tampered_actions(world: World) -> None:
    gov = world.client(2, governed=True)
    escrow(world, 2, amount=400_000 * GNK)
    escrow(world, 3, amount=700_000 * GNK)
    pid = gov.propose([gov.action_create_epoch(world.spec())], "contested")
    world.client(2, governed=True).vote(pid, True)
    world.client(3, governed=True).vote(pid, False)
    world.backend.increase_time(VOTING_PERIOD)
    with reverts("governor: proposal defeated"):
        gov.execute(pid)
    pid2 = gov.propose([gov.action_create_epoch(world.spec())], "second try")
    world.client(2, governed=True).vote(pid2, True)
    world.client(3, governed=True).vote(pid2, True)
    world.backend.increase_time(VOTING_PERIOD)
    other = [gov.action_create_epoch(world.spec(n_rounds=99))]
    with reverts("governor: actions differ from proposal"):
        gov.execute(pid2, other)


def test_votes_cannot_be_counted_twice(world: World) -> None:
    voter = world.client(2, governed=True)
    voter.gov_deposit(100_000 * GNK)
    pid = voter.propose([voter.action_create_epoch(world.spec())], "double counting")
    voter.vote(pid, True)
    with reverts("governor: already voted"):
        voter.vote(pid, True)
    # The escrow that voted cannot move to another account to vote again while the vote is open.
    with reverts("governor: votes locked until voting ends"):
        voter.gov_withdraw(100_000 * GNK)
    with reverts("governor: no escrowed GNK to vote with"):
        world.client(4, governed=True).vote(pid, True)
    assert voter.proposal(pid).for_votes == 100_000 * GNK
    world.backend.increase_time(VOTING_PERIOD)
    with reverts("governor: voting period over"):
        world.client(3, governed=True).vote(pid, True)
    before = voter.gnk_balance()
    voter.gov_withdraw(100_000 * GNK)
    assert voter.gnk_balance() - before == 100_000 * GNK


def test_actions_cannot_spend_the_voters_escrow(world: World) -> None:
    gov = world.client(2, governed=True)
    gov.gov_deposit(DEV_BALANCE)
    # Treasury is empty: a transfer out of the Governor could only come from escrowed votes.
    steal = gov.encode(gov.gnk, "transfer", world.address(9), 1000 * GNK)
    pid = gov.propose([steal], "drain the escrow")
    gov.vote(pid, True)
    world.backend.increase_time(VOTING_PERIOD)
    with reverts("governor: actions would spend escrow"):
        gov.execute(pid)


def test_governor_slashes_and_mints(world: World) -> None:
    gov = world.client(2, governed=True)
    gov.gov_deposit(DEV_BALANCE)
    pid = gov.propose([gov.action_create_epoch(world.spec())], "epoch")
    gov.vote(pid, True)
    world.backend.increase_time(VOTING_PERIOD)
    gov.execute(pid)
    world.client(3, governed=True).join(1, 100 * GNK, sha("k3"))
    with reverts("gnk: only the minter"):
        world.client(0, governed=True).mint(world.address(0), GNK)
    challenger = world.client(4, governed=True)
    cid = challenger.challenge(1, world.address(3), sha("challenge evidence"), "ipfs://evidence")
    with reverts("registry: only governance"):  # the deployer cannot rule on it alone either
        world.client(0, governed=True).resolve_challenge(cid, True)
    actions = [
        gov.action_slash(1, world.address(3), 10 * GNK, sha("evidence")),
        gov.action_resolve_challenge(cid, True),
        gov.action_mint(world.address(5), 7 * GNK),
    ]
    pid = gov.propose(actions, "slash, uphold the challenge, mint")
    gov.vote(pid, True)
    world.backend.increase_time(VOTING_PERIOD)
    before, challenger_before = gov.gnk_balance(world.address(5)), challenger.gnk_balance()
    gov.execute(pid)
    # The direct slash takes 10 GNK, the upheld challenge the remaining 90: half to the challenger.
    assert gov.host_info(1, world.address(3)).slashed == 100 * GNK
    assert challenger.gnk_balance() - challenger_before == GNK + 45 * GNK
    assert gov.get_challenge(cid).status == "upheld"
    assert gov.gnk_balance(world.address(5)) - before == 7 * GNK
