"""The explorer's index: chain events and aggregator reports in one SQLite file.

Every row that comes from the chain carries the number of the block it came from, and every block
the indexer processed is recorded with its hash and parent hash. A batch of blocks is committed in one
transaction together with the cursor (the last processed block and its hash), so a crash leaves the
previous consistent index, a restart resumes after the cursor, and `(block, log_index)` keys make a
row impossible to insert twice. Undoing a reorg is deleting every row above the fork block: reports
from aggregators are tied to the block of the `RoundFinalized` event they were checked against, so
they go with it.

The web server opens the file read-only (`open_readonly`): the API cannot write even by mistake.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cursor (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    block INTEGER NOT NULL,            -- the last block processed
    hash BLOB NOT NULL,                -- its hash: a different hash at that height means a reorg
    version INTEGER NOT NULL           -- bumped at every commit; live pages refresh when it moves
);
CREATE TABLE IF NOT EXISTS blocks (
    number INTEGER PRIMARY KEY,
    hash BLOB NOT NULL,
    parent BLOB NOT NULL,
    time INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    block INTEGER NOT NULL,
    log_index INTEGER NOT NULL,
    tx BLOB NOT NULL,
    time INTEGER NOT NULL,             -- the block's timestamp
    contract TEXT NOT NULL,            -- Registry | Governor
    name TEXT NOT NULL,                -- the event's name in the contract's ABI
    epoch INTEGER,
    round INTEGER,
    host TEXT,                         -- checksummed address when the event names one
    args TEXT NOT NULL,                -- JSON: the decoded arguments (bytes as 0x-hex)
    PRIMARY KEY (block, log_index)
);
CREATE INDEX IF NOT EXISTS events_by_name ON events (name, epoch, round);
CREATE INDEX IF NOT EXISTS events_by_host ON events (host);
CREATE TABLE IF NOT EXISTS specs (
    epoch INTEGER PRIMARY KEY,
    block INTEGER NOT NULL,            -- the block of its EpochCreated event
    spec TEXT NOT NULL                 -- JSON of chain.types.EpochSpec
);
CREATE TABLE IF NOT EXISTS reports (
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    block INTEGER NOT NULL,            -- the block of the RoundFinalized event it was checked against
    source TEXT NOT NULL,              -- the aggregator endpoint it came from
    base_sha256 BLOB NOT NULL,
    aggregation TEXT NOT NULL,
    heldout_loss_base REAL,
    heldout_loss REAL,
    verified INTEGER NOT NULL,         -- 1: checkpoint and reward root equal the chain's
    note TEXT NOT NULL,                -- why not verified ("" when verified)
    PRIMARY KEY (epoch, round)
);
CREATE TABLE IF NOT EXISTS contributions (
    epoch INTEGER NOT NULL,
    round INTEGER NOT NULL,
    host TEXT NOT NULL,
    score REAL NOT NULL,
    reward TEXT NOT NULL,              -- ngonka, decimal: a uint64 from the wire may not fit SQLite's int64
    aggregated INTEGER NOT NULL,
    reasons TEXT NOT NULL,             -- JSON list of the aggregator's strings
    payload_length TEXT NOT NULL,      -- bytes, decimal (same reason)
    PRIMARY KEY (epoch, round, host)
);
"""


class IndexFileError(RuntimeError):
    """The index file cannot be used (another chain's, or a newer schema)."""


@dataclass(frozen=True)
class Cursor:
    block: int
    hash: bytes
    version: int


@dataclass(frozen=True)
class EventRow:
    block: int
    log_index: int
    tx: bytes
    time: int
    contract: str
    name: str
    epoch: int | None
    round: int | None
    host: str | None
    args: dict[str, Any]


@dataclass(frozen=True)
class BlockRow:
    number: int
    hash: bytes
    parent: bytes
    time: int


@dataclass(frozen=True)
class ContributionRow:
    host: str
    score: float
    reward: int
    aggregated: bool
    reasons: list[str]
    payload_length: int


@dataclass(frozen=True)
class ReportRow:
    epoch: int
    round: int
    block: int
    source: str
    base_sha256: bytes
    aggregation: str
    heldout_loss_base: float | None
    heldout_loss: float | None
    verified: bool
    note: str
    contributions: list[ContributionRow]


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, isolation_level=None)
    else:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")  # readers (the web server) never block the indexer
        db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA busy_timeout=5000")
    return db


def open_readonly(path: Path) -> sqlite3.Connection:
    return _connect(path, readonly=True)


