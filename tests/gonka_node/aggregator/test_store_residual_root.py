"""The residual root a host signs (envelope layout 2) is refused when malformed, kept with its
submission, kept across a restart, and an older store gains the column without losing its rows."""

from __future__ import annotations

import hashlib
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from gonka_node.aggregator.challenges import previous_root
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.server import submission_from_pb
from gonka_node.aggregator.store import CHECKED, FAILED, SCHEMA, Store, SubmissionRow
from proto.gonka.v1 import aggregator_pb2 as pb
from training.residual_commit import ChunkLayout, zero_root

ROOT = hashlib.sha256(b"e_r").digest()


def header(**changes: object) -> pb.SubmitHeader:
    fields: dict[str, object] = dict(
        chain_id=1, registry=bytes(20), epoch=1, round=1, host=b"\x01" * 20, base_checkpoint_sha256=bytes(32),
        codec="int8", payload_sha256=bytes(32), payload_length=1, tokens_trained=0, timestamp_unix_ms=0,
        signature=bytes(64), residual_root=ROOT,
    )
    fields.update(changes)
    return pb.SubmitHeader(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("width", [0, 31, 33])
def test_a_header_whose_residual_root_is_not_32_bytes_is_malformed(width: int) -> None:
    with pytest.raises(Rejected) as refused:
        submission_from_pb(header(residual_root=bytes(width)))
    assert refused.value.reason is Reason.MALFORMED
    assert refused.value.message == f"header: residual_root must be 32 bytes, got {width}"


def test_any_32_bytes_are_a_residual_root_until_a_challenge_opens_them() -> None:
    assert submission_from_pb(header()).residual_root == ROOT
    assert submission_from_pb(header(residual_root=b"\xff" * 32)).residual_root == b"\xff" * 32


def row(store: Store, host: bytes, root: bytes | None) -> SubmissionRow:
    extra = {} if root is None else {"residual_root": root}
    return SubmissionRow(1, 1, host, hashlib.sha256(host).digest(), 3, 0, 0, b"s" * 64, 0, 0.0, b"",
                         str(store.payload_path(1, 1, host)), **extra)  # type: ignore[arg-type]


def add(store: Store, r: SubmissionRow, tmp: Path) -> None:
    part = tmp / f"{r.host.hex()}.part"
    part.write_bytes(b"abc")
    store.add_submission(r, part)


def test_the_signed_root_is_kept_with_the_submission_across_a_restart(tmp_path: Path) -> None:
    store = Store(tmp_path / "agg").open()
    store.open_round(1, 1, bytes(32), 10**15)
    add(store, row(store, b"\x01" * 20, ROOT), tmp_path)
    store.close()
    again = Store(tmp_path / "agg").open()
    kept = again.submission(1, 1, b"\x01" * 20)
    assert kept is not None and kept.residual_root == ROOT
    assert [r.residual_root for r in again.submissions(1, 1)] == [ROOT]
    again.close()


def test_an_older_store_gains_the_column_and_keeps_its_rows(tmp_path: Path) -> None:
    root = tmp_path / "agg"
    root.mkdir()
    old_schema = SCHEMA.replace(
        "    residual_root BLOB NOT NULL DEFAULT X'" + "00" * 32 + "',  -- signed: the host's residual after the round\n", ""
    )
    assert "residual_root" not in old_schema
    db = sqlite3.connect(root / "state.sqlite3")
    db.executescript(old_schema)
    db.execute("INSERT INTO rounds (epoch, round, state, base_sha256, deadline_ms, opened_ms) VALUES (1,1,'open',?,?,0)",
               (bytes(32), 10**15))
    db.execute("INSERT INTO submissions (epoch, round, host, payload_sha256, payload_length, tokens_trained, "
               "timestamp_ms, signature, received_ms, norm, sketch, path) VALUES (1,1,?,?,3,0,0,?,0,0.0,?,'x')",
               (b"\x02" * 20, bytes(32), b"s" * 64, b""))
    db.commit()
    db.close()
    store = Store(root).open()
    before = store.submission(1, 1, b"\x02" * 20)
    assert before is not None and before.residual_root == bytes(32)  # stored before layout 2: no root signed
    add(store, row(store, b"\x03" * 20, ROOT), tmp_path)
    assert {r.host: r.residual_root for r in store.submissions(1, 1)} == {b"\x02" * 20: bytes(32), b"\x03" * 20: ROOT}
    store.close()


def test_e_r_minus_1_opens_against_the_last_earlier_checked_root_whatever_came_later(tmp_path: Path) -> None:
    """An overlapped host may hold round r + 1's submission at the aggregator while round r is judged
    (a later close, a restart): round r's previous root is still the host's last checked one before r,
    the zero root before its first; a failed one is no submission, a later one is not earlier."""
    store, host = Store(tmp_path / "agg").open(), b"\x01" * 20
    layout = ChunkLayout((("w", 8),), chunk=4)
    roots = {r: hashlib.sha256(b"e_%d" % r).digest() for r in (1, 2, 3, 4)}
    for r in (1, 2, 3, 4):
        store.open_round(1, r, bytes(32), 10**15)
        sub = replace(row(store, host, roots[r]), round=r, path=str(store.payload_path(1, r, host)))
        add(store, replace(sub, check_state=FAILED if r == 3 else CHECKED), tmp_path)
    assert previous_root(store, layout, 1, 1, host) == zero_root(layout)
    assert [previous_root(store, layout, 1, r, host) for r in (2, 3, 4)] == [roots[1], roots[2], roots[2]]
    store.close()
