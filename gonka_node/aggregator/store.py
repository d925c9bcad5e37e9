"""Durable aggregator state: SQLite (WAL, synchronous=FULL) plus fsync'd payload files.

The rule (invariant 3): a submission is on disk — file renamed into place and fsync'd, row committed —
before its receipt leaves the process. A row is stored `pending` (received, its decode-time checks not
yet run), then becomes `checked` (norm and sketch filled in) or `failed` (the refusal recorded): only
checked rows are a round's submissions (`submissions`), and a restarted aggregator finds the pending
ones (`pending_submissions`) and checks them (aggregator/deferred.py). Round finalization is recorded as an *intent* before the chain
transaction is sent, so a restarted aggregator checks the chain instead of finalizing twice.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from training.durable import durable_replace

PENDING, CHECKED, FAILED = "pending", "checked", "failed"  # submissions.check_state
LIVE = f"check_state != '{FAILED}'"  # a stored payload that counts: the host may not send another


SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    state TEXT NOT NULL,               -- open | finalizing | finalized | skipped
    base_sha256 BLOB NOT NULL,
    deadline_ms INTEGER NOT NULL,
    extensions INTEGER NOT NULL DEFAULT 0,
    opened_ms INTEGER NOT NULL,
    checkpoint_sha256 BLOB,
    rewards_root BLOB,
    total_reward INTEGER,
    aggregation TEXT,
    finalize_tx BLOB,
    closed_ms INTEGER,
    seed_secret BLOB,                  -- committed on chain when the round opened, revealed at close
    heldout_loss_base REAL,            -- the base model's loss on the round's held-out windows
    heldout_loss REAL,                 -- the new checkpoint's, on the same windows
    round_seed BLOB,                   -- the round's complete commit-reveal seed, once every aggregator revealed
    seed_complete_ms INTEGER,          -- when this aggregator first saw it complete: the openings' clock starts
    shard_decision TEXT,               -- a shard's close, kept before its report is signed: ShardDecision JSON
    PRIMARY KEY (epoch, round)
);
CREATE TABLE IF NOT EXISTS submissions (
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    host BLOB NOT NULL,
    payload_sha256 BLOB NOT NULL,
    payload_length INTEGER NOT NULL,
    tokens_trained INTEGER NOT NULL,
    timestamp_ms INTEGER NOT NULL,
    signature BLOB NOT NULL,
    received_ms INTEGER NOT NULL,
    norm REAL NOT NULL,
    sketch BLOB NOT NULL,
    path TEXT NOT NULL,
    started_ms INTEGER NOT NULL DEFAULT 0,  -- when its signed header arrived (orders copies)
    check_state TEXT NOT NULL DEFAULT 'checked',  -- pending | checked | failed (decode-time checks)
    check_reason INTEGER NOT NULL DEFAULT 0,      -- failed: the RejectReason number
    check_message TEXT NOT NULL DEFAULT '',       -- failed: what the host is told
    residual_root BLOB NOT NULL DEFAULT X'0000000000000000000000000000000000000000000000000000000000000000',  -- signed: the host's residual after the round
    PRIMARY KEY (epoch, round, host)
);
CREATE TABLE IF NOT EXISTS contributions (
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    host BLOB NOT NULL,
    score REAL NOT NULL,
    reward INTEGER NOT NULL,
    aggregated INTEGER NOT NULL,
    reasons TEXT NOT NULL,             -- JSON list of strings
    PRIMARY KEY (epoch, round, host)
);
"""


OPENINGS_SCHEMA = """
CREATE TABLE IF NOT EXISTS openings (   -- a challenged top-k submission's residual opening, as received
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    host BLOB NOT NULL,
    previous_root BLOB NOT NULL,
    residual_root BLOB NOT NULL,
    body_sha256 BLOB NOT NULL,
    body_length INTEGER NOT NULL,
    timestamp_ms INTEGER NOT NULL,
    signature BLOB NOT NULL,
    received_ms INTEGER NOT NULL,
    path TEXT NOT NULL,
    PRIMARY KEY (epoch, round, host)
);
"""


