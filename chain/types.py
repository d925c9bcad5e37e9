"""Typed views of what the contracts hold (epochs, hosts, rounds, seeds, challenges, proposals,
aggregator endpoints, deployments).

Fixed-point: learning rates, momentum and the replay probability travel on chain as integers in units
of 1e-9 (`*_e9`), so a spec read back equals the spec written as long as each value has at most 9
decimals.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from eth_utils import is_address, to_checksum_address

from chain.errors import DeploymentError, SpecError
from chain.units import NGONKA_PER_GNK

E9 = 10**9
MAX_AGGREGATORS = 16
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
UINT256_MAX = 2**256 - 1
CHALLENGER_SHARE_BPS = 5000  # Registry.CHALLENGER_SHARE_BPS: the challenger's share of an upheld slash
CHALLENGE_STATUSES = {1: "open", 2: "upheld", 3: "rejected"}  # Registry's OPEN, UPHELD, REJECTED


def _to_e9(name: str, value: float) -> int:
    if not math.isfinite(value) or value < 0:
        raise SpecError(name, f"must be a finite number >= 0, got {value!r}")
    scaled = round(value * E9)
    if scaled / E9 != value:
        raise SpecError(name, f"{value!r} has more than 9 decimals (stored on chain in units of 1e-9)")
    if scaled > UINT64_MAX:
        raise SpecError(name, f"{value!r} is too large")
    return scaled


def _hash32(name: str, value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray) or len(value) != 32:
        raise SpecError(name, "must be 32 bytes (a sha256 digest)")
    if value == bytes(32):
        raise SpecError(name, "must not be all zeros")
    return bytes(value)


@dataclass(frozen=True)
class EpochSpec:
    """What governance schedules: the model, data, hyperparameters, timing, hosts and rewards."""

    model_spec_hash: bytes
    model_uri: str
    data_manifest_hash: bytes
    init_checkpoint_hash: bytes
    inner_steps: int
    inner_lr: float
    batch_size: int
    outer_lr: float
    outer_momentum: float
    codec: str
    n_rounds: int
    round_length: int  # seconds
    signin_window: int  # seconds from the epoch's creation
    min_stake: int  # ngonka
    max_hosts: int
    aggregators: tuple[str, ...]
    aggregator_quorum: int = 1
    reward_per_round: int = 0  # ngonka
    replay_probability: float = 1.0  # p: each host's round is replayed (recomputed) with probability p
    challenge_window: int = 3600  # seconds after the epoch's end: stake stays locked, challenges allowed
    challenge_bond: int = NGONKA_PER_GNK  # ngonka a challenger escrows

    def __post_init__(self) -> None:
        for name in ("model_spec_hash", "data_manifest_hash", "init_checkpoint_hash"):
            _hash32(name, getattr(self, name))
        for name in ("inner_lr", "outer_lr", "outer_momentum"):
            _to_e9(name, getattr(self, name))
        for name, hi in (
            ("inner_steps", UINT32_MAX),
            ("batch_size", UINT32_MAX),
            ("n_rounds", UINT32_MAX),
            ("round_length", UINT64_MAX),
            ("signin_window", UINT64_MAX),
            ("max_hosts", 65536),
            ("challenge_window", UINT64_MAX),
            ("challenge_bond", UINT256_MAX),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
                raise SpecError(name, f"must be an integer in 1..{hi}, got {value!r}")
        for name in ("min_stake", "reward_per_round"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SpecError(name, f"must be an integer >= 0 (ngonka), got {value!r}")
        if _to_e9("replay_probability", self.replay_probability) > E9:
            raise SpecError("replay_probability", f"must be in [0, 1], got {self.replay_probability!r}")
        self._check_stake_rule()
        if len(self.model_uri.encode()) > 256:
            raise SpecError("model_uri", "longer than 256 bytes")
        if not self.codec or len(self.codec.encode()) > 64:
            raise SpecError("codec", "must be 1..64 bytes")
        if not 1 <= len(self.aggregators) <= MAX_AGGREGATORS:
            raise SpecError("aggregators", f"needs 1..{MAX_AGGREGATORS} addresses")
        bad = [a for a in self.aggregators if not is_address(a)]
        if bad:
            raise SpecError("aggregators", f"not an address: {bad[0]!r}")
        checksummed = tuple(to_checksum_address(a) for a in self.aggregators)
        if len(set(checksummed)) != len(checksummed):
            raise SpecError("aggregators", "lists an address twice")
        object.__setattr__(self, "aggregators", checksummed)
        if not 1 <= self.aggregator_quorum <= len(self.aggregators):
            raise SpecError("aggregator_quorum", f"must be in 1..{len(self.aggregators)} (number of aggregators)")

    def _check_stake_rule(self) -> None:
        # A cheat is caught with probability p per round and loses its whole stake: stake * p must
        # cover the largest reward a round pays, or cheating pays on average (Registry.create_epoch).
        p_e9 = _to_e9("replay_probability", self.replay_probability)
        if self.reward_per_round * E9 > self.min_stake * p_e9:
            need = "impossible with replay_probability 0" if p_e9 == 0 else f">= {-(-self.reward_per_round * E9 // p_e9)} ngonka"
            raise SpecError(
                "min_stake",
                f"min_stake x replay_probability is below reward_per_round (stake must be >= reward / p: {need})",
            )

    def to_abi(self) -> tuple[Any, ...]:
        """The Registry's EpochSpec struct as a tuple, in the contract's field order."""
        return (
            self.model_spec_hash,
            self.model_uri,
            self.data_manifest_hash,
            self.init_checkpoint_hash,
            self.inner_steps,
            _to_e9("inner_lr", self.inner_lr),
            self.batch_size,
            _to_e9("outer_lr", self.outer_lr),
            _to_e9("outer_momentum", self.outer_momentum),
            self.codec,
            self.n_rounds,
            self.round_length,
            self.signin_window,
            self.min_stake,
            self.max_hosts,
            list(self.aggregators),
            self.aggregator_quorum,
            self.reward_per_round,
            _to_e9("replay_probability", self.replay_probability),
            self.challenge_window,
            self.challenge_bond,
        )

    @classmethod
    def from_abi(cls, t: tuple[Any, ...]) -> EpochSpec:
        return cls(
            model_spec_hash=bytes(t[0]),
            model_uri=t[1],
            data_manifest_hash=bytes(t[2]),
            init_checkpoint_hash=bytes(t[3]),
            inner_steps=t[4],
            inner_lr=t[5] / E9,
            batch_size=t[6],
            outer_lr=t[7] / E9,
            outer_momentum=t[8] / E9,
            codec=t[9],
            n_rounds=t[10],
            round_length=t[11],
            signin_window=t[12],
            min_stake=t[13],
            max_hosts=t[14],
            aggregators=tuple(t[15]),
            aggregator_quorum=t[16],
            reward_per_round=t[17],
            replay_probability=t[18] / E9,
            challenge_window=t[19],
            challenge_bond=t[20],
        )


@dataclass(frozen=True)
class EpochState:
    """Registry.get_state(epoch), by name."""

    created_at: int
    signin_end: int
    n_hosts: int
    total_stake: int
    pool: int  # funded ngonka not yet allotted to a round (slashed stake lands here too)
    funded: int
    latest_round: int

    @classmethod
    def from_abi(cls, t: tuple[Any, ...]) -> EpochState:
        return cls(
            created_at=t[0], signin_end=t[1], n_hosts=t[2], total_stake=t[3], pool=t[4], funded=t[5],
            latest_round=t[6],
        )


@dataclass(frozen=True, kw_only=True)
class EpochInfo(EpochState):
    """An epoch as `ChainClient.get_epoch` reads it: its state, its spec, whether it has ended."""

    epoch: int
    spec: EpochSpec
    ended: bool


@dataclass(frozen=True)
class HostInfo:
    joined: bool
    left: bool
    withdrawn: bool
    slot: int
    node_key: bytes
    stake: int
    slashed: int
    open_challenges: int  # while > 0 the stake cannot be withdrawn

    @classmethod
    def from_abi(cls, t: tuple[Any, ...]) -> HostInfo:
        return cls(
            joined=t[0], left=t[1], withdrawn=t[2], slot=t[3], node_key=bytes(t[4]), stake=t[5], slashed=t[6],
            open_challenges=t[7],
        )


@dataclass(frozen=True)
class RoundResult:
    epoch: int
    round: int
    checkpoint_sha256: bytes
    rewards_root: bytes
    n_contributors: int
    total_reward: int
    claimed: int  # ngonka claimed so far; total_reward - claimed stays in the contract, accounted
    finalized_at: int
    seed: bytes  # the round seed when it was finalized (zero when the epoch's p is 0 and none was revealed)

    @classmethod
    def from_abi(cls, t: tuple[Any, ...], *, epoch: int, round_: int) -> RoundResult:
        """From Registry.round_result's tuple (the round is the call's key, not part of the result)."""
        return cls(
            epoch=epoch, round=round_, checkpoint_sha256=bytes(t[0]), rewards_root=bytes(t[1]),
            n_contributors=t[2], total_reward=t[3], claimed=t[4], finalized_at=t[5], seed=bytes(t[6]),
        )

    @property
    def finalized(self) -> bool:
        return self.finalized_at != 0

    @property
    def unclaimed(self) -> int:
        return self.total_reward - self.claimed


@dataclass(frozen=True)
class RoundSeed:
    """A round's commit-reveal seed so far (chain.seed has the formula)."""

    epoch: int
    round: int
    seed: bytes
    commits: int
    reveals: int

    @classmethod
    def from_abi(cls, t: tuple[Any, ...], *, epoch: int, round_: int) -> RoundSeed:
        """From Registry.round_seed's tuple."""
        return cls(epoch=epoch, round=round_, seed=bytes(t[0]), commits=t[1], reveals=t[2])

    @property
    def complete(self) -> bool:
        """Every commitment revealed: the seed can no longer change, and finalize_round accepts it."""
        return self.commits > 0 and self.reveals == self.commits


