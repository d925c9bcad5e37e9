"""Loads the committed contract artifacts (ABI + bytecode) built by scripts/build_contracts.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"
CONTRACT_NAMES = ("GNK", "Governor", "Registry")


@dataclass(frozen=True)
class Artifact:
    name: str
    abi: list[dict[str, Any]]
    bytecode: str
    compiler: str
    source_sha256: str


@cache
def load_artifact(name: str) -> Artifact:
    if name not in CONTRACT_NAMES:
        raise KeyError(f"unknown contract {name!r}; known: {', '.join(CONTRACT_NAMES)}")
    data = json.loads((ARTIFACT_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return Artifact(
        name=name,
        abi=data["abi"],
        bytecode=data["bytecode"],
        compiler=data["compiler"],
        source_sha256=data["source_sha256"],
    )
