# pragma version 0.4.3
# Codesize, not gas: with the challenge, seed and publication rules the gas-optimized runtime is
# 24,372 bytes, 204 under the EIP-170 limit (24,576); codesize leaves ~1.2 KB (docs/PROTOCOL.md).
# pragma optimize codesize
"""
@title Registry
@notice The books of decentralized training: epochs scheduled by governance, hosts signing in with a
        GNK stake and their ed25519 node key, one result per round posted by the epoch's aggregators
        (checkpoint sha256 + Merkle root of rewards), reward claims by Merkle proof, the round seed
        that picks which hosts are replayed, bonded challenges and slashing, and the publication of
        each epoch's recipe and aggregator endpoints.
@dev    Gas of finalize_round and claim does not depend on the number of hosts: a round stores one
        root, a claim verifies one proof (log2 of the number of hosts).
        Reward leaf = keccak256(abi_encode(LEAF_TAG, chain.id, self, epoch, round, host, amount));
        inner node = keccak256(min(a, b) ++ max(a, b)) (sorted pairs, so proofs carry no indices).
        n_contributors is the aggregator's report, kept for clients; nothing is paid by it (payments
        need a leaf in the root and stay within total_reward), so finalize reads no per-host state.
        Stake rule: each round is replayed with probability p (replay_probability_e9 / 1e9), and a
        cheat caught loses its whole stake, so min_stake * p >= reward_per_round makes cheating a
        losing bet; create_epoch refuses an epoch breaking it, finalize_round a round paying more.
        Round seed: the epoch's aggregators commit keccak256(secret) when they open a round and
        reveal the secret once submissions are fixed; seed = XOR of keccak256(abi_encode(secret,
        aggregator)) over the reveals. Commits close at the first reveal, and with p > 0 a round is
        final only when every commitment is revealed. Limits: an aggregator that committed and never
        reveals blocks the round until governance replaces the aggregator set (which restarts the
        commit-reveal of open rounds); a single aggregator knows the seed before anyone else.
        Stake stays locked until challenge_window seconds after the epoch's end; until then anyone
        may file a challenge with a bond, which freezes the host's stake until governance, or a
        quorum of the epoch's aggregators, resolves it. Upheld: the whole remaining stake is
        slashed, the challenger gets its bond and CHALLENGER_SHARE_BPS of it, the rest goes to the
        epoch's reward pool. Rejected: the bond goes to the host. Governance may also slash directly.
"""

from ethereum.ercs import IERC20

MAX_AGGREGATORS: constant(uint256) = 16
MAX_PROOF: constant(uint256) = 32
MAX_PAGE: constant(uint256) = 256
MAX_HOSTS_LIMIT: constant(uint32) = 65536
LEAF_TAG: constant(bytes32) = keccak256("gonka.reward-leaf.v1")
E9: constant(uint256) = 10**9
BPS: constant(uint256) = 10000
CHALLENGER_SHARE_BPS: public(constant(uint256)) = 5000
MAX_URI: constant(uint256) = 256
MAX_RECIPE: constant(uint256) = 8192
MAX_CERT: constant(uint256) = 4096
OPEN: constant(uint8) = 1
UPHELD: constant(uint8) = 2
REJECTED: constant(uint8) = 3

struct EpochSpec:
    model_spec_hash: bytes32
    model_uri: String[256]
    data_manifest_hash: bytes32
    init_checkpoint_hash: bytes32
    inner_steps: uint32
    inner_lr_e9: uint64
    batch_size: uint32
    outer_lr_e9: uint64
    outer_momentum_e9: uint64
    codec: String[64]
    n_rounds: uint32
    round_length: uint64
    signin_window: uint64
    min_stake: uint256
    max_hosts: uint32
    aggregators: DynArray[address, MAX_AGGREGATORS]
    aggregator_quorum: uint8
    reward_per_round: uint256
    replay_probability_e9: uint64
    challenge_window: uint64
    challenge_bond: uint256

struct EpochState:
    created_at: uint256
    signin_end: uint256
    n_hosts: uint32
    total_stake: uint256
    pool: uint256
    funded: uint256
    latest_round: uint32

