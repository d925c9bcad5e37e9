"""The layers docs/ARCHITECTURE.md draws, read from the import statements themselves: `training` and
`chain` import nothing else of ours, and `gonka_node.core` (the foundations) imports only `training`,
`chain`, `proto` and itself, never the aggregator, host, CLI or devnet built on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("gonka_node", "training", "chain", "proto")


def imported(path: Path) -> set[str]:
    """Every absolute module name `path` imports (relative imports are not used in this tree)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def ours(folder: str) -> dict[str, set[str]]:
    """For each module under `folder`, the modules of ours it imports."""
    return {
        str(p.relative_to(ROOT)): {n for n in imported(p) if n.split(".")[0] in OURS}
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def outside(folder: str, allowed: tuple[str, ...]) -> dict[str, set[str]]:
    found = {m: {n for n in names if not n.startswith(allowed)} for m, names in ours(folder).items()}
    return {m: names for m, names in found.items() if names}


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [
        ("gonka_node/core", ("gonka_node.core", "training", "chain", "proto")),
        ("training", ("training",)),
        ("chain", ("chain",)),
        # The host speaks to the aggregator through the protocol's client in core, never its internals.
        ("gonka_node/host", ("gonka_node.core", "gonka_node.host", "training", "chain", "proto")),
    ],
)
def test_a_lower_layer_imports_nothing_above_it(folder: str, allowed: tuple[str, ...]) -> None:
    assert ours(folder), f"no modules found under {folder}"
    assert outside(folder, allowed) == {}


def test_the_check_sees_an_import_from_above(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom gonka_node.aggregator.client import AggregatorClient\nimport training.diloco\n")
    assert imported(module) == {"os", "gonka_node.aggregator.client", "training.diloco"}


def test_no_role_imports_the_testing_kit() -> None:
    """`gonka_node.testing` (the adversary kit, the Byzantine runner) sits on top: tests and scripts
    import it, nothing that ships in a node does."""
    found = {
        m: {n for n in names if n.startswith("gonka_node.testing")}
        for m, names in ours("gonka_node").items()
        if not m.startswith("gonka_node/testing/")
    }
    assert {m: names for m, names in found.items() if names} == {}