# A round's states once its close computed and durably recorded its result (the intent; its files are
# written before it). The chain may record the result before this aggregator marks it finalized, and a
# host that saw the chain asks in that window: what is served from here is checked against the chain by
# whoever receives it, so the intent is served as soon as it exists.
DECIDED = ("finalizing", "finalized", "skipping", "skipped")
STEPPED = ("finalizing", "finalized")  # decided with an outer step: an update and a checkpoint exist


@dataclass(frozen=True)
class RoundRow:
    epoch: int
    round: int
    state: str
    base_sha256: bytes
    deadline_ms: int
    extensions: int
    opened_ms: int
    checkpoint_sha256: bytes | None = None
    rewards_root: bytes | None = None
    total_reward: int | None = None
    aggregation: str | None = None
    finalize_tx: bytes | None = None
    closed_ms: int | None = None
    seed_secret: bytes | None = None  # this aggregator's round-seed secret (chain.seed)
    heldout_loss_base: float | None = None
    heldout_loss: float | None = None
    round_seed: bytes | None = None  # the round's complete seed (chain), stored when first seen complete
    seed_complete_ms: int | None = None  # when that was: a top-k round's openings are due from here
    shard_decision: str | None = None  # a shard's close decided (`ShardDecision` JSON): closed for uploads


@dataclass(frozen=True)
class ShardDecision:
    """What a shard's close of a round covers, decided once and kept with the round before its one report
    is signed: whether it reports a skip, and the hosts (increasing address) whose fragments it reports.
    A restarted shard closes as decided rather than recompute, so it never signs a second report."""

    skip: bool
    hosts: tuple[bytes, ...]

    def to_json(self) -> str:
        return json.dumps({"skip": self.skip, "hosts": [h.hex() for h in self.hosts]}, sort_keys=True)

    @classmethod
    def of(cls, row: RoundRow) -> ShardDecision | None:
        """The decision kept with `row` (None: none yet)."""
        if row.shard_decision is None:
            return None
        kept = json.loads(row.shard_decision)
        return cls(bool(kept["skip"]), tuple(bytes.fromhex(h) for h in kept["hosts"]))


@dataclass(frozen=True)
class OpeningRow:
    """A stored opening of a challenged submission: the signed record's fields, its signature and file."""

    epoch: int
    round: int
    host: bytes
    previous_root: bytes
    residual_root: bytes
    body_sha256: bytes
    body_length: int
    timestamp_ms: int
    signature: bytes
    received_ms: int
    path: str


@dataclass(frozen=True)
class SubmissionRow:
    epoch: int
    round: int
    host: bytes
    payload_sha256: bytes
    payload_length: int
    tokens_trained: int
    timestamp_ms: int
    signature: bytes
    received_ms: int
    norm: float
    sketch: bytes
    path: str
    started_ms: int = 0  # when the signed header arrived: the order in which copies are judged
    check_state: str = CHECKED  # PENDING until its decode-time checks ran (norm and sketch then filled in)
    check_reason: int = 0  # FAILED: the RejectReason number
    check_message: str = ""  # FAILED: what the host is told
    # The root of the host's residual after the round, as it signed it (envelope layout 2). 32 zero bytes:
    # a row stored before the column existed (or a shard's merged row), which no signature covers.
    residual_root: bytes = bytes(32)


@dataclass(frozen=True)
class ContributionRow:
    host: bytes
    score: float
    reward: int
    aggregated: bool
    reasons: list[str] = field(default_factory=list)