struct Host:
    joined: bool
    left: bool
    withdrawn: bool
    slot: uint32
    node_key: bytes32
    stake: uint256
    slashed: uint256
    open_challenges: uint32

struct RoundResult:
    checkpoint_sha256: bytes32
    rewards_root: bytes32
    n_contributors: uint32
    total_reward: uint256
    claimed: uint256
    finalized_at: uint256
    seed: bytes32

struct RoundSeed:
    seed: bytes32
    commits: uint32
    reveals: uint32

struct Challenge:
    epoch: uint256
    host: address
    challenger: address
    bond: uint256
    evidence_hash: bytes32
    filed_at: uint256
    status: uint8
    uphold_votes: uint8
    reject_votes: uint8
    slashed: uint256

struct Announcement:
    endpoint: String[MAX_URI]
    tls_cert_sha256: bytes32

event EpochCreated:
    epoch: indexed(uint256)
    model_spec_hash: bytes32
    data_manifest_hash: bytes32
    init_checkpoint_hash: bytes32
    n_rounds: uint32
    signin_end: uint256
    reward_per_round: uint256

event EpochFunded:
    epoch: indexed(uint256)
    funder: indexed(address)
    amount: uint256
    pool: uint256

event AggregatorsSet:
    epoch: indexed(uint256)
    aggregators: DynArray[address, MAX_AGGREGATORS]
    quorum: uint8

event HostJoined:
    epoch: indexed(uint256)
    host: indexed(address)
    slot: uint32
    node_key: bytes32
    stake: uint256

event HostLeft:
    epoch: indexed(uint256)
    host: indexed(address)
    slot: uint32

event RoundVote:
    epoch: indexed(uint256)
    round: indexed(uint256)
    aggregator: indexed(address)
    result_hash: bytes32
    votes: uint256

event RoundFinalized:
    epoch: indexed(uint256)
    round: indexed(uint256)
    checkpoint_sha256: bytes32
    rewards_root: bytes32
    n_contributors: uint32
    total_reward: uint256

event RewardClaimed:
    epoch: indexed(uint256)
    round: indexed(uint256)
    host: indexed(address)
    amount: uint256

event Slashed:
    epoch: indexed(uint256)
    host: indexed(address)
    amount: uint256
    evidence_hash: bytes32

event StakeWithdrawn:
    epoch: indexed(uint256)
    host: indexed(address)
    amount: uint256

event SeedCommitted:
    epoch: indexed(uint256)
    round: indexed(uint256)
    aggregator: indexed(address)
    commitment: bytes32

event SeedRevealed:
    epoch: indexed(uint256)
    round: indexed(uint256)
    aggregator: indexed(address)
    secret: bytes32
    seed: bytes32

event ChallengeFiled:
    challenge_id: indexed(uint256)
    epoch: indexed(uint256)
    host: indexed(address)
    challenger: address
    bond: uint256
    evidence_hash: bytes32
    evidence_uri: String[MAX_URI]

event ChallengeVote:
    challenge_id: indexed(uint256)
    aggregator: indexed(address)
    uphold: bool
    votes: uint8

event ChallengeResolved:
    challenge_id: indexed(uint256)
    epoch: indexed(uint256)
    host: indexed(address)
    upheld: bool
    slashed: uint256
    to_challenger: uint256
    to_host: uint256

event RecipePublished:
    epoch: indexed(uint256)
    publisher: indexed(address)
    recipe_json: Bytes[MAX_RECIPE]

event AggregatorAnnounced:
    epoch: indexed(uint256)
    aggregator: indexed(address)
    endpoint: String[MAX_URI]
    tls_cert_sha256: bytes32
    tls_cert: Bytes[MAX_CERT]

event GovernanceChanged:
    previous: indexed(address)
    governance: indexed(address)

gnk: public(IERC20)
governance: public(address)
epoch_count: public(uint256)

