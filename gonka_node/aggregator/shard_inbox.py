"""The signed messages a shard holds for its epoch, its own and the other shards', and the rules a
received one must pass before it is held (docs/PROTOCOL.md "The Shard service").

One file per slot (epoch, round, kind, sender, key) under `root/<epoch>/<round>/`: the signed header,
its signature and the body, written atomically (a reader sees a whole message or none), so what a shard
accepted survives its crash, and the signature stays with the bytes as evidence. A shard's own
messages are its outbox: an `.ack-<peer>` file beside one says that peer has it (or refused it for
good); a restarted shard sends the rest again.

A received message is refused, with a `ShardReason` and nothing written, when it names another chain,
registry, epoch or shard count, a sender outside the epoch, a round the receiver closed or one more than
a round ahead of it, a body over the limit; when its signature does not verify under the sender's node
key; when holding it would put its sender over its quota for the round (`shard_quota`: slots and bytes
held or still streaming, reserved before a body byte is read, so concurrent Puts cannot race past it);
when it is a payload blob of a host this shard holds no payload of in that round (an honest shard sends
only the picked hosts' blobs, and the verifier uses only those of hosts every shard holds, so a peer
cannot hold a blob under a key of its choosing: at most one per host that uploaded here);
when its body runs past or falls short of the signed length or does not hash to the signed digest
(`shard_receive` streams it to a temporary file beside its slot), or names another round or shard; when
a verdict comes from anyone but the verifier (shard 0) or differs from the verdict held; and when its
sequence is not above the one held for its slot (a replay of an older message). A message equal to
the one held is answered as held and changes nothing.

A signed REPORT or VERDICT whose body digest differs from the one held for its slot is, before anything
else happens to it, recorded as evidence against its sender (`shard_evidence`, in `evidence_dir`): an
honest shard signs one report per round, the verifier one verdict.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gonka_node.aggregator.shard import BASE_KEY, FragmentReport, Verdict, payload_host
from gonka_node.aggregator.shard_evidence import ONE_PER_SLOT, SignedPart, equivocation, write_evidence
from gonka_node.aggregator.shard_quota import QuotaRule, over_quota
from gonka_node.aggregator.store import RoundRow
from gonka_node.core.envelope import SIGNATURE_BYTES, EnvelopeError
from gonka_node.core.shard_envelope import SHARD_MESSAGE_BYTES, ShardKind, ShardMessage
from training.durable import atomic_write, durable_replace

log = logging.getLogger(__name__)
VERIFIER = 0  # the shard that decides the verdict
CLOSED = ("finalized", "skipped")
DEFAULT_MAX_BODY_BYTES = 4 << 30  # a blob is a host's fragment payload or a base fragment
HoldsPayload = Callable[[int, int, bytes], bool]  # (epoch, round, host) -> whether this shard stored its payload
# (epoch, round, host) -> whether the round's replay pick selects the host, by the round's seed as
# complete at this shard (None: not complete here yet)
Sampled = Callable[[int, int, bytes], bool | None]


class ShardReason(enum.Enum):
    """Why a message was refused (`gonka.v1.ShardRefusal` without its `SHARD_` prefix)."""

    MALFORMED = 1
    WRONG_CHAIN = 2
    WRONG_EPOCH = 3
    UNKNOWN_SHARD = 4
    BAD_SIGNATURE = 5
    STALE_ROUND = 6
    FUTURE_ROUND = 7
    REPLAYED = 8
    CONFLICT = 9
    NOT_PERMITTED = 10
    OVERSIZE = 11
    DIGEST_MISMATCH = 12
    QUOTA = 13
    UNHELD_HOST = 14
    SEED_PENDING = 15
    NOT_SAMPLED = 16


class ShardRefused(Exception):
    """A message refused for `reason`; nothing was stored."""

    def __init__(self, reason: ShardReason, message: str) -> None:
        super().__init__(f"{reason.name}: {message}")
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class ShardSelf:
    """Who this shard is: what every message it accepts must name."""

    chain_id: int
    registry: bytes
    epoch: int
    index: int
    count: int


@dataclass(frozen=True)
class Signed:
    header: ShardMessage
    signature: bytes
    body: bytes

    def to_bytes(self) -> bytes:
        return self.header.canonical_bytes() + self.signature + self.body

    @classmethod
    def from_bytes(cls, data: bytes) -> Signed:
        at = SHARD_MESSAGE_BYTES
        return cls(ShardMessage.from_canonical(data[:at]), data[at : at + SIGNATURE_BYTES], data[at + SIGNATURE_BYTES :])


def body_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


class Inbox:
    """The messages of one shard's epoch on disk, and the acceptance rules (module docstring)."""

    def __init__(
        self, root: Path, me: ShardSelf, rounds: Callable[[int], Sequence[RoundRow]],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, quota: QuotaRule | None = None,
        holds_payload: HoldsPayload | None = None, sampled: Sampled | None = None,
    ) -> None:
        """`quota(sender, round)`: what one peer may have this shard hold for a round (`shard_quota.
        ShardBudget`); None: no quota beyond `max_body_bytes` per message (in-process tests only).
        `holds_payload(epoch, round, host)`: whether this shard stored a payload of `host` in the round
        (the store); None: a payload blob of any host is taken (in-process tests only). `sampled(epoch,
        round, host)`: whether the round's replay picks `host` (`shard.sampled_by_seed`); None: any host
        this shard holds a payload of (in-process tests only)."""
        self.root, self.me, self.rounds, self.max_body_bytes, self.quota = root, me, rounds, max_body_bytes, quota
        self.holds_payload, self.sampled = holds_payload, sampled
        self._lock = threading.Lock()  # one check-and-store at a time (the server's threads, the close)
        # Per (epoch, round, sender): the bodies held (file name -> bytes; read from disk once, then kept
        # by `settle`) and those still streaming (token -> file name, bytes): what its quota counts.
        self._held: dict[tuple[int, int, int], dict[str, int]] = {}
        self._pending: dict[tuple[int, int, int], dict[int, tuple[str, int]]] = {}
        self._tokens = itertools.count()
        # A body a crashed process was receiving: never held (the rename is the store), so only disk.
        for stale in root.glob("*/*/.*.tmp"):
            stale.unlink(missing_ok=True)

    # ---- reading -----------------------------------------------------------------------------------

    def _dir(self, epoch: int, round_: int) -> Path:
        return self.root / str(epoch) / str(round_)

    def path(self, h: ShardMessage) -> Path:
        suffix = f"-{h.key}" if h.key else ""
        return self._dir(h.epoch, h.round) / f"{h.kind.name.lower()}-{h.sender}{suffix}.msg"

    def held(self, epoch: int, round_: int, kind: ShardKind) -> list[Signed]:
        """Every message of `kind` held for the round, by sender index."""
        found = sorted(self._dir(epoch, round_).glob(f"{kind.name.lower()}-*.msg"))
        return sorted((Signed.from_bytes(p.read_bytes()) for p in found), key=lambda s: s.header.sender)

    def get(self, h: ShardMessage) -> Signed | None:
        path = self.path(h)
        return Signed.from_bytes(path.read_bytes()) if path.exists() else None

    def files(self, epoch: int, round_: int, kind: ShardKind) -> list[Path]:
        """The files of every message of `kind` held for the round (read one only when needed)."""
        return sorted(self._dir(epoch, round_).glob(f"{kind.name.lower()}-*.msg"))

    @property
    def evidence_dir(self) -> Path:
        """Where contradictions between signed messages are recorded (`shard_evidence`), beside the inbox."""
        return self.root.parent / "shard-evidence"

    # ---- the outbox ----------------------------------------------------------------------------------

    def keep(self, s: Signed) -> None:
        """Hold this shard's own message (its outbox), durably, before it is sent anywhere."""
        with self._lock:
            self._write(s)

    def outbox(self, epoch: int, round_: int) -> list[Path]:
        """The files of this shard's own messages of the round (read one only when a peer lacks it)."""
        return sorted(self._dir(epoch, round_).glob(f"*-{self.me.index}.msg")) + sorted(
            self._dir(epoch, round_).glob(f"blob-{self.me.index}-*.msg"))

    def acked(self, s: Signed, peer: int) -> bool:
        return acked_at(self.path(s.header), peer)

    def ack(self, s: Signed, peer: int) -> None:
        atomic_write(self.path(s.header).with_suffix(f".ack-{peer}"), lambda t: t.write_text(str(s.header.sequence)))

    def _write(self, s: Signed) -> None:
        path = self.path(s.header)
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(path.stem + ".ack-*"):  # a newer message: no peer has it yet
            old.unlink()
        atomic_write(path, lambda t: t.write_bytes(s.to_bytes()))

    # ---- receiving -----------------------------------------------------------------------------------

    def admit(self, h: ShardMessage, signature: bytes, key: bytes | None) -> None:
        """Everything checkable before the body is read: `screen`, then the signature under `key`."""
        self.screen(h)
        if key is None:
            raise ShardRefused(ShardReason.UNKNOWN_SHARD, f"no node key known for shard {h.sender}: it has not "
                               f"announced its endpoint and certificate for epoch {self.me.epoch} on chain, or is unreachable")
        if not h.verify(signature, key):
            raise ShardRefused(ShardReason.BAD_SIGNATURE, f"the signature does not verify under shard {h.sender}'s node key")
        self._note_equivocation(h, signature, key)

    def _note_equivocation(self, h: ShardMessage, signature: bytes, key: bytes) -> None:
        """Record a second signed body for a slot that holds one honest shards sign once (whatever
        becomes of the message: a verdict is then refused, a newer report replaces the held one). The
        two signed headers prove it (each commits to its body's digest): no body is read or kept, and
        one record per slot is enough, so a peer signing many cannot fill the disk."""
        path, marker = self.path(h), self.evidence_dir / f"{self.path(h).stem}-{h.epoch}-{h.round}.noted"
        if h.kind not in ONE_PER_SLOT or not path.exists() or marker.exists():
            return
        with open(path, "rb") as f:
            held = Signed.from_bytes(f.read(SHARD_MESSAGE_BYTES + SIGNATURE_BYTES))
        ev = equivocation(SignedPart(held.header, held.signature, None), SignedPart(h, signature, None), key)
        if ev is not None:
            kept = write_evidence(self.evidence_dir, ev)
            marker.write_text(kept.name)
            log.warning("%s: evidence kept in %s", ev.detail, kept)

    def screen(self, h: ShardMessage) -> None:
        """Who, where, when and how large: the checks that need no key."""
        me = self.me
        if (h.chain_id, bytes(h.registry)) != (me.chain_id, me.registry):
            raise ShardRefused(ShardReason.WRONG_CHAIN, f"the message is for chain {h.chain_id}, registry "
                               f"0x{bytes(h.registry).hex()}; this shard serves chain {me.chain_id}, 0x{me.registry.hex()}")
        if (h.epoch, h.count) != (me.epoch, me.count):
            raise ShardRefused(ShardReason.WRONG_EPOCH, f"the message is for epoch {h.epoch} with {h.count} shards; "
                               f"this shard serves epoch {me.epoch} with {me.count}")
        if h.sender == me.index:
            raise ShardRefused(ShardReason.UNKNOWN_SHARD, f"the message claims to come from shard {h.sender}, this shard")
        self._check_round(h)
        self._check_size(h)
        if h.kind == ShardKind.VERDICT and h.sender != VERIFIER:
            raise ShardRefused(ShardReason.NOT_PERMITTED, f"shard {h.sender} sent a verdict; only shard {VERIFIER} decides")

    def _check_round(self, h: ShardMessage) -> None:
        rows = {r.round: r for r in self.rounds(h.epoch)}
        row, latest = rows.get(h.round), max(rows, default=0)
        if h.round < 1 or (row is not None and row.state in CLOSED):
            raise ShardRefused(ShardReason.STALE_ROUND, f"round {h.epoch}/{h.round} is closed at shard {self.me.index}")
        if h.round > latest + 1:
            raise ShardRefused(ShardReason.FUTURE_ROUND, f"round {h.epoch}/{h.round} is more than one round ahead of "
                               f"shard {self.me.index} (at round {latest})")

    def _check_size(self, h: ShardMessage) -> None:
        limit = 32 if h.kind == ShardKind.HASH else self.max_body_bytes
        if h.body_length > limit or (h.kind == ShardKind.HASH and h.body_length != 32):
            raise ShardRefused(ShardReason.OVERSIZE, f"a {h.kind.name} body of {h.body_length} bytes "
                               f"(this shard takes {'exactly 32' if h.kind == ShardKind.HASH else f'at most {limit}'})")

    # ---- an admitted message's body: reserved, streamed (`shard_receive.Incoming`), settled -------------

    def reserve(self, h: ShardMessage) -> int:
        """Count an admitted message against its sender's quota for the round before its body is read;
        returns the token that `settle` or `release` gives back (ShardRefused OVERSIZE or QUOTA)."""
        with self._lock:  # with `settle`: a body moves from streaming to held without being missed
            self._forget_closed(h.epoch)
            self._check_payload_host(h)
            pending = self._pending.setdefault((h.epoch, h.round, h.sender), {})
            if self.quota is not None:
                self._check_quota(h, pending)
            token = next(self._tokens)
            pending[token] = (self.path(h).name, h.body_length)
        return token

    def _check_payload_host(self, h: ShardMessage) -> None:
        """A payload blob is taken only of a host this shard holds a payload of and the round's replay
        picks: what an honest shard sends (`shard_close.put_sampled`), so a peer can make this shard
        hold no more blobs than an honest round's. The pick needs the round's seed, complete only once
        every aggregator revealed, this one included; before, the blob is refused for a retry."""
        if h.kind != ShardKind.BLOB or h.key == BASE_KEY:
            return
        host, where = payload_host(h.key), f"round {h.epoch}/{h.round}"
        if self.holds_payload is not None and not self.holds_payload(h.epoch, h.round, host):
            raise ShardRefused(ShardReason.UNHELD_HOST, f"shard {self.me.index} holds no payload of 0x{host.hex()} "
                               f"in {where}: its blob is not needed here (yet)")
        picked = None if self.sampled is None else self.sampled(h.epoch, h.round, host)
        if self.sampled is not None and picked is None:
            raise ShardRefused(ShardReason.SEED_PENDING, f"{where}'s seed is not complete at shard {self.me.index} "
                               f"yet: which hosts its replay picks is not known here")
        if picked is False:
            raise ShardRefused(ShardReason.NOT_SAMPLED, f"0x{host.hex()} is not among the hosts {where}'s replay "
                               f"picks: no shard sends its blob")

    def _check_quota(self, h: ShardMessage, pending: dict[int, tuple[str, int]]) -> None:
        assert self.quota is not None
        q = self.quota(h.sender, h.round)
        if h.body_length > q.largest(h):
            raise ShardRefused(ShardReason.OVERSIZE, f"a {h.kind.name} body of {h.body_length} bytes; shard "
                               f"{h.sender}'s is at most {q.largest(h)} in round {h.epoch}/{h.round}")
        why = over_quota(q, h, self.path(h).name, self._held_bodies(h), pending)
        if why:
            raise ShardRefused(ShardReason.QUOTA, why)

    def _forget_closed(self, epoch: int) -> None:
        """Drop the counts of closed rounds: nothing more is taken for them (`screen`), so a long-running
        shard keeps counts for its open rounds only."""
        closed = {r.round for r in self.rounds(epoch) if r.state in CLOSED}
        for key in [k for k in self._held if k[0] == epoch and k[1] in closed]:
            del self._held[key]

    def _held_bodies(self, h: ShardMessage) -> dict[str, int]:
        """The body length of each message held from `h`'s sender for its round, by file name."""
        key = (h.epoch, h.round, h.sender)
        if key not in self._held:
            folder, prefix = self._dir(h.epoch, h.round), SHARD_MESSAGE_BYTES + SIGNATURE_BYTES
            found = [*folder.glob(f"*-{h.sender}.msg"), *folder.glob(f"blob-{h.sender}-*.msg")]
            self._held[key] = {p.name: p.stat().st_size - prefix for p in found}
        return self._held[key]

    def release(self, h: ShardMessage, token: int) -> None:
        """Give back a reservation whose body was refused or broke off (nothing was held)."""
        with self._lock:
            self._unreserve(h, token)

    def _unreserve(self, h: ShardMessage, token: int) -> None:
        key = (h.epoch, h.round, h.sender)
        pending = self._pending.get(key, {})
        pending.pop(token, None)
        if not pending:
            self._pending.pop(key, None)

    def settle(self, h: ShardMessage, tmp: Path, token: int) -> bool:
        """Move a checked body's file `tmp` (beside its slot, header and signature first) into the slot;
        False when exactly this message was held already (`tmp` is left to the caller to remove)."""
        with self._lock:
            try:
                path = self.path(h)
                old = _header_at(path)
                if old is not None and not _replaces(old, h):
                    return False
                for ack in path.parent.glob(path.stem + ".ack-*"):
                    ack.unlink()
                durable_replace(tmp, path)  # `tmp` was fsync'd before the lock: this is the rename
                if self.quota is not None:
                    self._held_bodies(h)[path.name] = h.body_length
                return True
            finally:
                self._unreserve(h, token)


