"""The artifact builder: committed artifacts are fresh, and a stale one is caught."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from script_kit import load_script

from chain.artifacts import load_artifact

REPO = Path(__file__).resolve().parents[2]


def _builder() -> ModuleType:
    return load_script("build_contracts")


def test_committed_artifact_matches_source_and_a_stale_one_is_reported(tmp_path: Path) -> None:
    builder = _builder()
    source = REPO / "chain" / "contracts" / "GNK.vy"
    fresh = builder.render(builder.build_artifact(source))
    committed = REPO / "chain" / "artifacts" / "GNK.json"
    assert committed.read_text() == fresh
    data = json.loads(fresh)
    assert data["compiler"] == "vyper 0.4.3" and data["evm_version"] == "cancun"
    assert load_artifact("GNK").source_sha256 == data["source_sha256"]

    builder.ARTIFACTS = tmp_path
    stale = tmp_path / "GNK.json"
    stale.write_text(fresh.replace(data["source_sha256"], "0" * 64))
    (tmp_path / "Orphan.json").write_text("{}")
    problems = builder.check({stale: fresh, tmp_path / "Registry.json": "{}"})
    assert any("GNK.json: stale" in p for p in problems)
    assert any("Registry.json: missing" in p for p in problems)
    assert any("Orphan.json: no source" in p for p in problems)