specs: HashMap[uint256, EpochSpec]
states: HashMap[uint256, EpochState]
is_aggregator: public(HashMap[uint256, HashMap[address, bool]])
hosts: HashMap[uint256, HashMap[address, Host]]
host_at: public(HashMap[uint256, HashMap[uint32, address]])
key_owner: public(HashMap[uint256, HashMap[bytes32, address]])
rounds: HashMap[uint256, HashMap[uint256, RoundResult]]
round_votes: public(HashMap[uint256, HashMap[uint256, HashMap[address, bytes32]]])
vote_count: HashMap[bytes32, uint256]
claimed: public(HashMap[uint256, HashMap[uint256, HashMap[address, bool]]])
# Round seeds are keyed by keccak256(abi_encode(epoch, round, seed_generation[epoch])): replacing the
# aggregator set bumps the generation, so a commitment its old members never revealed stops counting.
seed_generation: public(HashMap[uint256, uint256])
seeds: HashMap[bytes32, RoundSeed]
commitments: HashMap[bytes32, HashMap[address, bytes32]]
revealed: HashMap[bytes32, HashMap[address, bool]]
challenge_count: public(uint256)
challenges: HashMap[uint256, Challenge]
challenge_voted: public(HashMap[uint256, HashMap[address, bool]])
announcements: HashMap[uint256, HashMap[address, Announcement]]


@deploy
def __init__(gnk: IERC20, governance: address):
    assert governance != empty(address), "registry: zero governance"
    self.gnk = gnk
    self.governance = governance
    log GovernanceChanged(previous=empty(address), governance=governance)


# ---------------------------------------------------------------- governance

@internal
@view
def _only_governance():
    assert msg.sender == self.governance, "registry: only governance"


@internal
@view
def _epoch_exists(epoch: uint256):
    assert epoch != 0 and epoch <= self.epoch_count, "registry: unknown epoch"


@internal
def _set_aggregators(epoch: uint256, aggregators: DynArray[address, MAX_AGGREGATORS], quorum: uint8):
    assert len(aggregators) > 0, "registry: no aggregators"
    assert quorum > 0 and convert(quorum, uint256) <= len(aggregators), "registry: aggregator quorum outside 1..len(aggregators)"
    for old: address in self.specs[epoch].aggregators:
        self.is_aggregator[epoch][old] = False
    for a: address in aggregators:
        assert a != empty(address), "registry: zero aggregator"
        assert not self.is_aggregator[epoch][a], "registry: duplicate aggregator"
        self.is_aggregator[epoch][a] = True
    self.specs[epoch].aggregators = aggregators
    self.specs[epoch].aggregator_quorum = quorum
    self.seed_generation[epoch] += 1
    log AggregatorsSet(epoch=epoch, aggregators=aggregators, quorum=quorum)


@external
def create_epoch(spec: EpochSpec) -> uint256:
    self._only_governance()
    assert spec.model_spec_hash != empty(bytes32), "registry: empty model_spec_hash"
    assert spec.data_manifest_hash != empty(bytes32), "registry: empty data_manifest_hash"
    assert spec.init_checkpoint_hash != empty(bytes32), "registry: empty init_checkpoint_hash"
    assert spec.inner_steps > 0, "registry: inner_steps must be > 0"
    assert spec.batch_size > 0, "registry: batch_size must be > 0"
    assert spec.n_rounds > 0, "registry: n_rounds must be > 0"
    assert spec.round_length > 0, "registry: round_length must be > 0"
    assert spec.signin_window > 0, "registry: signin_window must be > 0"
    assert spec.max_hosts > 0 and spec.max_hosts <= MAX_HOSTS_LIMIT, "registry: max_hosts outside 1..65536"
    p: uint256 = convert(spec.replay_probability_e9, uint256)
    assert p <= E9, "registry: replay probability above 1"
    assert spec.challenge_window > 0, "registry: challenge_window must be > 0"
    assert spec.challenge_bond > 0, "registry: challenge_bond must be > 0"
    assert spec.reward_per_round * E9 <= spec.min_stake * p, "registry: min_stake x replay probability below reward_per_round (stake must be >= reward / p)"
    epoch: uint256 = self.epoch_count + 1
    self.epoch_count = epoch
    self.specs[epoch] = spec
    self.specs[epoch].aggregators = []
    self._set_aggregators(epoch, spec.aggregators, spec.aggregator_quorum)
    signin_end: uint256 = block.timestamp + convert(spec.signin_window, uint256)
    self.states[epoch] = EpochState(
        created_at=block.timestamp, signin_end=signin_end, n_hosts=0, total_stake=0, pool=0, funded=0, latest_round=0
    )
    log EpochCreated(
        epoch=epoch,
        model_spec_hash=spec.model_spec_hash,
        data_manifest_hash=spec.data_manifest_hash,
        init_checkpoint_hash=spec.init_checkpoint_hash,
        n_rounds=spec.n_rounds,
        signin_end=signin_end,
        reward_per_round=spec.reward_per_round,
    )
    return epoch