def acked_at(path: Path, peer: int) -> bool:
    """Whether `peer` acknowledged the message in `path` (or refused it for good)."""
    return path.with_suffix(f".ack-{peer}").exists()


def kind_at(path: Path) -> ShardKind:
    """The kind of the message in `path`, from its name."""
    return ShardKind[path.name.split("-")[0].upper()]


def _header_at(path: Path) -> ShardMessage | None:
    """The signed header of the message held in `path` (its body, maybe large, is not read)."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return ShardMessage.from_canonical(f.read(SHARD_MESSAGE_BYTES))


def _replaces(o: ShardMessage, n: ShardMessage) -> bool:
    """Whether `n` may replace the `o` message held for its slot (False: it is the same message)."""
    if (o.sequence, bytes(o.body_sha256)) == (n.sequence, bytes(n.body_sha256)):
        return False
    if n.kind == ShardKind.VERDICT and bytes(o.body_sha256) != bytes(n.body_sha256):
        raise ShardRefused(ShardReason.CONFLICT, f"round {n.epoch}/{n.round} already has another verdict: the first stands")
    if n.sequence <= o.sequence:
        raise ShardRefused(ShardReason.REPLAYED, f"sequence {n.sequence} is not above the {o.sequence} held for "
                           f"shard {n.sender}'s {n.kind.name} of round {n.epoch}/{n.round}")
    return True


def check_body(h: ShardMessage, body: bytes) -> None:
    """A report or verdict must be about the round and shard its signed header names."""
    try:
        if h.kind == ShardKind.REPORT:
            r = FragmentReport.from_json(body.decode("utf-8"))
            named = (r.epoch, r.round, r.index, r.count)
        elif h.kind == ShardKind.VERDICT:
            v = Verdict.from_json(body.decode("utf-8"))
            named = (v.epoch, v.round, h.sender, h.count)
        else:
            return
    except (ValueError, KeyError, TypeError, IndexError, json.JSONDecodeError, EnvelopeError) as exc:
        raise ShardRefused(ShardReason.MALFORMED, f"the {h.kind.name} body does not parse: {exc}") from None
    if named != (h.epoch, h.round, h.sender, h.count):
        raise ShardRefused(ShardReason.NOT_PERMITTED, f"the {h.kind.name} body is about round {named[0]}/{named[1]}, "
                           f"shard {named[2]} of {named[3]}; its header says {h.epoch}/{h.round}, shard {h.sender} of {h.count}")
