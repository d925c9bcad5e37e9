#!/usr/bin/env python3
"""Compile chain/contracts/*.vy into the committed artifacts chain/artifacts/<Name>.json.

Each artifact names the compiler version, the EVM version and the sha256 of its source, next to the
ABI and deploy bytecode. `--check` recompiles in memory and fails (exit 1) when an artifact is missing,
stale or extra, without writing anything; CI runs it so the committed bytecode always matches the source.
Optimization is the compiler's default (gas) unless a source says otherwise: Registry.vy carries
`# pragma optimize codesize` to stay under EIP-170's 24,576-byte limit, in the source so that compiling
the file alone reproduces the artifact.

    .venv/bin/python scripts/build_contracts.py          # rebuild
    .venv/bin/python scripts/build_contracts.py --check  # verify
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import vyper
from vyper.compiler.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "chain" / "contracts"
ARTIFACTS = ROOT / "chain" / "artifacts"
# Cancun, not the compiler's default (prague): py-evm in web3[tester] and every public EVM chain run it.
EVM_VERSION = "cancun"


def build_artifact(source_path: Path) -> dict[str, object]:
    source = source_path.read_text(encoding="utf-8")
    out = vyper.compile_code(
        source,
        contract_path=source_path.name,
        output_formats=["abi", "bytecode"],
        settings=Settings(evm_version=EVM_VERSION),
    )
    return {
        "contract": source_path.stem,
        "source": f"chain/contracts/{source_path.name}",
        "source_sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(),
        "compiler": f"vyper {vyper.__version__}",
        "evm_version": EVM_VERSION,
        "abi": out["abi"],
        "bytecode": out["bytecode"],
    }


def render(artifact: dict[str, object]) -> str:
    return json.dumps(artifact, indent=1, sort_keys=False) + "\n"


def expected_artifacts() -> dict[Path, str]:
    return {ARTIFACTS / f"{p.stem}.json": render(build_artifact(p)) for p in sorted(SOURCES.glob("*.vy"))}


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def check(expected: dict[Path, str]) -> list[str]:
    problems = []
    for path, text in expected.items():
        if not path.exists():
            problems.append(f"{_show(path)}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{_show(path)}: stale (source or compiler changed)")
    for path in sorted(ARTIFACTS.glob("*.json")):
        if path not in expected:
            problems.append(f"{_show(path)}: no source chain/contracts/{path.stem}.vy")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when artifacts are stale; write nothing")
    args = parser.parse_args(argv)
    expected = expected_artifacts()
    if args.check:
        problems = check(expected)
        for line in problems:
            print(f"build_contracts: {line}", file=sys.stderr)
        if problems:
            print("build_contracts: run `.venv/bin/python scripts/build_contracts.py`", file=sys.stderr)
            return 1
        print(f"build_contracts: {len(expected)} artifacts up to date")
        return 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for path, text in expected.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {_show(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