@external
def fund_epoch(epoch: uint256, amount: uint256):
    self._only_governance()
    self._epoch_exists(epoch)
    assert amount > 0, "registry: zero funding"
    assert extcall self.gnk.transferFrom(msg.sender, self, amount), "registry: transfer failed"
    self.states[epoch].pool += amount
    self.states[epoch].funded += amount
    log EpochFunded(epoch=epoch, funder=msg.sender, amount=amount, pool=self.states[epoch].pool)


@external
def set_aggregators(epoch: uint256, aggregators: DynArray[address, MAX_AGGREGATORS], quorum: uint8):
    self._only_governance()
    self._epoch_exists(epoch)
    assert not self._ended(epoch), "registry: epoch ended"
    self._set_aggregators(epoch, aggregators, quorum)


@external
def slash(epoch: uint256, host: address, amount: uint256, evidence_hash: bytes32):
    self._only_governance()
    self._epoch_exists(epoch)
    h: Host = self.hosts[epoch][host]
    assert h.joined, "registry: not a host of this epoch"
    assert not h.withdrawn, "registry: stake already withdrawn"
    assert amount > 0, "registry: zero slash"
    assert amount <= h.stake - h.slashed, "registry: slash exceeds remaining stake"
    assert evidence_hash != empty(bytes32), "registry: empty evidence_hash"
    self._slash(epoch, host, amount, evidence_hash)
    self.states[epoch].pool += amount


@internal
def _slash(epoch: uint256, host: address, amount: uint256, evidence_hash: bytes32):
    # The caller decides where the slashed amount goes (the pool, or part of it to a challenger).
    self.hosts[epoch][host].slashed += amount
    self.states[epoch].total_stake -= amount
    log Slashed(epoch=epoch, host=host, amount=amount, evidence_hash=evidence_hash)


@external
def set_governance(governance: address):
    self._only_governance()
    assert governance != empty(address), "registry: zero governance"
    log GovernanceChanged(previous=self.governance, governance=governance)
    self.governance = governance


# ---------------------------------------------------------------- hosts

@external
def join(epoch: uint256, stake: uint256, node_key: bytes32):
    self._epoch_exists(epoch)
    st: EpochState = self.states[epoch]
    assert block.timestamp < st.signin_end, "registry: sign-in window closed"
    assert not self.hosts[epoch][msg.sender].joined, "registry: already joined"
    assert stake >= self.specs[epoch].min_stake, "registry: stake below minimum"
    assert st.n_hosts < self.specs[epoch].max_hosts, "registry: epoch full"
    assert node_key != empty(bytes32), "registry: empty node key"
    assert self.key_owner[epoch][node_key] == empty(address), "registry: node key already registered"
    assert extcall self.gnk.transferFrom(msg.sender, self, stake), "registry: transfer failed"
    # The slot is the sign-in order; it never changes (the data assignment is keyed on it).
    slot: uint32 = st.n_hosts
    self.hosts[epoch][msg.sender] = Host(
        joined=True, left=False, withdrawn=False, slot=slot, node_key=node_key, stake=stake, slashed=0,
        open_challenges=0
    )
    self.host_at[epoch][slot] = msg.sender
    self.key_owner[epoch][node_key] = msg.sender
    self.states[epoch].n_hosts = slot + 1
    self.states[epoch].total_stake = st.total_stake + stake
    log HostJoined(epoch=epoch, host=msg.sender, slot=slot, node_key=node_key, stake=stake)