def _storable(value: int) -> bool:
    """SQLite integers are signed 64-bit; protobuf uint64 fields reach 2^64 − 1."""
    return 0 <= value < 1 << 63


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Store:
    """One aggregator's state under `root`. Thread-safe (one connection behind a lock)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.incoming = root / "incoming"
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def open(self) -> Store:
        for sub in ("incoming", "payloads", "checkpoints", "updates", "outer"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.root / "state.sqlite3", check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # fsync the WAL at every commit: a receipt implies durability
        db.executescript(SCHEMA)
        db.executescript(OPENINGS_SCHEMA)
        _add_missing_columns(db)
        self._db = db
        # Half-received payloads of a previous process: never acknowledged, so safe to drop.
        for part in self.incoming.iterdir():
            part.unlink()
        return self

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        if self._db is None:
            raise RuntimeError("Store.open() was not called")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- paths -------------------------------------------------------------------------------------

    def payload_path(self, epoch: int, round_: int, host: bytes) -> Path:
        return self.root / "payloads" / str(epoch) / str(round_) / f"{host.hex()}.bin"

    def checkpoint_path(self, epoch: int, round_: int) -> Path:
        return self.root / "checkpoints" / str(epoch) / f"{round_:06d}.safetensors"

    def update_path(self, epoch: int, round_: int) -> Path:
        return self.root / "updates" / str(epoch) / f"{round_:06d}.safetensors"

    def opening_path(self, epoch: int, round_: int, host: bytes) -> Path:
        """Beside the host's payload of the round."""
        return self.payload_path(epoch, round_, host).with_suffix(".opening")

    def outer_state_path(self, epoch: int, round_: int) -> Path:
        return self.root / "outer" / str(epoch) / f"{round_:06d}.safetensors"

    # ---- rounds ------------------------------------------------------------------------------------

    def open_round(
        self, epoch: int, round_: int, base_sha256: bytes, deadline_ms: int, seed_secret: bytes | None = None
    ) -> RoundRow:
        """Record an open round; its seed secret is on disk before its commitment goes on chain."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO rounds (epoch, round, state, base_sha256, deadline_ms, opened_ms, seed_secret) "
                "VALUES (?,?,?,?,?,?,?)",
                (epoch, round_, "open", base_sha256, deadline_ms, now_ms(), seed_secret),
            )
        row = self.get_round(epoch, round_)
        assert row is not None
        return row

    def get_round(self, epoch: int, round_: int) -> RoundRow | None:
        if not (_storable(epoch) and _storable(round_)):
            return None  # a uint64 from the wire that no stored round can have (SQLite: int64)
        rows = self._rounds("WHERE epoch=? AND round=?", (epoch, round_))
        return rows[0] if rows else None

    def rounds(self, epoch: int | None = None) -> list[RoundRow]:
        if epoch is None:
            return self._rounds("ORDER BY epoch, round", ())
        if not _storable(epoch):
            return []
        return self._rounds("WHERE epoch=? ORDER BY round", (epoch,))

    def latest_round(self) -> RoundRow | None:
        rows = self._rounds("ORDER BY epoch DESC, round DESC LIMIT 1", ())
        return rows[0] if rows else None

    def _rounds(self, where: str, args: tuple[object, ...]) -> list[RoundRow]:
        with self._tx() as db:
            cur = db.execute(f"SELECT * FROM rounds {where}", args)
            names = [d[0] for d in cur.description]
            return [RoundRow(**dict(zip(names, r, strict=True))) for r in cur.fetchall()]

    def set_seed_secret(self, epoch: int, round_: int, secret: bytes) -> None:
        with self._tx() as db:
            db.execute("UPDATE rounds SET seed_secret=? WHERE epoch=? AND round=? AND seed_secret IS NULL",
                       (secret, epoch, round_))

    def set_round_seed(self, epoch: int, round_: int, seed: bytes, at_ms: int) -> None:
        """Record the round's complete seed and when it was first seen complete (kept once set: a restart
        resumes the openings' wait from the stored time)."""
        with self._tx() as db:
            db.execute("UPDATE rounds SET round_seed=?, seed_complete_ms=? WHERE epoch=? AND round=? "
                       "AND round_seed IS NULL", (seed, at_ms, epoch, round_))

    def extend_round(self, epoch: int, round_: int, deadline_ms: int) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE rounds SET deadline_ms=?, extensions=extensions+1 WHERE epoch=? AND round=? AND state='open'",
                (deadline_ms, epoch, round_),
            )

    def record_finalize_intent(
        self,
        epoch: int,
        round_: int,
        state: str,
        checkpoint_sha256: bytes,
        rewards_root: bytes,
        total_reward: int,
        aggregation: str,
        contributions: list[ContributionRow],
        heldout: tuple[float, float] | None = None,
    ) -> None:
        """Everything the chain transaction will say, committed before it is sent (and the round's held-out
        loss before and after its outer step, reported with the result)."""
        if state not in ("finalizing", "skipping"):
            raise ValueError(f"record_finalize_intent: state must be finalizing or skipping, got {state!r}")
        with self._tx() as db:
            db.execute("DELETE FROM contributions WHERE epoch=? AND round=?", (epoch, round_))
            db.executemany(
                "INSERT INTO contributions VALUES (?,?,?,?,?,?,?)",
                [
                    (epoch, round_, c.host, c.score, c.reward, int(c.aggregated), json.dumps(c.reasons))
                    for c in contributions
                ],
            )
            base_loss, loss = heldout if heldout is not None else (None, None)
            db.execute(
                "UPDATE rounds SET state=?, checkpoint_sha256=?, rewards_root=?, total_reward=?, aggregation=?, closed_ms=?, "
                "heldout_loss_base=?, heldout_loss=? WHERE epoch=? AND round=?",
                (state, checkpoint_sha256, rewards_root, total_reward, aggregation, now_ms(), base_loss, loss, epoch, round_),
            )

    def keep_shard_decision(self, epoch: int, round_: int, decision: ShardDecision) -> ShardDecision:
        """Keep a shard's close decision with its open round unless one is kept already (the first stands;
        no upload is stored after it), and return the one kept."""
        with self._tx() as db:
            db.execute("UPDATE rounds SET shard_decision=? WHERE epoch=? AND round=? AND state='open' "
                       "AND shard_decision IS NULL", (decision.to_json(), epoch, round_))
        row = self.get_round(epoch, round_)
        kept = None if row is None else ShardDecision.of(row)
        if kept is None:
            raise ValueError(f"round {epoch}/{round_} is not open: no close decision can be kept for it")
        return kept

    def mark_finalized(self, epoch: int, round_: int, finalize_tx: bytes, skipped: bool = False) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE rounds SET state=?, finalize_tx=? WHERE epoch=? AND round=?",
                ("skipped" if skipped else "finalized", finalize_tx, epoch, round_),
            )

    def contributions(self, epoch: int, round_: int) -> list[ContributionRow]:
        with self._tx() as db:
            rows = db.execute(
                "SELECT host, score, reward, aggregated, reasons FROM contributions WHERE epoch=? AND round=? ORDER BY host",
                (epoch, round_),
            ).fetchall()
        return [ContributionRow(h, s, r, bool(a), json.loads(reasons)) for h, s, r, a, reasons in rows]

    # ---- submissions -------------------------------------------------------------------------------

    def add_submission(self, row: SubmissionRow, part: Path) -> None:
        """Move a fully received, verified payload into place and record it (`row.check_state`: PENDING
        when its decode-time checks run later); durable on return. Replaces a FAILED row of the host:
        a payload that failed its checks is no submission, as a refusal at upload is none."""
        final = Path(row.path)
        final.parent.mkdir(parents=True, exist_ok=True)
        durable_replace(part, final)
        try:
            with self._tx() as db:
                state = db.execute(
                    "SELECT state, shard_decision FROM rounds WHERE epoch=? AND round=?", (row.epoch, row.round)
                ).fetchone()
                if state is None or state[0] != "open" or state[1] is not None:  # a shard's decided close: closed
                    raise sqlite3.IntegrityError(f"round {row.epoch}/{row.round} is not open")
                db.execute("DELETE FROM submissions WHERE epoch=? AND round=? AND host=? AND check_state=?",
                           (row.epoch, row.round, row.host, FAILED))
                db.execute(
                    "INSERT INTO submissions (epoch, round, host, payload_sha256, payload_length, tokens_trained, "
                    "timestamp_ms, signature, received_ms, norm, sketch, path, started_ms, check_state, residual_root) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        row.epoch,
                        row.round,
                        row.host,
                        row.payload_sha256,
                        row.payload_length,
                        row.tokens_trained,
                        row.timestamp_ms,
                        row.signature,
                        row.received_ms,
                        row.norm,
                        row.sketch,
                        row.path,
                        row.started_ms,
                        row.check_state,
                        row.residual_root,
                    ),
                )
        except BaseException:
            final.unlink(missing_ok=True)
            raise

    def submissions(self, epoch: int, round_: int) -> list[SubmissionRow]:
        """Checked submissions of a round in increasing host-address order (the aggregation order)."""
        return self._submissions("epoch=? AND round=? AND check_state=?", (epoch, round_, CHECKED))

    def pending_submissions(self, epoch: int | None = None) -> list[SubmissionRow]:
        """Received payloads whose decode-time checks have not run (of one epoch, or all), by host."""
        if epoch is None:
            return self._submissions("check_state=?", (PENDING,))
        return self._submissions("epoch=? AND check_state=?", (epoch, PENDING))

    def submission(self, epoch: int, round_: int, host: bytes) -> SubmissionRow | None:
        """The host's stored payload in the round, whatever its check state (None: nothing stored)."""
        if not (_storable(epoch) and _storable(round_)):
            return None
        rows = self._submissions("epoch=? AND round=? AND host=?", (epoch, round_, host))
        return rows[0] if rows else None

    def _submissions(self, where: str, args: tuple[object, ...]) -> list[SubmissionRow]:
        with self._tx() as db:
            cur = db.execute(f"SELECT * FROM submissions WHERE {where} ORDER BY host", args)
            names = [d[0] for d in cur.description]
            return [SubmissionRow(**dict(zip(names, r, strict=True))) for r in cur.fetchall()]

    def mark_checked(self, epoch: int, round_: int, host: bytes, norm: float, sketch: bytes) -> None:
        """A pending payload passed its checks: its norm and sketch, and it counts from now on."""
        self._set_check(epoch, round_, host, "norm=?, sketch=?, check_state=?", (norm, sketch, CHECKED))

    def mark_failed(self, epoch: int, round_: int, host: bytes, reason: int, message: str) -> None:
        """A pending payload failed a check: recorded with its reason; excluded from the round."""
        self._set_check(epoch, round_, host, "check_state=?, check_reason=?, check_message=?",
                        (FAILED, reason, message))

    def _set_check(self, epoch: int, round_: int, host: bytes, assign: str, values: tuple[object, ...]) -> None:
        with self._tx() as db:
            db.execute(f"UPDATE submissions SET {assign} WHERE epoch=? AND round=? AND host=? AND check_state=?",
                       (*values, epoch, round_, host, PENDING))

    def previous_submission(self, epoch: int, round_: int, host: bytes) -> SubmissionRow | None:
        """The host's last checked submission of the epoch before `round_` (None: it has none)."""
        rows = self._submissions("epoch=? AND round<? AND host=? AND check_state=?", (epoch, round_, host, CHECKED))
        return max(rows, key=lambda s: s.round) if rows else None

    # ---- openings ----------------------------------------------------------------------------------

    def add_opening(self, row: OpeningRow, part: Path) -> None:
        """Move a received, verified opening body into place and record it; durable on return. Raises
        sqlite3.IntegrityError when the host already has one in the round (the file is then not kept)."""
        final = Path(row.path)
        final.parent.mkdir(parents=True, exist_ok=True)
        if self.opening(row.epoch, row.round, row.host) is not None:
            raise sqlite3.IntegrityError(f"an opening of round {row.epoch}/{row.round} is already stored")
        durable_replace(part, final)
        try:
            with self._tx() as db:
                db.execute("INSERT INTO openings VALUES (?,?,?,?,?,?,?,?,?,?,?)", (
                    row.epoch, row.round, row.host, row.previous_root, row.residual_root, row.body_sha256,
                    row.body_length, row.timestamp_ms, row.signature, row.received_ms, row.path))
        except BaseException:
            final.unlink(missing_ok=True)
            raise

    def opening(self, epoch: int, round_: int, host: bytes) -> OpeningRow | None:
        if not (_storable(epoch) and _storable(round_)):
            return None
        rows = self._openings("epoch=? AND round=? AND host=?", (epoch, round_, host))
        return rows[0] if rows else None

    def openings(self, epoch: int, round_: int) -> dict[bytes, OpeningRow]:
        return {o.host: o for o in self._openings("epoch=? AND round=?", (epoch, round_))}

    def _openings(self, where: str, args: tuple[object, ...]) -> list[OpeningRow]:
        with self._tx() as db:
            cur = db.execute(f"SELECT * FROM openings WHERE {where} ORDER BY host", args)
            names = [d[0] for d in cur.description]
            return [OpeningRow(**dict(zip(names, r, strict=True))) for r in cur.fetchall()]

    def submitted_hosts(self, epoch: int, round_: int, checked_only: bool = False) -> set[bytes]:
        """Hosts with a stored payload in the round that counts (pending or checked; `checked_only`:
        checked): what the round's tick asks several times a second, without the rows' 16 KB sketches."""
        where = "check_state=?" if checked_only else "check_state!=?"
        args = (epoch, round_, CHECKED if checked_only else FAILED)
        with self._tx() as db:
            rows = db.execute(f"SELECT host FROM submissions WHERE epoch=? AND round=? AND {where}", args).fetchall()
        return {bytes(r[0]) for r in rows}

    def has_submission(self, epoch: int, round_: int, host: bytes) -> bool:
        """Whether the host has a payload in the round that counts (pending or checked)."""
        with self._tx() as db:
            return (
                db.execute(
                    f"SELECT 1 FROM submissions WHERE epoch=? AND round=? AND host=? AND {LIVE}", (epoch, round_, host)
                ).fetchone()
                is not None
            )

    def digest_owner(self, epoch: int, round_: int, payload_sha256: bytes) -> bytes | None:
        with self._tx() as db:
            row = db.execute(
                f"SELECT host FROM submissions WHERE epoch=? AND round=? AND payload_sha256=? AND {LIVE}",
                (epoch, round_, payload_sha256),
            ).fetchone()
        return None if row is None else bytes(row[0])


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring a store written by an older version up to the schema (columns added since, with defaults)."""
    for table, column, decl in (("submissions", "started_ms", "INTEGER NOT NULL DEFAULT 0"),
                                ("rounds", "seed_secret", "BLOB"), ("rounds", "heldout_loss_base", "REAL"),
                                ("rounds", "heldout_loss", "REAL"), ("rounds", "round_seed", "BLOB"),
                                ("rounds", "seed_complete_ms", "INTEGER"), ("rounds", "shard_decision", "TEXT"),
                                ("submissions", "check_state", f"TEXT NOT NULL DEFAULT '{CHECKED}'"),
                                ("submissions", "check_reason", "INTEGER NOT NULL DEFAULT 0"),
                                ("submissions", "check_message", "TEXT NOT NULL DEFAULT ''"),
                                ("submissions", "residual_root", f"BLOB NOT NULL DEFAULT X'{'00' * 32}'")):
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
