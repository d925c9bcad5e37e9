# pragma version 0.4.3
"""
@title Governor
@notice Proposal -> vote -> execute, weighted by GNK held in escrow here.
@dev    Double counting is prevented by escrow, not by snapshots: a vote weighs the voter's escrowed
        GNK at the moment of voting, and that escrow stays locked until the voting period of every
        proposal the voter has voted on is over. Tokens that voted cannot leave the escrow, be
        transferred to a second account and vote again on the same proposal, and one account votes
        once per proposal. A proposal stores only the hash of its actions (targets + calldata); the
        full actions are in the ProposalCreated event and are passed again to `execute`.
        Passing rule: the voting period is over, for + against >= quorum, and for > against.
        The quorum is fixed at creation: quorum_bps of the GNK total supply at that moment.
"""

from ethereum.ercs import IERC20

MAX_ACTIONS: constant(uint256) = 8
MAX_CALLDATA: constant(uint256) = 4096

struct Proposal:
    proposer: address
    actions_hash: bytes32
    vote_end: uint256
    quorum: uint256
    for_votes: uint256
    against_votes: uint256
    executed: bool

event ProposalCreated:
    proposal_id: indexed(uint256)
    proposer: indexed(address)
    targets: DynArray[address, MAX_ACTIONS]
    calldatas: DynArray[Bytes[MAX_CALLDATA], MAX_ACTIONS]
    description: String[256]
    vote_end: uint256
    quorum: uint256

event VoteCast:
    proposal_id: indexed(uint256)
    voter: indexed(address)
    support: bool
    weight: uint256

event ProposalExecuted:
    proposal_id: indexed(uint256)

event Deposited:
    voter: indexed(address)
    amount: uint256

event Withdrawn:
    voter: indexed(address)
    amount: uint256

gnk: public(IERC20)
voting_period: public(uint256)
quorum_bps: public(uint256)
proposal_threshold: public(uint256)

proposal_count: public(uint256)
proposals: public(HashMap[uint256, Proposal])
has_voted: public(HashMap[uint256, HashMap[address, bool]])

escrow: public(HashMap[address, uint256])
locked_until: public(HashMap[address, uint256])
total_escrow: public(uint256)


@deploy
def __init__(gnk: IERC20, voting_period: uint256, quorum_bps: uint256, proposal_threshold: uint256):
    assert voting_period > 0, "governor: zero voting period"
    assert quorum_bps > 0 and quorum_bps <= 10000, "governor: quorum_bps outside 1..10000"
    self.gnk = gnk
    self.voting_period = voting_period
    self.quorum_bps = quorum_bps
    self.proposal_threshold = proposal_threshold


@external
def deposit(amount: uint256):
    assert amount > 0, "governor: zero deposit"
    assert extcall self.gnk.transferFrom(msg.sender, self, amount), "governor: transfer failed"
    self.escrow[msg.sender] += amount
    self.total_escrow += amount
    log Deposited(voter=msg.sender, amount=amount)


@external
def withdraw(amount: uint256):
    assert block.timestamp >= self.locked_until[msg.sender], "governor: votes locked until voting ends"
    assert self.escrow[msg.sender] >= amount, "governor: withdraw exceeds escrow"
    self.escrow[msg.sender] -= amount
    self.total_escrow -= amount
    assert extcall self.gnk.transfer(msg.sender, amount), "governor: transfer failed"
    log Withdrawn(voter=msg.sender, amount=amount)


@internal
@pure
def _actions_hash(
    targets: DynArray[address, MAX_ACTIONS], calldatas: DynArray[Bytes[MAX_CALLDATA], MAX_ACTIONS]
) -> bytes32:
    return keccak256(abi_encode(targets, calldatas))


@external
def propose(
    targets: DynArray[address, MAX_ACTIONS],
    calldatas: DynArray[Bytes[MAX_CALLDATA], MAX_ACTIONS],
    description: String[256],
) -> uint256:
    assert len(targets) > 0, "governor: no actions"
    assert len(targets) == len(calldatas), "governor: targets and calldatas differ in length"
    assert self.escrow[msg.sender] >= self.proposal_threshold, "governor: escrow below proposal threshold"
    pid: uint256 = self.proposal_count + 1
    self.proposal_count = pid
    quorum: uint256 = staticcall self.gnk.totalSupply() * self.quorum_bps // 10000
    vote_end: uint256 = block.timestamp + self.voting_period
    self.proposals[pid] = Proposal(
        proposer=msg.sender,
        actions_hash=self._actions_hash(targets, calldatas),
        vote_end=vote_end,
        quorum=quorum,
        for_votes=0,
        against_votes=0,
        executed=False,
    )
    log ProposalCreated(
        proposal_id=pid,
        proposer=msg.sender,
        targets=targets,
        calldatas=calldatas,
        description=description,
        vote_end=vote_end,
        quorum=quorum,
    )
    return pid


@external
def vote(proposal_id: uint256, support: bool):
    p: Proposal = self.proposals[proposal_id]
    assert p.vote_end != 0, "governor: unknown proposal"
    assert block.timestamp < p.vote_end, "governor: voting period over"
    assert not self.has_voted[proposal_id][msg.sender], "governor: already voted"
    weight: uint256 = self.escrow[msg.sender]
    assert weight > 0, "governor: no escrowed GNK to vote with"
    self.has_voted[proposal_id][msg.sender] = True
    # The escrow that voted stays here until this vote is over (see the contract docstring).
    self.locked_until[msg.sender] = max(self.locked_until[msg.sender], p.vote_end)
    if support:
        self.proposals[proposal_id].for_votes = p.for_votes + weight
    else:
        self.proposals[proposal_id].against_votes = p.against_votes + weight
    log VoteCast(proposal_id=proposal_id, voter=msg.sender, support=support, weight=weight)


@view
@external
def state(proposal_id: uint256) -> String[16]:
    p: Proposal = self.proposals[proposal_id]
    if p.vote_end == 0:
        return "unknown"
    if p.executed:
        return "executed"
    if block.timestamp < p.vote_end:
        return "voting"
    if p.for_votes + p.against_votes < p.quorum:
        return "no-quorum"
    if p.for_votes <= p.against_votes:
        return "defeated"
    return "passed"


@external
def execute(
    proposal_id: uint256,
    targets: DynArray[address, MAX_ACTIONS],
    calldatas: DynArray[Bytes[MAX_CALLDATA], MAX_ACTIONS],
):
    p: Proposal = self.proposals[proposal_id]
    assert p.vote_end != 0, "governor: unknown proposal"
    assert not p.executed, "governor: already executed"
    assert block.timestamp >= p.vote_end, "governor: voting still open"
    assert p.for_votes + p.against_votes >= p.quorum, "governor: quorum not reached"
    assert p.for_votes > p.against_votes, "governor: proposal defeated"
    assert self._actions_hash(targets, calldatas) == p.actions_hash, "governor: actions differ from proposal"
    # Mark first: an action that calls back into execute() finds the proposal spent.
    self.proposals[proposal_id].executed = True
    for i: uint256 in range(len(targets), bound=MAX_ACTIONS):
        raw_call(targets[i], calldatas[i])
    # Actions spend the treasury (this contract's GNK beyond the escrow), never the voters' escrow.
    assert staticcall self.gnk.balanceOf(self) >= self.total_escrow, "governor: actions would spend escrow"
    log ProposalExecuted(proposal_id=proposal_id)