@external
def leave(epoch: uint256):
    self._epoch_exists(epoch)
    h: Host = self.hosts[epoch][msg.sender]
    assert h.joined, "registry: not a host of this epoch"
    assert not h.left, "registry: already left"
    self.hosts[epoch][msg.sender].left = True
    log HostLeft(epoch=epoch, host=msg.sender, slot=h.slot)


@internal
@view
def _end(epoch: uint256) -> uint256:
    # The last round's finalization, or the deadline when the rounds did not all come in time.
    n: uint32 = self.specs[epoch].n_rounds
    st: EpochState = self.states[epoch]
    if st.latest_round == n:
        return self.rounds[epoch][convert(n, uint256)].finalized_at
    return st.signin_end + convert(n, uint256) * convert(self.specs[epoch].round_length, uint256)


@internal
@view
def _ended(epoch: uint256) -> bool:
    return block.timestamp >= self._end(epoch)


@internal
@view
def _unlock(epoch: uint256) -> uint256:
    return self._end(epoch) + convert(self.specs[epoch].challenge_window, uint256)


@external
def withdraw_stake(epoch: uint256):
    self._epoch_exists(epoch)
    h: Host = self.hosts[epoch][msg.sender]
    assert h.joined, "registry: not a host of this epoch"
    assert not h.withdrawn, "registry: stake already withdrawn"
    assert self._ended(epoch), "registry: epoch still running"
    assert block.timestamp >= self._unlock(epoch), "registry: stake locked until the challenge window closes"
    assert h.open_challenges == 0, "registry: stake frozen by an open challenge"
    amount: uint256 = h.stake - h.slashed
    self.hosts[epoch][msg.sender].withdrawn = True
    self.states[epoch].total_stake -= amount
    if amount > 0:
        assert extcall self.gnk.transfer(msg.sender, amount), "registry: transfer failed"
    log StakeWithdrawn(epoch=epoch, host=msg.sender, amount=amount)


# ---------------------------------------------------------------- rounds and rewards

@external
def finalize_round(
    epoch: uint256,
    round: uint256,
    checkpoint_sha256: bytes32,
    rewards_root: bytes32,
    n_contributors: uint32,
    total_reward: uint256,
):
    self._epoch_exists(epoch)
    assert self.is_aggregator[epoch][msg.sender], "registry: not an aggregator of this epoch"
    st: EpochState = self.states[epoch]
    assert block.timestamp >= st.signin_end, "registry: sign-in window still open"
    assert round == convert(st.latest_round, uint256) + 1, "registry: round out of order"
    assert round <= convert(self.specs[epoch].n_rounds, uint256), "registry: round beyond n_rounds"
    assert checkpoint_sha256 != empty(bytes32), "registry: empty checkpoint hash"
    assert total_reward == 0 or rewards_root != empty(bytes32), "registry: rewards without a root"
    assert total_reward <= self.specs[epoch].reward_per_round, "registry: total reward above reward_per_round"
    rs: RoundSeed = self.seeds[self._seed_key(epoch, round)]
    if self.specs[epoch].replay_probability_e9 > 0:
        assert rs.commits > 0 and rs.reveals == rs.commits, "registry: round seed not revealed"
    assert self.round_votes[epoch][round][msg.sender] == empty(bytes32), "registry: aggregator already voted this round"
    result_hash: bytes32 = keccak256(abi_encode(checkpoint_sha256, rewards_root, n_contributors, total_reward))
    self.round_votes[epoch][round][msg.sender] = result_hash
    key: bytes32 = keccak256(abi_encode(epoch, round, result_hash))
    votes: uint256 = self.vote_count[key] + 1
    self.vote_count[key] = votes
    log RoundVote(epoch=epoch, round=round, aggregator=msg.sender, result_hash=result_hash, votes=votes)
    if votes < convert(self.specs[epoch].aggregator_quorum, uint256):
        return
    assert total_reward <= st.pool, "registry: total reward exceeds the epoch's pool"
    self.states[epoch].pool = st.pool - total_reward
    self.states[epoch].latest_round = convert(round, uint32)
    self.rounds[epoch][round] = RoundResult(
        checkpoint_sha256=checkpoint_sha256,
        rewards_root=rewards_root,
        n_contributors=n_contributors,
        total_reward=total_reward,
        claimed=0,
        finalized_at=block.timestamp,
        seed=rs.seed,
    )
    log RoundFinalized(
        epoch=epoch,
        round=round,
        checkpoint_sha256=checkpoint_sha256,
        rewards_root=rewards_root,
        n_contributors=n_contributors,
        total_reward=total_reward,
    )


