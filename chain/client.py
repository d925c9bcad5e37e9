"""`ChainClient`: deploys, reads and transacts with the GNK, Governor and Registry contracts.

The constructor stores; `connect()` opens the backend. Every transaction goes through one `TxSender`
(nonce, gas, signing, bounded retries, receipt, uniform `ChainRevert`). Reads return the dataclasses of
`chain.types`. All amounts are integers in ngonka (1 GNK = 10**9 ngonka). What the Registry keeps only
in events (recipes, TLS certificates, challenge URIs) is read from logs from the deployment block on
and checked against what it keeps in storage (hashes).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from eth_account.signers.local import LocalAccount
from eth_typing import HexStr
from eth_utils import to_checksum_address
from web3 import Web3
from web3.contract import Contract
from web3.logs import DISCARD
from web3.types import EventData, TxReceipt, Wei

from chain.artifacts import load_artifact
from chain.backends import ChainBackend
from chain.errors import BeaconNotReady, ChainError, DeploymentError
from chain.tx import TxSender, translate_call
from chain.types import (
    Action,
    AggregatorEndpoint,
    Challenge,
    Deployment,
    EpochInfo,
    EpochSpec,
    EpochState,
    HostInfo,
    Proposal,
    RoundResult,
    RoundSeed,
)

HOSTS_PAGE = 256
MAX_URI = 256  # Registry: endpoint and evidence_uri, UTF-8 bytes
MAX_RECIPE = 8192
MAX_CERT = 4096


def _bytes32(name: str, value: bytes | str) -> bytes:
    raw = bytes.fromhex(value.removeprefix("0x")) if isinstance(value, str) else bytes(value)
    if len(raw) != 32:
        raise ValueError(f"{name} must be 32 bytes, got {len(raw)}")
    return raw


def _bounded(name: str, value: bytes, limit: int) -> bytes:
    if len(value) > limit:
        raise ValueError(f"{name} is {len(value)} bytes; the Registry takes at most {limit}")
    return value


class ChainClient:
    def __init__(
        self,
        backend: ChainBackend,
        account: LocalAccount,
        deployment: Deployment | None = None,
        *,
        receipt_timeout_s: float = 120.0,
    ) -> None:
        self.backend = backend
        self.account = account
        self.deployment = deployment
        self.receipt_timeout_s = receipt_timeout_s
        self._w3: Web3 | None = None
        self._sender: TxSender | None = None
        self._contracts: dict[str, Contract] = {}

    # ------------------------------------------------------------------ connection

    def connect(self) -> ChainClient:
        if self._w3 is None:
            self._w3 = self.backend.connect()
            self._sender = TxSender(self._w3, self.account, receipt_timeout_s=self.receipt_timeout_s)
            if self.deployment is not None:
                self._bind(self.deployment)
        return self

    def with_account(self, account: LocalAccount) -> ChainClient:
        """Another signer on the same connection and deployment (its own nonce lock)."""
        other = ChainClient(self.backend, account, self.deployment, receipt_timeout_s=self.receipt_timeout_s)
        return other.connect()

    @property
    def w3(self) -> Web3:
        if self._w3 is None:
            raise ChainError("ChainClient is not connected; call connect() first")
        return self._w3

    @property
    def sender(self) -> TxSender:
        self.w3  # noqa: B018 (raises if not connected)
        assert self._sender is not None
        return self._sender

    @property
    def address(self) -> str:
        return str(self.account.address)

    @property
    def chain_id(self) -> int:
        return self.sender.chain_id

    def _bind(self, deployment: Deployment) -> None:
        chain_id = int(self.w3.eth.chain_id)
        if deployment.chain_id != chain_id:
            raise DeploymentError(f"deployment is for chain id {deployment.chain_id}, the node runs {chain_id}")
        for name, address in (("GNK", deployment.gnk), ("Governor", deployment.governor), ("Registry", deployment.registry)):
            if not self.w3.eth.get_code(to_checksum_address(address)):
                raise DeploymentError(f"no {name} contract at {address} on chain {chain_id}")
            self._contracts[name] = self.w3.eth.contract(address=to_checksum_address(address), abi=load_artifact(name).abi)
        self.deployment = deployment

    def _contract(self, name: str) -> Contract:
        if name not in self._contracts:
            raise DeploymentError("no deployment bound: deploy_all() or pass a Deployment")
        return self._contracts[name]

    @property
    def gnk(self) -> Contract:
        return self._contract("GNK")

    @property
    def governor(self) -> Contract:
        return self._contract("Governor")

    @property
    def registry(self) -> Contract:
        return self._contract("Registry")

    # ------------------------------------------------------------------ plumbing

    def transact(self, contract: Contract, fn: str, *args: Any) -> TxReceipt:
        return self.send(self.encode(contract, fn, *args))

    def send(self, action: Action) -> TxReceipt:
        """Send one call from this account: the same `Action` a governance proposal would carry."""
        data = HexStr("0x" + action.calldata.hex())
        return self.sender.send({"to": to_checksum_address(action.target), "data": data})

    def read(self, contract: Contract, fn: str, *args: Any) -> Any:
        return translate_call(lambda: getattr(contract.functions, fn)(*args).call())

    def encode(self, contract: Contract, fn: str, *args: Any) -> Action:
        return Action(contract.address, bytes.fromhex(contract.encode_abi(fn, args=list(args))[2:]), fn)

    def _deploy(self, name: str, *args: Any) -> str:
        artifact = load_artifact(name)
        factory = self.w3.eth.contract(abi=artifact.abi, bytecode=artifact.bytecode)
        receipt = self.sender.send({"data": factory.constructor(*args).data_in_transaction})
        return str(receipt["contractAddress"])

    # ------------------------------------------------------------------ deployment

    def deploy_all(
        self,
        *,
        use_governor: bool = False,
        voting_period_s: int = 3600,
        quorum_bps: int = 2000,
        proposal_threshold: int = 0,
        initial_mint: Mapping[str, int] | None = None,
    ) -> Deployment:
        """Deploy GNK, Governor and Registry; mint `initial_mint`; return (and bind) the addresses.

        With `use_governor` the Governor ends up holding both the Registry's governance role and GNK
        minting, so scheduling, funding, slashing and minting all go through a vote. Otherwise this
        account (an EOA) holds both roles: the devnet setting.
        """
        self.connect()
        block = int(self.w3.eth.block_number)
        gnk = self._deploy("GNK", self.address)
        governor = self._deploy("Governor", gnk, voting_period_s, quorum_bps, proposal_threshold)
        governance = governor if use_governor else self.address
        registry = self._deploy("Registry", gnk, governance)
        deployment = Deployment(
            chain_id=self.chain_id, gnk=gnk, governor=governor, registry=registry,
            governance=governance, deployer=self.address, block=block,
        )
        self._bind(deployment)
        for receiver, amount in (initial_mint or {}).items():
            self.mint(receiver, amount)
        if use_governor:
            self.transact(self.gnk, "set_minter", governor)
        return deployment

    # ------------------------------------------------------------------ GNK

    def mint(self, receiver: str, amount: int) -> TxReceipt:
        return self.send(self.action_mint(receiver, amount))

    def approve(self, spender: str, amount: int) -> TxReceipt:
        return self.transact(self.gnk, "approve", to_checksum_address(spender), amount)

    def transfer(self, receiver: str, amount: int) -> TxReceipt:
        return self.transact(self.gnk, "transfer", to_checksum_address(receiver), amount)

    def transfer_eth(self, receiver: str, wei: int) -> TxReceipt:
        """Send native currency (what pays for gas) to `receiver`."""
        return self.sender.send({"to": to_checksum_address(receiver), "value": Wei(wei)})

    def gnk_balance(self, owner: str | None = None) -> int:
        return int(self.read(self.gnk, "balanceOf", to_checksum_address(owner or self.address)))

    def eth_balance(self, owner: str | None = None) -> int:
        """The account's native balance in wei: what pays for gas."""
        return int(self.w3.eth.get_balance(to_checksum_address(owner or self.address)))

    def max_fee_per_gas(self) -> int:
        """The most a transaction of this client pays per gas now (wei): what a balance must cover."""
        return self.sender.max_fee_per_gas()

    def allowance(self, owner: str, spender: str) -> int:
        return int(self.read(self.gnk, "allowance", to_checksum_address(owner), to_checksum_address(spender)))

    def _ensure_allowance(self, spender: str, amount: int) -> None:
        if self.allowance(self.address, spender) < amount:
            self.approve(spender, amount)

    # ------------------------------------------------------------------ epochs (governance role)

    def create_epoch(self, spec: EpochSpec) -> int:
        return self.epochs_created(self.send(self.action_create_epoch(spec)))[0]

    def epochs_created(self, receipt: TxReceipt) -> list[int]:
        events = self.registry.events.EpochCreated().process_receipt(receipt, errors=DISCARD)
        return [int(e["args"]["epoch"]) for e in events]

    def fund_epoch(self, epoch: int, amount: int) -> TxReceipt:
        self._ensure_allowance(self.registry.address, amount)  # a proposal approves unconditionally instead
        return self.send(self.action_fund_epoch(epoch, amount)[-1])

    def set_aggregators(self, epoch: int, aggregators: Sequence[str], quorum: int = 1) -> TxReceipt:
        return self.transact(
            self.registry, "set_aggregators", epoch, [to_checksum_address(a) for a in aggregators], quorum
        )

    def slash(self, epoch: int, host: str, amount: int, evidence_hash: bytes | str) -> TxReceipt:
        return self.send(self.action_slash(epoch, host, amount, evidence_hash))

    def epoch_count(self) -> int:
        return int(self.read(self.registry, "epoch_count"))

    def get_epoch(self, epoch: int) -> EpochInfo:
        spec = EpochSpec.from_abi(self.read(self.registry, "get_spec", epoch))
        state = dataclasses.asdict(self.epoch_state(epoch))
        return EpochInfo(epoch=epoch, spec=spec, ended=bool(self.read(self.registry, "has_ended", epoch)), **state)

    def epoch_state(self, epoch: int) -> EpochState:
        return EpochState.from_abi(self.read(self.registry, "get_state", epoch))

    # ------------------------------------------------------------------ hosts

    def join(self, epoch: int, stake: int, node_key: bytes | str) -> int:
        """Sign in with `stake` ngonka (approved here if needed) and the ed25519 node key; returns the slot."""
        key = _bytes32("node_key", node_key)
        self._ensure_allowance(self.registry.address, stake)
        self.transact(self.registry, "join", epoch, stake, key)
        return self.host_info(epoch, self.address).slot

    def leave(self, epoch: int) -> TxReceipt:
        return self.transact(self.registry, "leave", epoch)

    def withdraw_stake(self, epoch: int) -> int:
        receipt = self.transact(self.registry, "withdraw_stake", epoch)
        events = self.registry.events.StakeWithdrawn().process_receipt(receipt, errors=DISCARD)
        return int(events[0]["args"]["amount"])

    def epoch_end(self, epoch: int) -> int:
        """When the epoch ended or will end: the last round's finalization, else the rounds' deadline."""
        return int(self.read(self.registry, "epoch_end", epoch))

    def stake_unlock_time(self, epoch: int) -> int:
        """epoch_end + challenge_window: from then on stake without an open challenge can be withdrawn."""
        return int(self.read(self.registry, "stake_unlock_time", epoch))

    def host_info(self, epoch: int, host: str) -> HostInfo:
        return HostInfo.from_abi(self.read(self.registry, "host_info", epoch, to_checksum_address(host)))

    def key_owner(self, epoch: int, node_key: bytes | str) -> str | None:
        """The host that registered `node_key` in `epoch`, or None (a node key signs in once per epoch)."""
        owner = self.read(self.registry, "key_owner", epoch, _bytes32("node_key", node_key))
        return None if int(owner, 16) == 0 else to_checksum_address(owner)

    def hosts(self, epoch: int) -> list[str]:
        """Hosts of `epoch` in slot order (slot i is element i), including those that left."""
        n = self.get_epoch(epoch).n_hosts
        out: list[str] = []
        while len(out) < n:
            out.extend(self.read(self.registry, "hosts_page", epoch, len(out), HOSTS_PAGE))
        return [to_checksum_address(a) for a in out]

    # ------------------------------------------------------------------ rounds and rewards

    def finalize_round(
        self,
        epoch: int,
        round_: int,
        checkpoint_sha256: bytes | str,
        rewards_root: bytes | str,
        n_contributors: int,
        total_reward: int,
    ) -> TxReceipt:
        return self.transact(
            self.registry, "finalize_round", epoch, round_,
            _bytes32("checkpoint_sha256", checkpoint_sha256), _bytes32("rewards_root", rewards_root),
            n_contributors, total_reward,
        )

    def round_result(self, epoch: int, round_: int) -> RoundResult:
        return RoundResult.from_abi(self.read(self.registry, "round_result", epoch, round_), epoch=epoch, round_=round_)

    def round_vote(self, epoch: int, round_: int, aggregator: str | None = None) -> bytes:
        """The result hash `aggregator` (default: this account) voted for the round; 32 zero bytes if none."""
        return bytes(self.read(self.registry, "round_votes", epoch, round_, aggregator or self.address))

    def chain_time(self) -> int:
        """The latest block's timestamp: the clock the contracts' windows are measured on."""
        return int(self.w3.eth.get_block("latest")["timestamp"])

    def signin_beacon(self, epoch: int) -> bytes:
        """The hash of the first block stamped at or after the epoch's sign-in deadline: randomness that
        exists only once sign-in has closed (no join can be in that block or later), readable by anyone.
        Raises BeaconNotReady while no such block has been mined."""
        end = self.get_epoch(epoch).signin_end
        latest = self.w3.eth.get_block("latest")
        if int(latest["timestamp"]) < end:
            raise BeaconNotReady(f"epoch {epoch}: sign-in closes at {end}, the chain's latest block is stamped "
                                 f"{latest['timestamp']}; the assignment's randomness does not exist yet")
        low, high = 0, int(latest["number"])  # timestamps never decrease: bisect for the first one >= end
        while low < high:
            mid = (low + high) // 2
            if int(self.w3.eth.get_block(mid)["timestamp"]) >= end:
                high = mid
            else:
                low = mid + 1
        return bytes(self.w3.eth.get_block(low)["hash"])

    def latest_round(self, epoch: int) -> int:
        return int(self.epoch_state(epoch).latest_round)

    def claim(self, epoch: int, round_: int, amount: int, proof: Sequence[bytes]) -> TxReceipt:
        return self.transact(self.registry, "claim", epoch, round_, amount, [bytes(p) for p in proof])

    def claims(self, epoch: int, host: str | None = None) -> dict[int, int]:
        """What `host` (default: this account) has claimed in `epoch`: round -> ngonka (RewardClaimed events)."""
        events = self._logs("RewardClaimed", {"epoch": epoch, "host": to_checksum_address(host or self.address)})
        return {int(e["args"]["round"]): int(e["args"]["amount"]) for e in events}

    def claimed(self, epoch: int, round_: int, host: str | None = None) -> bool:
        return bool(self.read(self.registry, "claimed", epoch, round_, to_checksum_address(host or self.address)))

    # ------------------------------------------------------------------ round seed (aggregators)

    def commit_round_seed(self, epoch: int, round_: int, commitment: bytes | str) -> TxReceipt:
        """Commit keccak256(secret) for the round (chain.seed.seed_commitment), when the round opens."""
        return self.transact(self.registry, "commit_round_seed", epoch, round_, _bytes32("commitment", commitment))

    def reveal_round_seed(self, epoch: int, round_: int, secret: bytes | str) -> TxReceipt:
        """Reveal the committed secret once the round's submissions are fixed; mixes it into the seed."""
        return self.transact(self.registry, "reveal_round_seed", epoch, round_, _bytes32("secret", secret))

    def round_seed(self, epoch: int, round_: int) -> RoundSeed:
        return RoundSeed.from_abi(self.read(self.registry, "round_seed", epoch, round_), epoch=epoch, round_=round_)

    def seed_commitment(self, epoch: int, round_: int, aggregator: str | None = None) -> bytes:
        """`aggregator`'s (default: this account) commitment for the round; 32 zero bytes if none."""
        who = to_checksum_address(aggregator or self.address)
        return bytes(self.read(self.registry, "seed_commitment", epoch, round_, who))

    def seed_revealed(self, epoch: int, round_: int, aggregator: str | None = None) -> bool:
        who = to_checksum_address(aggregator or self.address)
        return bool(self.read(self.registry, "seed_revealed", epoch, round_, who))

    # ------------------------------------------------------------------ challenges

    def challenge(self, epoch: int, host: str, evidence_hash: bytes | str, evidence_uri: str = "") -> int:
        """File a challenge against `host`'s stake, escrowing the epoch's challenge_bond; returns its id."""
        evidence = _bytes32("evidence_hash", evidence_hash)
        _bounded("evidence_uri", evidence_uri.encode(), MAX_URI)
        self._ensure_allowance(self.registry.address, self.get_epoch(epoch).spec.challenge_bond)
        receipt = self.transact(self.registry, "challenge", epoch, to_checksum_address(host), evidence, evidence_uri)
        events = self.registry.events.ChallengeFiled().process_receipt(receipt, errors=DISCARD)
        return int(events[0]["args"]["challenge_id"])

    def resolve_challenge(self, challenge_id: int, uphold: bool) -> TxReceipt:
        """Governance's ruling (an EOA governance; with a Governor use action_resolve_challenge)."""
        return self.send(self.action_resolve_challenge(challenge_id, uphold))

    def vote_challenge(self, challenge_id: int, uphold: bool) -> TxReceipt:
        """An aggregator's vote; aggregator_quorum votes either way resolve the challenge."""
        return self.transact(self.registry, "vote_challenge", challenge_id, uphold)

    def get_challenge(self, challenge_id: int) -> Challenge:
        t = self.read(self.registry, "get_challenge", challenge_id)
        if not Challenge.filed(t):
            raise ChainError(f"no challenge {challenge_id} on this Registry")
        logs = self._logs("ChallengeFiled", {"challenge_id": challenge_id})
        uri = logs[0]["args"]["evidence_uri"] if logs else ""
        return Challenge.from_abi(t, challenge_id=challenge_id, evidence_uri=uri)

    def challenges(self, epoch: int) -> list[Challenge]:
        """Every challenge filed in `epoch`, oldest first."""
        ids = [int(e["args"]["challenge_id"]) for e in self._logs("ChallengeFiled", {"epoch": epoch})]
        return [self.get_challenge(i) for i in ids]

    # ------------------------------------------------------------------ publication

    def publish_recipe(self, epoch: int, recipe_json: bytes) -> TxReceipt:
        """Publish the recipe's canonical JSON; the Registry refuses bytes not hashing to model_spec_hash."""
        return self.transact(self.registry, "publish_recipe", epoch, _bounded("recipe_json", bytes(recipe_json), MAX_RECIPE))

    def published_recipe(self, epoch: int) -> bytes | None:
        """The epoch's recipe as published on chain (checked again against model_spec_hash), or None."""
        want = self.get_epoch(epoch).spec.model_spec_hash
        for event in self._logs("RecipePublished", {"epoch": epoch}):
            recipe = bytes(event["args"]["recipe_json"])
            if hashlib.sha256(recipe).digest() == want:
                return recipe
        return None

    def announce_aggregator(self, epoch: int, endpoint: str, tls_cert_pem: bytes) -> TxReceipt:
        """Announce (or replace) where this aggregator serves the epoch and its TLS certificate (PEM)."""
        _bounded("endpoint", endpoint.encode(), MAX_URI)
        cert = _bounded("tls_cert_pem", bytes(tls_cert_pem), MAX_CERT)
        return self.transact(self.registry, "announce_aggregator", epoch, endpoint, cert)

    def aggregator_endpoints(self, epoch: int) -> list[AggregatorEndpoint]:
        """The current aggregators' latest announcements, in the spec's order; silent ones are omitted."""
        out: list[AggregatorEndpoint] = []
        for aggregator in self.get_epoch(epoch).spec.aggregators:
            endpoint = self._announcement(epoch, aggregator)
            if endpoint is not None:
                out.append(endpoint)
        return out

    def _announcement(self, epoch: int, aggregator: str) -> AggregatorEndpoint | None:
        endpoint, digest = self.read(self.registry, "announcement", epoch, aggregator)
        if bytes(digest) == bytes(32):
            return None
        logs = self._logs("AggregatorAnnounced", {"epoch": epoch, "aggregator": aggregator})
        latest = logs[-1]["args"] if logs else None
        if latest is None or hashlib.sha256(latest["tls_cert"]).digest() != bytes(digest) or latest["endpoint"] != endpoint:
            # Storage is the truth; a node that pruned or lost the log cannot give the certificate to pin.
            raise ChainError(f"aggregator {aggregator}: no announcement in the logs matches the one in storage")
        return AggregatorEndpoint(
            address=aggregator, endpoint=endpoint, tls_cert_pem=bytes(latest["tls_cert"]), tls_cert_sha256=bytes(digest)
        )

    def _logs(self, event: str, filters: Mapping[str, Any]) -> list[EventData]:
        start = self.deployment.block if self.deployment else 0
        logs = getattr(self.registry.events, event)().get_logs(from_block=start, argument_filters=dict(filters))
        return sorted(logs, key=lambda e: (e["blockNumber"], e["logIndex"]))

    # ------------------------------------------------------------------ governance (Governor contract)

    def gov_deposit(self, amount: int) -> TxReceipt:
        self._ensure_allowance(self.governor.address, amount)
        return self.transact(self.governor, "deposit", amount)

    def gov_withdraw(self, amount: int) -> TxReceipt:
        return self.transact(self.governor, "withdraw", amount)

    def propose(self, actions: Sequence[Action], description: str) -> int:
        receipt = self.transact(
            self.governor, "propose", [a.target for a in actions], [a.calldata for a in actions], description
        )
        events = self.governor.events.ProposalCreated().process_receipt(receipt, errors=DISCARD)
        return int(events[0]["args"]["proposal_id"])

    def vote(self, proposal_id: int, support: bool) -> TxReceipt:
        return self.transact(self.governor, "vote", proposal_id, support)

    def proposal_actions(self, proposal_id: int) -> list[Action]:
        """The actions of a proposal, read back from its ProposalCreated event."""
        start = self.deployment.block if self.deployment else 0
        logs = self.governor.events.ProposalCreated().get_logs(
            from_block=start, argument_filters={"proposal_id": proposal_id}
        )
        if not logs:
            raise ChainError(f"no ProposalCreated event for proposal {proposal_id}")
        args = logs[0]["args"]
        return [Action(to_checksum_address(t), bytes(c)) for t, c in zip(args["targets"], args["calldatas"], strict=True)]

    def execute(self, proposal_id: int, actions: Sequence[Action] | None = None) -> TxReceipt:
        actions = list(actions) if actions is not None else self.proposal_actions(proposal_id)
        return self.transact(
            self.governor, "execute", proposal_id, [a.target for a in actions], [a.calldata for a in actions]
        )

    def proposal_count(self) -> int:
        return int(self.read(self.governor, "proposal_count"))

    def proposal_description(self, proposal_id: int) -> str:
        """The description a proposal was made with (from its ProposalCreated event; "" if the log is gone)."""
        start = self.deployment.block if self.deployment else 0
        logs = self.governor.events.ProposalCreated().get_logs(
            from_block=start, argument_filters={"proposal_id": proposal_id}
        )
        return str(logs[0]["args"]["description"]) if logs else ""

    def escrow(self, voter: str | None = None) -> int:
        """GNK `voter` (default: this account) has escrowed in the Governor to vote with."""
        return int(self.read(self.governor, "escrow", to_checksum_address(voter or self.address)))

    def treasury(self) -> int:
        """The Governor's GNK beyond the voters' escrow: what executed proposals may spend."""
        return self.gnk_balance(self.governor.address) - int(self.read(self.governor, "total_escrow"))

    def proposal(self, proposal_id: int) -> Proposal:
        state = self.read(self.governor, "state", proposal_id)
        return Proposal.from_abi(self.read(self.governor, "proposals", proposal_id), proposal_id=proposal_id, state=state)

    # Actions a proposal can carry (governance through a vote).

    def action_create_epoch(self, spec: EpochSpec) -> Action:
        return self.encode(self.registry, "create_epoch", spec.to_abi())

    def action_fund_epoch(self, epoch: int, amount: int) -> list[Action]:
        """Funding from the Governor's treasury: approve the registry, then fund (two calls)."""
        return [
            self.encode(self.gnk, "approve", self.registry.address, amount),
            self.encode(self.registry, "fund_epoch", epoch, amount),
        ]

    def action_slash(self, epoch: int, host: str, amount: int, evidence_hash: bytes | str) -> Action:
        evidence = _bytes32("evidence_hash", evidence_hash)
        return self.encode(self.registry, "slash", epoch, to_checksum_address(host), amount, evidence)

    def action_resolve_challenge(self, challenge_id: int, uphold: bool) -> Action:
        return self.encode(self.registry, "resolve_challenge", challenge_id, uphold)

    def action_mint(self, receiver: str, amount: int) -> Action:
        return self.encode(self.gnk, "mint", to_checksum_address(receiver), amount)


def round_result_hash(checkpoint_sha256: bytes, rewards_root: bytes, n_contributors: int, total_reward: int) -> bytes:
    """What `Registry.finalize_round` records as an aggregator's vote: keccak256(abi.encode(...))."""
    from eth_abi import encode
    from eth_utils import keccak

    return keccak(
        encode(["bytes32", "bytes32", "uint32", "uint256"], [checkpoint_sha256, rewards_root, n_contributors, total_reward])
    )
