"""Raw logs → `EventRow`s: the Registry's and the Governor's events, decoded by their ABIs.

Arguments are kept whole as JSON (bytes as 0x-hex, addresses checksummed, integers exact), and the
ones pages filter on (epoch, round, host) are copied into columns. A log of an unknown event (another
contract version) is skipped, never guessed at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hexbytes import HexBytes
from web3.contract import Contract
from web3.types import LogReceipt

from gonka_node.explorer.db import EventRow

INT64_MAX = (1 << 63) - 1
HOST_FIELDS = ("host", "voter", "funder")  # the argument an event's host column takes, first found


class EventDecoder:
    """Decodes logs of the given contracts (name → bound web3 contract)."""

    def __init__(self, contracts: Mapping[str, Contract]) -> None:
        self._by_topic: dict[tuple[str, bytes], tuple[str, Any]] = {}
        for name, contract in contracts.items():
            # web3 annotates ContractEvents.__iter__ as returning an Iterable, which a plain `for` refuses.
            for event_type in contract.events.__iter__():
                event = event_type()
                self._by_topic[(str(contract.address).lower(), bytes(HexBytes(event.topic)))] = (name, event)

    def decode(self, log: LogReceipt, block_time: int) -> EventRow | None:
        topics = log["topics"]
        if not topics:
            return None
        found = self._by_topic.get((str(log["address"]).lower(), bytes(HexBytes(topics[0]))))
        if found is None:
            return None
        contract, event = found
        args = {k: jsonable(v) for k, v in dict(event.process_log(log)["args"]).items()}
        host = next((args[f] for f in HOST_FIELDS if isinstance(args.get(f), str)), None)
        return EventRow(
            block=int(log["blockNumber"]),
            log_index=int(log["logIndex"]),
            tx=bytes(HexBytes(log["transactionHash"])),
            time=block_time,
            contract=contract,
            name=event.event_name,
            epoch=_column(args.get("epoch")),
            round=_column(args.get("round")),
            host=host,
            args=args,
        )


def jsonable(value: Any) -> Any:
    """A decoded ABI value as JSON: bytes → 0x-hex, tuples → lists (web3 gives addresses checksummed)."""
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def _column(value: Any) -> int | None:
    """An integer argument as a SQL column: values past int64 (which no real epoch or round reaches)
    stay in the JSON only."""
    return value if isinstance(value, int) and 0 <= value <= INT64_MAX else None