@internal
@view
def _leaf(epoch: uint256, round: uint256, host: address, amount: uint256) -> bytes32:
    return keccak256(abi_encode(LEAF_TAG, chain.id, self, epoch, round, host, amount))


@internal
@pure
def _verify(leaf: bytes32, proof: DynArray[bytes32, MAX_PROOF], root: bytes32) -> bool:
    node: bytes32 = leaf
    for sibling: bytes32 in proof:
        if convert(node, uint256) < convert(sibling, uint256):
            node = keccak256(concat(node, sibling))
        else:
            node = keccak256(concat(sibling, node))
    return node == root


@external
def claim(epoch: uint256, round: uint256, amount: uint256, proof: DynArray[bytes32, MAX_PROOF]):
    self._epoch_exists(epoch)
    r: RoundResult = self.rounds[epoch][round]
    assert r.finalized_at != 0, "registry: round not finalized"
    assert not self.claimed[epoch][round][msg.sender], "registry: reward already claimed"
    assert amount > 0, "registry: zero claim"
    assert self._verify(self._leaf(epoch, round, msg.sender, amount), proof, r.rewards_root), "registry: invalid Merkle proof"
    # A root is trusted only up to the round's total: a bad tree cannot drain other rounds' funds.
    assert r.claimed + amount <= r.total_reward, "registry: claims exceed the round's total reward"
    self.claimed[epoch][round][msg.sender] = True
    self.rounds[epoch][round].claimed = r.claimed + amount
    assert extcall self.gnk.transfer(msg.sender, amount), "registry: transfer failed"
    log RewardClaimed(epoch=epoch, round=round, host=msg.sender, amount=amount)


# ---------------------------------------------------------------- round seed (commit-reveal)

@internal
@view
def _seed_key(epoch: uint256, round: uint256) -> bytes32:
    return keccak256(abi_encode(epoch, round, self.seed_generation[epoch]))


@internal
@view
def _only_aggregator(epoch: uint256):
    self._epoch_exists(epoch)
    assert self.is_aggregator[epoch][msg.sender], "registry: not an aggregator of this epoch"


@external
def commit_round_seed(epoch: uint256, round: uint256, commitment: bytes32):
    self._only_aggregator(epoch)
    assert round > convert(self.states[epoch].latest_round, uint256), "registry: round already final"
    assert round <= convert(self.specs[epoch].n_rounds, uint256), "registry: round beyond n_rounds"
    assert commitment != empty(bytes32), "registry: empty seed commitment"
    key: bytes32 = self._seed_key(epoch, round)
    assert self.commitments[key][msg.sender] == empty(bytes32), "registry: seed already committed"
    # Once a secret is out, a late commitment would let its author pick the seed after seeing it.
    assert self.seeds[key].reveals == 0, "registry: seed reveals already started"
    self.commitments[key][msg.sender] = commitment
    self.seeds[key].commits += 1
    log SeedCommitted(epoch=epoch, round=round, aggregator=msg.sender, commitment=commitment)


