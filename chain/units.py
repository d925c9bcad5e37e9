"""GNK amounts: integers of ngonka on chain (1 GNK = 10**9 ngonka), decimal strings for people."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

NGONKA_PER_GNK = 10**9


def parse_gnk(text: str | int | float) -> int:
    """'1.5' → 1_500_000_000 ngonka; refuses negative amounts and more than 9 decimals."""
    try:
        value = Decimal(str(text))
    except InvalidOperation:
        raise ValueError(f"not a GNK amount: {text!r}") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"GNK amount must be a finite number >= 0, got {text!r}")
    scaled = value * NGONKA_PER_GNK
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{text!r} GNK has more than 9 decimals")
    return int(scaled)


def gnk_decimal(ngonka: int) -> str:
    """1_500_000_000 → '1.5': the exact decimal `parse_gnk` reads back."""
    sign, ngonka = ("-", -ngonka) if ngonka < 0 else ("", ngonka)
    whole, frac = divmod(ngonka, NGONKA_PER_GNK)
    return sign + f"{whole}.{frac:09d}".rstrip("0").rstrip(".")


def format_gnk(ngonka: int) -> str:
    return gnk_decimal(ngonka) + " GNK"
