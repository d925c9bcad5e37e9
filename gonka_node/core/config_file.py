"""Config objects written back as the TOML files their loaders read (the devnet's, the fault harness's).

A config type that can be written names its tables in `toml_tables(base)`, the loader's inverse: every
value is one the loader accepts, and paths are written relative to `base` (the folder the file goes to,
against which the loader resolves them) when they lie under it. `render_config` turns those tables into
TOML text; the loader reads it back into an equal object (tests/gonka_node/test_config_file.py). Values
are escaped here, so a path or URL with quotes, backslashes or any Unicode stays what it was.
No TOML writer is installed (tomllib only reads), hence this small one: strings, numbers, booleans and
tables, the types our configs hold.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from training.durable import atomic_write

TomlValue = str | int | float | bool | Mapping[str, "TomlValue"]
TomlTables = dict[str, dict[str, TomlValue]]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


class ConfigFile(Protocol):
    """A config object that knows the TOML tables its loader reads it from."""

    def toml_tables(self, base: Path) -> TomlTables: ...


def render_config(config: ConfigFile, base: Path) -> str:
    """`config` as the TOML text of a file in folder `base`, which its loader reads back into an equal object."""
    return render_tables(config.toml_tables(base))


def write_config(config: ConfigFile, path: Path) -> None:
    """Write `config` to `path` (relative paths then resolve against its folder), atomically."""
    text = render_config(config, path.parent)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def toml_path(path: Path, base: Path) -> str:
    """`path` as written in a config in folder `base`: relative when under it, so the folder can move."""
    return path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)


def render_tables(tables: Mapping[str, Mapping[str, TomlValue]]) -> str:
    """Top-level tables (no top-level keys) as TOML; an empty table is left out."""
    return "\n".join(_table(key(name), values) for name, values in tables.items() if values)


def _table(header: str, values: Mapping[str, TomlValue]) -> str:
    lines = [f"[{header}]"]
    lines += [f"{key(k)} = {value(v)}" for k, v in values.items() if not isinstance(v, Mapping)]
    subtables = [_table(f"{header}.{key(k)}", v) for k, v in values.items() if isinstance(v, Mapping)]
    return "\n".join([*lines, "", *subtables]).rstrip("\n") + "\n"


def key(name: str) -> str:
    """A TOML key: bare when it can be, else a quoted string."""
    return name if _BARE_KEY.fullmatch(name) else string(name)


def value(v: TomlValue) -> str:
    """One TOML value (bool before int: a Python bool is an int)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _float(v)
    if isinstance(v, str):
        return string(v)
    raise TypeError(f"no TOML value for {type(v).__name__}")


def _float(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)  # the shortest text that reads back as this float: '0.1', '1e-05', '600.0'


def string(s: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, other Unicode as is."""
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if _control(c) else c) for c in s) + '"'


def _control(c: str) -> bool:
    return ord(c) < 0x20 or ord(c) == 0x7F
