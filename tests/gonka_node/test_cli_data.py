"""`gonka-node data tokenizer | prepare | verify` as a user runs them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gonka_node.cli import main


def _corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i}.txt").write_text(f"note {i}: the tokenizer learns frequent words. " * (3 + i % 5))
    return folder


def test_tokenizer_prepare_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = _corpus(tmp_path)
    tok = tmp_path / "tok" / "tokenizer.json"
    assert main(["data", "tokenizer", "--corpus", str(corpus), "--vocab", "300", "--out", str(tok)]) == 0
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()
    assert f'tokenizer = "{digest}"' in capsys.readouterr().out
    out = tmp_path / "ds"
    files = [str(p) for p in sorted(corpus.iterdir())]
    assert main(["data", "prepare", "--input", *files, "--tokenizer", str(tok), "--out", str(out),
                 "--workers", "1", "--unit-mb", "0.002", "--heldout-fraction", "0.2"]) == 0
    printed = capsys.readouterr()
    manifest_sha = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    assert f'data_manifest_sha256 = "{manifest_sha}"' in printed.out
    assert f'tokenizer = "{digest}"' in printed.out
    assert "tokens/s" in printed.err  # progress
    assert main(["data", "verify", "--dataset", str(out), "--sha256", manifest_sha]) == 0
    assert f"match manifest {manifest_sha}" in capsys.readouterr().out
    shard = sorted((out / "train").glob("*.tok"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])
    assert main(["data", "verify", "--dataset", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"shard train/{shard.name} has sha256" in captured.out
    assert captured.err.strip().endswith("failed their check") and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["data", "prepare", "--input", "absent.txt", "--out", "ds"], "input absent.txt is not a file"),
        (["data", "prepare", "--input", "x.txt", "--out", "gs://b/p"], "only directories and s3://"),
        (["data", "verify", "--dataset", "nowhere"], "no manifest.json"),
        (["data", "tokenizer", "--corpus", "nowhere", "--vocab", "300", "--out", "t.json"], "--corpus"),
        (["data", "tokenizer", "--corpus", ".", "--vocab", "100", "--out", "t.json"], "at least 258"),
    ],
)
def test_mistakes_are_one_line(argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("x")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ds" / "manifest.json").exists()