@dataclass(frozen=True)
class Challenge:
    """A bonded challenge against a host's stake (Registry.challenge)."""

    challenge_id: int
    epoch: int
    host: str
    challenger: str
    bond: int  # ngonka escrowed by the challenger
    evidence_hash: bytes
    evidence_uri: str  # from the ChallengeFiled event ("" when the log is not available)
    filed_at: int
    status: str  # open | upheld | rejected
    uphold_votes: int
    reject_votes: int
    slashed: int  # ngonka slashed when upheld

    @classmethod
    def from_abi(cls, t: tuple[Any, ...], *, challenge_id: int, evidence_uri: str) -> Challenge:
        """From Registry.get_challenge's tuple of a filed challenge (status != 0); the URI lives only in its event."""
        return cls(
            challenge_id=challenge_id, epoch=t[0], host=to_checksum_address(t[1]), challenger=to_checksum_address(t[2]),
            bond=t[3], evidence_hash=bytes(t[4]), evidence_uri=evidence_uri,
            filed_at=t[5], status=CHALLENGE_STATUSES[t[6]], uphold_votes=t[7], reject_votes=t[8], slashed=t[9],
        )

    @staticmethod
    def filed(t: tuple[Any, ...]) -> bool:
        """Whether Registry.get_challenge's tuple is a filed challenge (an unknown id reads as status 0)."""
        return bool(t[6] != 0)


