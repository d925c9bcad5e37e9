"""A shard's close decision is kept with its round: the first one stands across a restart, no upload is
stored after it, and an older store gains the column with its open round undecided."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from gonka_node.aggregator.store import SCHEMA, ShardDecision, Store, SubmissionRow

A, B = b"\x01" * 20, b"\x02" * 20


def add(store: Store, host: bytes, tmp: Path) -> None:
    part = tmp / f"{host.hex()}.part"
    part.write_bytes(b"abc")
    store.add_submission(SubmissionRow(1, 1, host, hashlib.sha256(host).digest(), 3, 0, 0, b"s" * 64, 0, 0.0, b"",
                                       str(store.payload_path(1, 1, host))), part)


def test_the_first_decision_stands_across_a_restart(tmp_path: Path) -> None:
    store = Store(tmp_path / "agg").open()
    store.open_round(1, 1, bytes(32), 10**15)
    add(store, A, tmp_path)
    assert store.keep_shard_decision(1, 1, ShardDecision(True, (A,))) == ShardDecision(True, (A,))
    assert store.keep_shard_decision(1, 1, ShardDecision(False, (A, B))) == ShardDecision(True, (A,))
    store.close()
    again = Store(tmp_path / "agg").open()
    row = again.get_round(1, 1)
    assert row is not None and row.state == "open" and ShardDecision.of(row) == ShardDecision(True, (A,))
    again.close()


def test_no_upload_is_stored_once_a_shard_decided_its_close(tmp_path: Path) -> None:
    store = Store(tmp_path / "agg").open()
    store.open_round(1, 1, bytes(32), 10**15)
    add(store, A, tmp_path)
    store.keep_shard_decision(1, 1, ShardDecision(False, (A,)))
    with pytest.raises(sqlite3.IntegrityError):
        add(store, B, tmp_path)
    assert [s.host for s in store.submissions(1, 1)] == [A]
    assert not store.payload_path(1, 1, B).exists()
    store.close()


def test_a_round_not_open_keeps_no_decision(tmp_path: Path) -> None:
    store = Store(tmp_path / "agg").open()
    store.open_round(1, 1, bytes(32), 10**15)
    store.record_finalize_intent(1, 1, "skipping", bytes(32), bytes(32), 0, "skipped", [])
    with pytest.raises(ValueError, match="round 1/1 is not open"):
        store.keep_shard_decision(1, 1, ShardDecision(True, ()))
    with pytest.raises(ValueError, match="round 1/2 is not open"):
        store.keep_shard_decision(1, 2, ShardDecision(True, ()))
    store.close()


def test_an_older_store_gains_the_column_with_its_round_undecided(tmp_path: Path) -> None:
    root = tmp_path / "agg"
    root.mkdir()
    old_schema = SCHEMA.replace(
        "    shard_decision TEXT,               -- a shard's close, kept before its report is signed: "
        "ShardDecision JSON\n", ""
    )
    assert "shard_decision" not in old_schema
    db = sqlite3.connect(root / "state.sqlite3")
    db.executescript(old_schema)
    db.execute("INSERT INTO rounds (epoch, round, state, base_sha256, deadline_ms, opened_ms) VALUES (1,1,'open',?,?,0)",
               (bytes(32), 10**15))
    db.commit()
    db.close()
    store = Store(root).open()
    row = store.get_round(1, 1)
    assert row is not None and ShardDecision.of(row) is None
    add(store, A, tmp_path)
    assert store.keep_shard_decision(1, 1, ShardDecision(False, (A,))) == ShardDecision(False, (A,))
    store.close()
