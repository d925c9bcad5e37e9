"""Why a submission is refused: one code per check, mirrored 1:1 by `gonka.v1.RejectReason`."""

from __future__ import annotations

import enum


class Reason(enum.Enum):
    """Values are the wire numbers of `gonka.v1.RejectReason` (a test keeps the two in step)."""

    MALFORMED = 1
    WRONG_CHAIN = 2
    BAD_SIGNATURE = 3
    UNKNOWN_HOST = 4
    WRONG_ROUND = 5
    STALE_BASE = 6
    LATE = 7
    DUPLICATE = 8
    OVERSIZE = 9
    TRUNCATED = 10
    DIGEST_MISMATCH = 11
    WRONG_CODEC = 12
    UNDECODABLE = 13
    WRONG_SHAPE = 14
    NON_FINITE = 15
    NORM_TOO_LARGE = 16
    COPY = 17
    CLOCK_SKEW = 18
    UNAVAILABLE = 19
    STREAM_TIMEOUT = 20
    OBJECT_MISMATCH = 21
    NOT_CHALLENGED = 22
    ROOT_MISMATCH = 23


class Rejected(Exception):
    """A submission refused for `reason`; the message says what to fix. Nothing was stored."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(f"{reason.name}: {message}")
        self.reason = reason
        self.message = message
