"""Epoch specs in TOML: one flat table whose keys are EpochSpec's fields, amounts in GNK.

    model_spec_hash = "0x<64 hex>"      # also data_manifest_hash, init_checkpoint_hash
    model_uri = "https://…"
    inner_steps = 50                    # also batch_size, n_rounds, max_hosts, aggregator_quorum
    inner_lr = 3e-4                     # also outer_lr, outer_momentum (at most 9 decimals)
    codec = "topk-int8"
    round_length = 600                  # seconds; also signin_window
    min_stake_gnk = "100"               # also reward_per_round_gnk, challenge_bond_gnk ("1.5" = 1.5 GNK)
    aggregators = ["0x…", "0x…"]
    replay_probability = 0.25           # optional (default 1.0): min_stake >= reward_per_round / p
    challenge_window = 3600             # optional: seconds the stake stays locked after the epoch

Keys for EpochSpec fields with a default (aggregator_quorum, reward_per_round_gnk, replay_probability,
challenge_window, challenge_bond_gnk) may be left out. Every mistake raises SpecError naming the file
and the field. `format_epoch_spec` writes a spec back in this form, each key with an optional comment,
so that `parse_epoch_spec(tomllib.loads(format_epoch_spec(spec)))` equals `spec`.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from chain.errors import SpecError
from chain.types import EpochSpec
from chain.units import gnk_decimal, parse_gnk

_HASHES = ("model_spec_hash", "data_manifest_hash", "init_checkpoint_hash")
_INTS = (
    "inner_steps", "batch_size", "n_rounds", "round_length", "signin_window", "max_hosts", "aggregator_quorum",
    "challenge_window",
)
_FLOATS = ("inner_lr", "outer_lr", "outer_momentum", "replay_probability")
_GNK = {"min_stake_gnk": "min_stake", "reward_per_round_gnk": "reward_per_round", "challenge_bond_gnk": "challenge_bond"}
_KEY_OF_FIELD = {name: key for key, name in _GNK.items()}


def _hash(value: Any) -> bytes:
    if not isinstance(value, str):
        raise ValueError("must be a hex string of 32 bytes")
    try:
        raw = bytes.fromhex(value.removeprefix("0x"))
    except ValueError:
        raise ValueError(f"not hex: {value!r}") from None
    if len(raw) != 32:
        raise ValueError(f"must be 32 bytes (64 hex digits), got {len(raw)}")
    return raw


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"must be an integer, got {value!r}")
    return value


def _float(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    return value


def _addresses(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise ValueError("must be a list of address strings")
    return tuple(value)


def _converter(key: str) -> tuple[str, Callable[[Any], Any]]:
    if key in _HASHES:
        return key, _hash
    if key in _INTS:
        return key, _int
    if key in _FLOATS:
        return key, _float
    if key in _GNK:
        return _GNK[key], lambda v: parse_gnk(v if isinstance(v, str) else _float(v))
    if key == "aggregators":
        return key, _addresses
    return key, _str


def spec_keys() -> list[str]:
    return [_KEY_OF_FIELD.get(f.name, f.name) for f in fields(EpochSpec)]


def _optional_keys() -> set[str]:
    """Keys whose EpochSpec field has a default: left out, the dataclass's default applies."""
    return {_KEY_OF_FIELD.get(f.name, f.name) for f in fields(EpochSpec) if f.default is not MISSING}


def parse_epoch_spec(data: dict[str, Any], path: str | None = None) -> EpochSpec:
    keys = spec_keys()
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise SpecError(unknown[0], f"unknown field (known: {', '.join(keys)})", path)
    optional = _optional_keys()
    values: dict[str, Any] = {}
    for key in keys:
        if key not in data:
            if key in optional:
                continue
            raise SpecError(key, "missing", path)
        name, convert = _converter(key)
        try:
            values[name] = convert(data[key])
        except ValueError as exc:
            raise SpecError(key, str(exc), path) from None
    try:
        return EpochSpec(**values)
    except SpecError as exc:
        key = _KEY_OF_FIELD.get(exc.field, exc.field)
        raise SpecError(key, exc.message, path) from None


def load_epoch_spec(path: str | Path) -> EpochSpec:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError("-", "no such file", str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("-", f"not valid TOML ({exc})", str(path)) from None
    return parse_epoch_spec(data, str(path))


def _toml_value(key: str, spec: EpochSpec) -> str:
    name = _GNK.get(key, key)
    value = getattr(spec, name)
    if key in _HASHES:
        return f'"0x{value.hex()}"'
    if key in _GNK:
        return f'"{gnk_decimal(value)}"'
    if key in _FLOATS:
        return repr(float(value))
    if key == "aggregators":
        return "[" + ", ".join(f'"{a}"' for a in value) + "]"
    if key in _INTS:
        return str(value)
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def format_epoch_spec(spec: EpochSpec, comments: dict[str, str] | None = None, header: str = "") -> str:
    """`spec` as the TOML this module reads: one key per line, `comments[key]` after it, `header` on top."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key in spec_keys():
        line = f"{key} = {_toml_value(key, spec)}"
        note = (comments or {}).get(key)
        lines.append(f"{line}  # {note}" if note else line)
    return "\n".join(lines) + "\n"
