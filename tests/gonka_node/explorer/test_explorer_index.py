"""The explorer's index on the embedded EVM: what it records, restarts that resume without duplicates,
a failed batch that commits nothing, and reorgs (snapshot/revert) undone."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from eth_account import Account
from explorer_chain import AGGREGATOR, Net

from chain.client import ChainClient
from gonka_node.explorer.db import IndexDb, IndexFileError, open_readonly
from gonka_node.explorer.indexer import Indexer

IDENTITY = {"test": "explorer"}


def indexer(net: Net, path: Path, batch_blocks: int = 4) -> Indexer:
    chain = ChainClient(net.backend, Account.create(), net.deployment).connect()
    return Indexer(chain, IndexDb(path).open(IDENTITY), batch_blocks=batch_blocks)


def rows(path: Path, sql: str = "SELECT block, log_index, tx, name, epoch, round, host, args FROM events ORDER BY 1, 2") -> list[tuple]:
    db = open_readonly(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def names(path: Path) -> list[str]:
    return [r[0] for r in rows(path, "SELECT name FROM events ORDER BY block, log_index")]


def test_an_epoch_is_indexed_with_its_events_spec_and_cursor(fresh: Net, tmp_path: Path) -> None:
    epoch = fresh.schedule(2)
    fresh.join(epoch, 1)
    fresh.join(epoch, 2)
    fresh.backend.increase_time(601)
    tree = fresh.finalize(epoch, 1, (1, 2))
    ix = indexer(fresh, tmp_path / "index.sqlite3")
    assert ix.catch_up() > 0
    got = names(tmp_path / "index.sqlite3")
    assert got == [
        "GovernanceChanged", "AggregatorsSet", "EpochCreated", "EpochFunded", "HostJoined", "HostJoined",
        "SeedCommitted", "SeedRevealed", "RoundVote", "RoundFinalized",
    ]
    finalized = rows(tmp_path / "index.sqlite3", "SELECT epoch, round, args FROM events WHERE name='RoundFinalized'")
    assert [(e, r) for e, r, _ in finalized] == [(epoch, 1)]
    assert json.loads(finalized[0][2])["rewards_root"] == "0x" + tree.root.hex()
    spec = rows(tmp_path / "index.sqlite3", "SELECT epoch, spec FROM specs")
    assert spec[0][0] == epoch and json.loads(spec[0][1])["aggregators"] == [fresh.address(AGGREGATOR)]
    cursor = ix.db.cursor()
    head = fresh.backend.connect().eth.get_block("latest")
    assert cursor is not None and (cursor.block, cursor.hash) == (head["number"], bytes(head["hash"]))
    joined = rows(tmp_path / "index.sqlite3", "SELECT host FROM events WHERE name='HostJoined' ORDER BY host")
    assert joined == sorted([(fresh.address(1),), (fresh.address(2),)])


def test_a_restart_mid_epoch_resumes_after_the_cursor_without_duplicates(fresh: Net, tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite3"
    epoch = fresh.schedule(3)
    fresh.join(epoch, 1)
    first = indexer(fresh, path)
    first.catch_up()
    before = rows(path)
    first.db.close()  # the explorer stops mid-epoch

    fresh.join(epoch, 2)
    fresh.backend.increase_time(601)
    fresh.finalize(epoch, 1, (1, 2))
    again = indexer(fresh, path)
    assert again.step() > 0
    again.step()  # a second step on the same blocks would insert nothing twice (primary keys)
    again.catch_up()
    after = rows(path)
    assert after[: len(before)] == before
    keys = [(b, i) for b, i, *_ in after]
    assert len(keys) == len(set(keys))
    # Exactly what one uninterrupted run records.
    indexer(fresh, tmp_path / "whole.sqlite3", batch_blocks=50).catch_up()
    assert after == rows(tmp_path / "whole.sqlite3")
    assert rows(path, "SELECT name FROM events WHERE name='HostJoined'") == [("HostJoined",)] * 2


def test_a_batch_that_fails_midway_commits_nothing(fresh: Net, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "index.sqlite3"
    ix = indexer(fresh, path, batch_blocks=1000)
    ix.catch_up()
    cursor, before = ix.db.cursor(), names(path)
    fresh.schedule(2)

    def broken(epoch: int) -> str:
        raise sqlite3.OperationalError("disk I/O error")  # what a crash between reads and commit looks like

    monkeypatch.setattr(ix, "_spec", broken)
    with pytest.raises(sqlite3.OperationalError):
        ix.step()
    assert ix.db.cursor() == cursor and names(path) == before == ["GovernanceChanged"]
    monkeypatch.undo()
    ix.catch_up()
    assert names(path) == [*before, "AggregatorsSet", "EpochCreated", "EpochFunded"]


@pytest.mark.parametrize("new_hosts", [(2,), (2, 4, 5)], ids=["shorter-branch", "longer-branch"])
def test_a_reverted_block_is_undone_and_the_new_branch_indexed(
    fresh: Net, tmp_path: Path, new_hosts: tuple[int, ...]
) -> None:
    path = tmp_path / "index.sqlite3"
    epoch = fresh.schedule(2)
    ix = indexer(fresh, path)
    ix.catch_up()
    fork = fresh.backend.snapshot()
    fresh.join(epoch, 1)  # on the branch that will be dropped
    fresh.join(epoch, 3)
    ix.catch_up()
    assert {h for (h,) in rows(path, "SELECT host FROM events WHERE name='HostJoined' ORDER BY host")} == {
        fresh.address(1), fresh.address(3)
    }
    dropped_tip = ix.db.cursor()

    fresh.backend.revert(fork)
    for host in new_hosts:  # the new branch: other hosts, in fewer or more blocks than the dropped one
        fresh.join(epoch, host)
    assert ix.step() == 0  # this step only undoes
    cursor = ix.db.cursor()
    assert cursor is not None and cursor.block < dropped_tip.block
    ix.catch_up()
    assert rows(path, "SELECT host FROM events WHERE name='HostJoined' ORDER BY host") == sorted((fresh.address(h),) for h in new_hosts)
    indexer(fresh, tmp_path / "whole.sqlite3", batch_blocks=50).catch_up()
    assert rows(path) == rows(tmp_path / "whole.sqlite3")
    assert rows(path, "SELECT number, hash FROM blocks ORDER BY number") == rows(tmp_path / "whole.sqlite3", "SELECT number, hash FROM blocks ORDER BY number")


def test_an_index_of_another_deployment_is_refused(fresh: Net, tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite3"
    IndexDb(path).open({"registry": "0x1"}).close()
    with pytest.raises(IndexFileError, match="indexes another deployment"):
        IndexDb(path).open({"registry": "0x2"})
