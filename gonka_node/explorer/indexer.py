"""Follow the chain block by block into the index, undoing blocks a reorg replaced.

One `step()` checks that the cursor's block still has the hash recorded for it (else it walks back to
the newest recorded block the chain still has, and deletes everything above it), then reads the next
batch of block headers, checks that they chain onto each other and onto the cursor, reads the batch's
logs of the Registry and the Governor, checks that every log belongs to the header read for its
block, and commits headers, events and cursor in one transaction. Anything that changed under it
while it read (`ChainMoved`) is simply read again at the next step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict

from hexbytes import HexBytes
from web3.types import LogReceipt

from chain.client import ChainClient
from chain.errors import ChainError, SpecError
from chain.types import EpochSpec
from gonka_node.explorer.db import BlockRow, EventRow, IndexDb
from gonka_node.explorer.decode import EventDecoder, jsonable

log = logging.getLogger(__name__)
BATCH_BLOCKS = 200
REORG_DEPTH = 1024  # block hashes kept: a reorg deeper than this needs a fresh index


class ChainMoved(ChainError):
    """The chain changed while a batch was read (a reorg in progress): read it again."""


class ReorgTooDeep(ChainError):
    """The chain replaced blocks older than any hash the index kept: it must be rebuilt."""


class Indexer:
    def __init__(self, chain: ChainClient, db: IndexDb, batch_blocks: int = BATCH_BLOCKS) -> None:
        self.chain = chain
        self.db = db
        self.batch_blocks = batch_blocks
        deployment = chain.deployment
        if deployment is None:
            raise ChainError("the explorer needs a deployment (contract addresses)")
        self.first_block = deployment.block
        self.decoder = EventDecoder({"Registry": chain.registry, "Governor": chain.governor})

    def step(self) -> int:
        """Index up to one batch of new blocks; returns how many were added (0: caught up or undone)."""
        if self._undo_reorg():
            return 0
        cursor = self.db.cursor()
        start = self.first_block if cursor is None else cursor.block + 1
        head = int(self.chain.w3.eth.block_number)
        if start > head:
            return 0
        headers = self._headers(start, min(head, start + self.batch_blocks - 1), cursor.hash if cursor else None)
        events = self._events(headers)
        specs = {e.epoch: self._spec(e.epoch) for e in events if e.name == "EpochCreated" and e.epoch is not None}
        self.db.commit_blocks(headers, events, specs)
        self.db.prune_blocks(headers[-1].number - REORG_DEPTH)
        return len(headers)

    def catch_up(self) -> int:
        """Step until the head is reached; returns the number of blocks added."""
        total = 0
        while (added := self.step()) > 0:
            total += added
        return total

    # ---- reorgs -------------------------------------------------------------------------------------

    def _hash_at(self, number: int) -> bytes | None:
        block = self.chain.w3.eth.get_block(number) if number <= int(self.chain.w3.eth.block_number) else None
        return None if block is None else bytes(HexBytes(block["hash"]))

    def _undo_reorg(self) -> bool:
        cursor = self.db.cursor()
        if cursor is None or self._hash_at(cursor.block) == cursor.hash:
            return False
        fork = cursor.block - 1
        while fork >= self.first_block:
            kept = self.db.block(fork)
            if kept is None:
                raise ReorgTooDeep(
                    f"the chain replaced blocks below {fork + 1}, older than the {REORG_DEPTH} the index keeps: "
                    f"delete {self.db.path} and start again"
                )
            if self._hash_at(fork) == kept.hash:
                break
            fork -= 1
        removed = self.db.undo_above(fork)
        log.warning("chain reorganized above block %d: %d indexed rows undone", fork, removed)
        return True

    # ---- reading a batch ----------------------------------------------------------------------------

    def _headers(self, start: int, end: int, parent: bytes | None) -> list[BlockRow]:
        out: list[BlockRow] = []
        for number in range(start, end + 1):
            b = self.chain.w3.eth.get_block(number)
            row = BlockRow(number, bytes(HexBytes(b["hash"])), bytes(HexBytes(b["parentHash"])), int(b["timestamp"]))
            if parent is not None and row.parent != parent:
                raise ChainMoved(f"block {number} does not follow the block read before it")
            out.append(row)
            parent = row.hash
        return out

    def _events(self, headers: Sequence[BlockRow]) -> list[EventRow]:
        by_number = {h.number: h for h in headers}
        logs: list[LogReceipt] = self.chain.w3.eth.get_logs({
            "fromBlock": headers[0].number,
            "toBlock": headers[-1].number,
            "address": [self.chain.registry.address, self.chain.governor.address],
        })
        events: list[EventRow] = []
        for entry in logs:
            header = by_number.get(int(entry["blockNumber"]))
            if header is None or bytes(HexBytes(entry["blockHash"])) != header.hash:
                raise ChainMoved(f"a log of block {entry['blockNumber']} is from another branch")
            event = self.decoder.decode(entry, header.time)
            if event is not None:
                events.append(event)
        return sorted(events, key=lambda e: (e.block, e.log_index))

    def _spec(self, epoch: int) -> str:
        """The epoch's spec as the Registry stores it (immutable once created, so the latest state is
        the creation's; a reorg that removed the epoch is found at the next step)."""
        try:
            spec = EpochSpec.from_abi(self.chain.read(self.chain.registry, "get_spec", epoch))
        except SpecError as exc:
            raise ChainMoved(f"epoch {epoch}'s spec is not readable ({exc})") from None
        return json.dumps({k: jsonable(v) for k, v in asdict(spec).items()})
