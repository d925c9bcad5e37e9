"""What the CLI shows people: amounts in GNK (ngonka on request), times as local dates with a distance."""

from __future__ import annotations

import argparse
import time
from datetime import datetime

from chain.units import gnk_decimal


def amount(ngonka: int, args: argparse.Namespace | None = None) -> str:
    """'1.5 GNK', or '1,500,000,000 ngonka' when the verb was given --ngonka."""
    if args is not None and getattr(args, "ngonka", False):
        return f"{ngonka:,} ngonka"
    return f"{gnk_decimal(ngonka)} GNK"


def eth(wei: int) -> str:
    """A native balance (what pays for gas), in ETH with at most 6 decimals."""
    whole, frac = divmod(wei, 10**18)
    return (f"{whole}.{frac // 10**12:06d}".rstrip("0").rstrip(".") or "0") + " ETH"


def distance(seconds: float) -> str:
    """12 s, 12 min, 3 h 5 min, 2 days 4 h: the two largest units."""
    s = int(abs(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(s // 3600, 24)
    return f"{d} day{'s' if d != 1 else ''} {h} h" if h else f"{d} day{'s' if d != 1 else ''}"


def when(timestamp: int, now: float | None = None) -> str:
    """A Unix time as '2025-06-01 14:03:12 CEST (in 12 min)' in the local time zone; 0 is 'never'."""
    if timestamp <= 0:
        return "never"
    now = time.time() if now is None else now
    local = datetime.fromtimestamp(timestamp).astimezone()
    delta = timestamp - now
    relative = "now" if abs(delta) < 1 else (f"in {distance(delta)}" if delta > 0 else f"{distance(delta)} ago")
    return f"{local:%Y-%m-%d %H:%M:%S %Z} ({relative})"
