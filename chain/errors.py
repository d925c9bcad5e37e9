"""The chain package's errors: one type per thing a caller can act on, whatever the backend."""

from __future__ import annotations


class ChainError(Exception):
    """Base of every error raised by `chain`."""


class ChainRevert(ChainError):
    """A contract refused the call; `reason` is the contract's own reason string (or "" if none)."""

    def __init__(self, reason: str, tx_hash: str | None = None) -> None:
        self.reason = reason
        self.tx_hash = tx_hash
        where = f" (tx {tx_hash})" if tx_hash else ""
        super().__init__(f"reverted: {reason or '<no reason>'}{where}")


class ChainRejected(ChainError):
    """The node refused the transaction before executing it: wrong chain id, stale nonce, no funds."""


class ChainTimeout(ChainError):
    """No receipt within the allowed time; the transaction may still be mined later (see tx_hash)."""

    def __init__(self, message: str, tx_hash: str) -> None:
        self.tx_hash = tx_hash
        super().__init__(message)


class DeploymentError(ChainError):
    """A deployment file is missing, malformed or points at another chain."""


class SpecError(ChainError):
    """An epoch spec (file or object) has a bad field; the message names the file and the field."""

    def __init__(self, field: str, message: str, path: str | None = None) -> None:
        self.field = field
        self.message = message
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}field '{field}': {message}")


class BeaconNotReady(ChainError):
    """The randomness asked for does not exist yet (no block stamped at or after the deadline)."""