@external
def reveal_round_seed(epoch: uint256, round: uint256, secret: bytes32):
    self._only_aggregator(epoch)
    key: bytes32 = self._seed_key(epoch, round)
    commitment: bytes32 = self.commitments[key][msg.sender]
    assert commitment != empty(bytes32), "registry: no seed commitment"
    assert not self.revealed[key][msg.sender], "registry: seed already revealed"
    assert keccak256(secret) == commitment, "registry: secret does not match the commitment"
    share: uint256 = convert(keccak256(abi_encode(secret, msg.sender)), uint256)
    seed: bytes32 = convert(convert(self.seeds[key].seed, uint256) ^ share, bytes32)
    self.revealed[key][msg.sender] = True
    self.seeds[key].seed = seed
    self.seeds[key].reveals += 1
    log SeedRevealed(epoch=epoch, round=round, aggregator=msg.sender, secret=secret, seed=seed)


# ---------------------------------------------------------------- challenges

@external
def challenge(epoch: uint256, host: address, evidence_hash: bytes32, evidence_uri: String[MAX_URI]) -> uint256:
    self._epoch_exists(epoch)
    h: Host = self.hosts[epoch][host]
    assert h.joined, "registry: not a host of this epoch"
    assert not h.withdrawn, "registry: stake already withdrawn"
    assert h.stake > h.slashed, "registry: no stake left to slash"
    assert block.timestamp < self._unlock(epoch), "registry: challenge window closed"
    assert evidence_hash != empty(bytes32), "registry: empty evidence_hash"
    bond: uint256 = self.specs[epoch].challenge_bond
    assert extcall self.gnk.transferFrom(msg.sender, self, bond), "registry: transfer failed"
    cid: uint256 = self.challenge_count + 1
    self.challenge_count = cid
    self.challenges[cid] = Challenge(
        epoch=epoch, host=host, challenger=msg.sender, bond=bond, evidence_hash=evidence_hash,
        filed_at=block.timestamp, status=OPEN, uphold_votes=0, reject_votes=0, slashed=0
    )
    self.hosts[epoch][host].open_challenges = h.open_challenges + 1
    log ChallengeFiled(
        challenge_id=cid, epoch=epoch, host=host, challenger=msg.sender, bond=bond,
        evidence_hash=evidence_hash, evidence_uri=evidence_uri
    )
    return cid


@internal
@view
def _open_challenge(cid: uint256) -> Challenge:
    c: Challenge = self.challenges[cid]
    assert c.status != 0, "registry: unknown challenge"
    assert c.status == OPEN, "registry: challenge already resolved"
    return c


@external
def resolve_challenge(cid: uint256, uphold: bool):
    self._only_governance()
    self._resolve(cid, self._open_challenge(cid), uphold)


@external
def vote_challenge(cid: uint256, uphold: bool):
    c: Challenge = self._open_challenge(cid)
    assert self.is_aggregator[c.epoch][msg.sender], "registry: not an aggregator of this epoch"
    assert not self.challenge_voted[cid][msg.sender], "registry: aggregator already voted on this challenge"
    self.challenge_voted[cid][msg.sender] = True
    votes: uint8 = 0
    if uphold:
        votes = c.uphold_votes + 1
        self.challenges[cid].uphold_votes = votes
    else:
        votes = c.reject_votes + 1
        self.challenges[cid].reject_votes = votes
    log ChallengeVote(challenge_id=cid, aggregator=msg.sender, uphold=uphold, votes=votes)
    if votes >= self.specs[c.epoch].aggregator_quorum:
        self._resolve(cid, c, uphold)


@internal
def _resolve(cid: uint256, c: Challenge, uphold: bool):
    self.hosts[c.epoch][c.host].open_challenges -= 1
    slashed: uint256 = 0
    to_challenger: uint256 = 0
    to_host: uint256 = 0
    if uphold:
        h: Host = self.hosts[c.epoch][c.host]
        slashed = h.stake - h.slashed
        share: uint256 = slashed * CHALLENGER_SHARE_BPS // BPS
        if slashed > 0:
            self._slash(c.epoch, c.host, slashed, c.evidence_hash)
            self.states[c.epoch].pool += slashed - share
        to_challenger = c.bond + share
        self.challenges[cid].status = UPHELD
        self.challenges[cid].slashed = slashed
        assert extcall self.gnk.transfer(c.challenger, to_challenger), "registry: transfer failed"
    else:
        to_host = c.bond
        self.challenges[cid].status = REJECTED
        assert extcall self.gnk.transfer(c.host, to_host), "registry: transfer failed"
    log ChallengeResolved(
        challenge_id=cid, epoch=c.epoch, host=c.host, upheld=uphold, slashed=slashed,
        to_challenger=to_challenger, to_host=to_host
    )