@dataclass(frozen=True)
class AggregatorEndpoint:
    """Where an epoch's aggregator serves, and the TLS certificate to pin, as it announced on chain."""

    address: str
    endpoint: str
    tls_cert_pem: bytes
    tls_cert_sha256: bytes


@dataclass(frozen=True)
class Action:
    """One call a governance proposal makes when executed."""

    target: str
    calldata: bytes
    label: str = ""


@dataclass(frozen=True)
class Proposal:
    proposal_id: int
    proposer: str
    actions_hash: bytes
    vote_end: int
    quorum: int
    for_votes: int
    against_votes: int
    executed: bool
    state: str  # voting | no-quorum | defeated | passed | executed

    @classmethod
    def from_abi(cls, t: tuple[Any, ...], *, proposal_id: int, state: str) -> Proposal:
        """From Governor.proposals' tuple; the state is Governor.state's separate read."""
        return cls(
            proposal_id=proposal_id, proposer=t[0], actions_hash=bytes(t[1]), vote_end=t[2], quorum=t[3],
            for_votes=t[4], against_votes=t[5], executed=t[6], state=state,
        )


@dataclass(frozen=True)
class Deployment:
    """Where the contracts live; saved as JSON so later commands and processes find them."""

    chain_id: int
    gnk: str
    governor: str
    registry: str
    governance: str  # the address holding the registry's governance role (an EOA or the Governor)
    deployer: str
    block: int = 0  # deployment block: where log queries start
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str]) -> None:
        target = Path(path)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        tmp.replace(target)  # atomic: a reader never sees half a file

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Deployment:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DeploymentError(f"{path}: no such deployment file (run `gonka-node chain deploy`)") from None
        except json.JSONDecodeError as exc:
            raise DeploymentError(f"{path}: not JSON ({exc})") from None
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names - set(data) if n not in ("block", "extra"))
        if missing:
            raise DeploymentError(f"{path}: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(data) - names)
        if unknown:
            raise DeploymentError(f"{path}: unknown field(s) {', '.join(unknown)}")
        for name in ("gnk", "governor", "registry", "governance", "deployer"):
            if not is_address(data[name]):
                raise DeploymentError(f"{path}: field '{name}' is not an address: {data[name]!r}")
        return cls(**data)
