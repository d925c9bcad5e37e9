"""The aggregator's view of the chain: who may submit in an epoch, and finalizing a round once.

`chain.ChainClient` is synchronous (web3); every call here runs in one worker thread, serialized by a
lock, so the event loop keeps streaming other hosts' payloads meanwhile. Host records are cached per
epoch: a joined host stays joined for the epoch (slashing is re-checked when the cache entry expires),
an unknown host is re-asked after a short while so that a late sign-in is seen quickly. The round's first
tick reads every signed-in host's record in one pass (`warm`), so that uploads authenticate from the
cache instead of each waiting for its own read behind the others (with an in-process chain, 64 such reads
during uploads cost ~0.25 s of each upload's time to its receipt in scripts/bench_aggregator.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from eth_utils import to_checksum_address

from chain.seed import seed_commitment
from chain.types import AggregatorEndpoint, EpochInfo, HostInfo, RoundResult, RoundSeed

T = TypeVar("T")


class ChainReader(Protocol):
    """The part of `chain.ChainClient` the aggregator uses."""

    @property
    def address(self) -> str: ...

    def host_info(self, epoch: int, host: str) -> HostInfo: ...

    def hosts(self, epoch: int) -> list[str]: ...

    def get_epoch(self, epoch: int) -> EpochInfo: ...

    def chain_time(self) -> int: ...

    def round_result(self, epoch: int, round_: int) -> RoundResult: ...

    def finalize_round(
        self,
        epoch: int,
        round_: int,
        checkpoint_sha256: bytes,
        rewards_root: bytes,
        n_contributors: int,
        total_reward: int,
    ) -> Any: ...

    def round_vote(self, epoch: int, round_: int, aggregator: str | None = None) -> bytes: ...

    def seed_commitment(self, epoch: int, round_: int, aggregator: str | None = None) -> bytes: ...

    def commit_round_seed(self, epoch: int, round_: int, commitment: bytes) -> Any: ...

    def seed_revealed(self, epoch: int, round_: int, aggregator: str | None = None) -> bool: ...

    def reveal_round_seed(self, epoch: int, round_: int, secret: bytes) -> Any: ...

    def round_seed(self, epoch: int, round_: int) -> RoundSeed: ...

    def aggregator_endpoints(self, epoch: int) -> list[AggregatorEndpoint]: ...

    def announce_aggregator(self, epoch: int, endpoint: str, tls_cert_pem: bytes) -> Any: ...

    def published_recipe(self, epoch: int) -> bytes | None: ...

    def publish_recipe(self, epoch: int, recipe_json: bytes) -> Any: ...


@dataclass(frozen=True)
class Member:
    """A host allowed to submit: signed in to the epoch, not left, not slashed."""

    address: bytes
    slot: int
    node_key: bytes


class ChainView:
    def __init__(self, chain: ChainReader, member_ttl_s: float = 60.0, unknown_ttl_s: float = 2.0) -> None:
        self.chain = chain
        self._lock = threading.Lock()
        self._members: dict[tuple[int, bytes], tuple[float, Member | None]] = {}
        self._hosts: dict[int, tuple[float, list[str]]] = {}
        self._member_ttl, self._unknown_ttl = member_ttl_s, unknown_ttl_s

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    async def acall(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(self.call, fn, *args)

    async def member(self, epoch: int, host: bytes) -> Member | None:
        now = time.monotonic()
        cached = self._members.get((epoch, host))
        if cached is not None and cached[0] > now:
            return cached[1]
        info = await self.acall(self.chain.host_info, epoch, to_checksum_address(host))
        ok = info.joined and not info.left and not info.slashed and len(bytes(info.node_key)) == 32
        member = Member(address=host, slot=int(info.slot), node_key=bytes(info.node_key)) if ok else None
        self._members[(epoch, host)] = (now + (self._member_ttl if ok else self._unknown_ttl), member)
        return member

    @property
    def address(self) -> str:
        """This aggregator's account."""
        return self.chain.address

    def as_account(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(account, *args)` under the lock, for helpers that act as this aggregator's account (the
        slashing rule's `challenge_all` files and votes through it)."""
        with self._lock:
            return fn(self.chain, *args)

    def aggregator_endpoints(self, epoch: int) -> list[AggregatorEndpoint]:
        return self.call(self.chain.aggregator_endpoints, epoch)

    def announce_aggregator(self, epoch: int, endpoint: str, tls_cert_pem: bytes) -> Any:
        return self.call(self.chain.announce_aggregator, epoch, endpoint, tls_cert_pem)

    def published_recipe(self, epoch: int) -> bytes | None:
        return self.call(self.chain.published_recipe, epoch)

    def publish_recipe(self, epoch: int, recipe_json: bytes) -> Any:
        return self.call(self.chain.publish_recipe, epoch, recipe_json)

    def round_result(self, epoch: int, round_: int) -> RoundResult:
        return self.call(self.chain.round_result, epoch, round_)

    def round_vote(self, epoch: int, round_: int) -> bytes:
        """This account's vote on the round's result (zero: none)."""
        return self.call(self.chain.round_vote, epoch, round_)

    def finalize_round(
        self, epoch: int, round_: int, checkpoint_sha256: bytes, rewards_root: bytes, n_contributors: int,
        total_reward: int,
    ) -> Any:
        return self.call(
            self.chain.finalize_round, epoch, round_, checkpoint_sha256, rewards_root, n_contributors, total_reward
        )

    async def hosts(self, epoch: int) -> list[str]:
        """The epoch's signed-in hosts, cached for `unknown_ttl_s` (every host's GetOpenRound shows the count)."""
        now = time.monotonic()
        cached = self._hosts.get(epoch)
        if cached is not None and cached[0] > now:
            return cached[1]
        hosts = await self.acall(self.chain.hosts, epoch)
        self._hosts[epoch] = (now + self._unknown_ttl, hosts)
        return hosts

    async def warm(self, epoch: int) -> int:
        """`warm_now` off the event loop."""
        return await asyncio.to_thread(self.warm_now, epoch)

    def warm_now(self, epoch: int) -> int:
        """Read every signed-in host's record in one pass into the member cache, as each host's first
        upload would (same expiry), so that a round's uploads find their host cached instead of each
        waiting for its own chain read; returns how many hosts may submit."""
        members = self.members(epoch)
        expires = time.monotonic() + self._member_ttl
        for m in members:
            self._members[(epoch, m.address)] = (expires, m)
        return len(members)

    async def signin_end(self, epoch: int) -> int:
        return int((await self.acall(self.chain.get_epoch, epoch)).signin_end)

    async def chain_time(self) -> int:
        """The time of the chain's latest block."""
        return await self.acall(self.chain.chain_time)

    def commit_seed(self, epoch: int, round_: int, secret: bytes) -> None:
        """Commit keccak256(secret) for the round, unless this account already did (a restart)."""
        commitment = seed_commitment(secret)
        with self._lock:
            have = self.chain.seed_commitment(epoch, round_)
            if have == commitment:
                return
            if have != bytes(32):
                raise RuntimeError(
                    f"round {epoch}/{round_}: this aggregator committed {have.hex()} on chain, not the "
                    f"commitment of its stored secret {commitment.hex()}"
                )
            self.chain.commit_round_seed(epoch, round_, commitment)

    def reveal_seed(self, epoch: int, round_: int, secret: bytes) -> RoundSeed:
        """Reveal the round's secret unless already revealed; the round's seed as the chain has it now
        (complete once every committed aggregator has revealed)."""
        with self._lock:
            if not self.chain.seed_revealed(epoch, round_):
                self.chain.reveal_round_seed(epoch, round_, secret)
            return self.chain.round_seed(epoch, round_)

    def members(self, epoch: int) -> list[Member]:
        """Every host that may submit in `epoch` (synchronous: used when closing a round)."""
        out = []
        for addr in self.call(self.chain.hosts, epoch):
            info = self.call(self.chain.host_info, epoch, addr)
            if info.joined and not info.left and not info.slashed:
                out.append(
                    Member(
                        address=bytes.fromhex(addr[2:]), slot=int(info.slot), node_key=bytes(info.node_key)
                    )
                )
        return out