# ---------------------------------------------------------------- publication

@external
def publish_recipe(epoch: uint256, recipe_json: Bytes[MAX_RECIPE]):
    self._epoch_exists(epoch)
    assert sha256(recipe_json) == self.specs[epoch].model_spec_hash, "registry: recipe does not hash to the epoch's model_spec_hash"
    log RecipePublished(epoch=epoch, publisher=msg.sender, recipe_json=recipe_json)


@external
def announce_aggregator(epoch: uint256, endpoint: String[MAX_URI], tls_cert: Bytes[MAX_CERT]):
    self._only_aggregator(epoch)
    assert len(endpoint) > 0, "registry: empty endpoint"
    assert len(tls_cert) > 0, "registry: empty tls_cert"
    digest: bytes32 = sha256(tls_cert)
    self.announcements[epoch][msg.sender] = Announcement(endpoint=endpoint, tls_cert_sha256=digest)
    log AggregatorAnnounced(epoch=epoch, aggregator=msg.sender, endpoint=endpoint, tls_cert_sha256=digest, tls_cert=tls_cert)


# ---------------------------------------------------------------- reads

@view
@external
def get_spec(epoch: uint256) -> EpochSpec:
    self._epoch_exists(epoch)
    return self.specs[epoch]


@view
@external
def get_state(epoch: uint256) -> EpochState:
    self._epoch_exists(epoch)
    return self.states[epoch]


@view
@external
def has_ended(epoch: uint256) -> bool:
    self._epoch_exists(epoch)
    return self._ended(epoch)


@view
@external
def epoch_end(epoch: uint256) -> uint256:
    self._epoch_exists(epoch)
    return self._end(epoch)


@view
@external
def stake_unlock_time(epoch: uint256) -> uint256:
    self._epoch_exists(epoch)
    return self._unlock(epoch)


@view
@external
def round_seed(epoch: uint256, round: uint256) -> RoundSeed:
    return self.seeds[self._seed_key(epoch, round)]


@view
@external
def seed_commitment(epoch: uint256, round: uint256, aggregator: address) -> bytes32:
    return self.commitments[self._seed_key(epoch, round)][aggregator]


@view
@external
def seed_revealed(epoch: uint256, round: uint256, aggregator: address) -> bool:
    return self.revealed[self._seed_key(epoch, round)][aggregator]


@view
@external
def get_challenge(cid: uint256) -> Challenge:
    return self.challenges[cid]


@view
@external
def announcement(epoch: uint256, aggregator: address) -> Announcement:
    return self.announcements[epoch][aggregator]


@view
@external
def host_info(epoch: uint256, host: address) -> Host:
    return self.hosts[epoch][host]


@view
@external
def hosts_page(epoch: uint256, start: uint256, count: uint256) -> DynArray[address, MAX_PAGE]:
    assert count <= MAX_PAGE, "registry: page larger than 256"
    out: DynArray[address, MAX_PAGE] = []
    n: uint256 = convert(self.states[epoch].n_hosts, uint256)
    for k: uint256 in range(count, bound=MAX_PAGE):
        if start + k >= n:
            break
        out.append(self.host_at[epoch][convert(start + k, uint32)])
    return out


@view
@external
def round_result(epoch: uint256, round: uint256) -> RoundResult:
    return self.rounds[epoch][round]


@view
@external
def reward_leaf(epoch: uint256, round: uint256, host: address, amount: uint256) -> bytes32:
    return self._leaf(epoch, round, host, amount)


@view
@external
def verify_reward(
    epoch: uint256, round: uint256, host: address, amount: uint256, proof: DynArray[bytes32, MAX_PROOF]
) -> bool:
    return self._verify(self._leaf(epoch, round, host, amount), proof, self.rounds[epoch][round].rewards_root)