class IndexDb:
    """The writer's side (the indexer and the report fetcher). One connection; not shared across threads
    except through `transaction()`, which the indexer holds while it writes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None

    def open(self, identity: dict[str, Any]) -> IndexDb:
        """Create or open the index for `identity` (chain id and contract addresses); an index built for
        another deployment is refused rather than mixed with this one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = _connect(self.path, readonly=False)
        self.db.executescript(SCHEMA)
        with self.transaction() as db:
            self._check_identity(db, identity)
        return self

    def _check_identity(self, db: sqlite3.Connection, identity: dict[str, Any]) -> None:
        want = json.dumps(identity, sort_keys=True)
        row = db.execute("SELECT value FROM meta WHERE key='identity'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta VALUES ('identity', ?), ('schema', ?)", (want, str(SCHEMA_VERSION)))
        elif row[0] != want:
            raise IndexFileError(
                f"{self.path} indexes another deployment ({row[0]}); give another --db file or delete this one"
            )

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("IndexDb is not open; call open() first")
        return self._db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # ---- cursor and blocks ------------------------------------------------------------------------

    def cursor(self) -> Cursor | None:
        return read_cursor(self.db)

    def block(self, number: int) -> BlockRow | None:
        row = self.db.execute("SELECT number, hash, parent, time FROM blocks WHERE number=?", (number,)).fetchone()
        return None if row is None else BlockRow(row[0], bytes(row[1]), bytes(row[2]), row[3])

    def commit_blocks(self, blocks: Sequence[BlockRow], events: Sequence[EventRow], specs: dict[int, str]) -> None:
        """Blocks (in order, following the cursor), their events and the specs of epochs they created,
        with the cursor moved to the last block, in one transaction."""
        if not blocks:
            return
        with self.transaction() as db:
            db.executemany("INSERT INTO blocks VALUES (?,?,?,?)", [(b.number, b.hash, b.parent, b.time) for b in blocks])
            db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?,?)", [_event_tuple(e) for e in events])
            block_of = {e.epoch: e.block for e in events if e.name == "EpochCreated"}
            db.executemany("INSERT INTO specs VALUES (?,?,?)", [(ep, block_of[ep], s) for ep, s in specs.items()])
            _move_cursor(db, blocks[-1].number, blocks[-1].hash)

    def undo_above(self, fork: int) -> int:
        """Delete everything from blocks after `fork` (a reorg replaced them); returns the rows removed."""
        with self.transaction() as db:
            removed = 0
            for table, column in (("events", "block"), ("specs", "block"), ("blocks", "number")):
                removed += db.execute(f"DELETE FROM {table} WHERE {column} > ?", (fork,)).rowcount
            stale = db.execute("SELECT epoch, round FROM reports WHERE block > ?", (fork,)).fetchall()
            for epoch, round_ in stale:
                db.execute("DELETE FROM contributions WHERE epoch=? AND round=?", (epoch, round_))
            removed += db.execute("DELETE FROM reports WHERE block > ?", (fork,)).rowcount
            kept = db.execute("SELECT hash FROM blocks WHERE number=?", (fork,)).fetchone()
            if kept is None:
                db.execute("DELETE FROM cursor")
            else:
                _move_cursor(db, fork, bytes(kept[0]))
        return removed

    def prune_blocks(self, below: int) -> None:
        """Forget block hashes older than `below` (deeper than any reorg the indexer will undo)."""
        with self.transaction() as db:
            db.execute("DELETE FROM blocks WHERE number < ?", (below,))

    # ---- aggregator reports ------------------------------------------------------------------------

    def save_report(self, report: ReportRow) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM contributions WHERE epoch=? AND round=?", (report.epoch, report.round))
            db.execute(
                "INSERT OR REPLACE INTO reports VALUES (?,?,?,?,?,?,?,?,?,?)",
                (report.epoch, report.round, report.block, report.source, report.base_sha256, report.aggregation,
                 report.heldout_loss_base, report.heldout_loss, int(report.verified), report.note),
            )
            db.executemany(
                "INSERT INTO contributions VALUES (?,?,?,?,?,?,?,?)",
                [(report.epoch, report.round, c.host, c.score, str(c.reward), int(c.aggregated), json.dumps(c.reasons),
                  str(c.payload_length)) for c in report.contributions],
            )
            _bump_version(db)


def _event_tuple(e: EventRow) -> tuple[Any, ...]:
    return (e.block, e.log_index, e.tx, e.time, e.contract, e.name, e.epoch, e.round, e.host, json.dumps(e.args))


def _move_cursor(db: sqlite3.Connection, block: int, block_hash: bytes) -> None:
    db.execute(
        "INSERT INTO cursor VALUES (1, ?, ?, 1) ON CONFLICT(id) DO UPDATE SET block=excluded.block, "
        "hash=excluded.hash, version=cursor.version + 1",
        (block, block_hash),
    )


def _bump_version(db: sqlite3.Connection) -> None:
    db.execute("UPDATE cursor SET version = version + 1")


def read_cursor(db: sqlite3.Connection) -> Cursor | None:
    row = db.execute("SELECT block, hash, version FROM cursor WHERE id=1").fetchone()
    return None if row is None else Cursor(row[0], bytes(row[1]), row[2])


def read_events(db: sqlite3.Connection, where: str = "", args: Sequence[Any] = ()) -> list[EventRow]:
    """Events matching a SQL condition on the events table's columns, in chain order."""
    sql = "SELECT block, log_index, tx, time, contract, name, epoch, round, host, args FROM events"
    cur = db.execute(f"{sql} {'WHERE ' + where if where else ''} ORDER BY block, log_index", tuple(args))
    return [
        EventRow(b, i, bytes(tx), t, c, n, ep, r, h, json.loads(a)) for b, i, tx, t, c, n, ep, r, h, a in cur.fetchall()
    ]


def read_reports(db: sqlite3.Connection, epoch: int) -> dict[int, ReportRow]:
    rows = db.execute(
        "SELECT epoch, round, block, source, base_sha256, aggregation, heldout_loss_base, heldout_loss, verified, "
        "note FROM reports WHERE epoch=? ORDER BY round", (epoch,)
    ).fetchall()
    out: dict[int, ReportRow] = {}
    for ep, r, block, source, base, agg, loss_base, loss, verified, note in rows:
        contributions = [
            ContributionRow(h, s, int(rw), bool(a), json.loads(why), int(size))
            for h, s, rw, a, why, size in db.execute(
                "SELECT host, score, reward, aggregated, reasons, payload_length FROM contributions "
                "WHERE epoch=? AND round=? ORDER BY host", (ep, r)
            ).fetchall()
        ]
        out[r] = ReportRow(ep, r, block, source, bytes(base), agg, loss_base, loss, bool(verified), note, contributions)
    return out


def read_spec(db: sqlite3.Connection, epoch: int) -> dict[str, Any] | None:
    row = db.execute("SELECT spec FROM specs WHERE epoch=?", (epoch,)).fetchone()
    return None if row is None else dict(json.loads(row[0]))
