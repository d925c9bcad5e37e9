"""`gonka-node train`: a real (tiny) local DiLoCo run through the CLI entry point."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from gonka_node.cli import main
from gonka_node.cli.train import LocalDiLoCo, LocalRunConfig, load_windows, local_recipe
from training.codecs import get_codec
from training.model import ModelConfig, build_model

TRAINING = Path(__file__).resolve().parents[2] / "training"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    # Real text, small enough to load instantly: the training package's own sources.
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(p.read_text() for p in sorted(TRAINING.glob("*.py"))))
    return path


def test_train_runs_writes_a_summary_and_counts_real_bytes(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--workers", "2", "--rounds", "3", "--inner-steps", "4"]
    argv += [
        "--micro-batch",
        "4",
        "--seq-len",
        "32",
        "--codec",
        "int8",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    assert summary["rounds"][-1]["heldout_loss"] < summary["initial_heldout_loss"] - 0.5
    # Each host's payload is exactly the int8 codec's size for the model's tensors, every round.
    tiny = ModelConfig.preset("tiny")
    spec = {n: tuple(p.shape) for n, p in build_model(tiny, seed=0).named_parameters()}
    per_round = get_codec("int8").encoded_size(spec)
    assert [r["bytes_per_worker"] for r in summary["rounds"]] == [per_round] * 3
    assert summary["ddp_bytes_per_worker"] == 4 * tiny.num_params() * 3 * 4
    assert summary["reduction_vs_ddp"] == pytest.approx(summary["ddp_bytes_per_worker"] / (3 * per_round))
    printed = capsys.readouterr().out
    assert "held-out loss" in printed and "total" in printed


def _final_digest(corpus: Path, codec: str) -> str:
    recipe = local_recipe(ModelConfig.preset("tiny"), rounds=2, inner_steps=3, micro_batch=4, seq_len=32, codec=codec)
    config = LocalRunConfig(recipe=recipe, workers=2)
    run = LocalDiLoCo(config, load_windows(corpus, 32))
    run.run_round()
    run.run_round()
    h = hashlib.sha256()
    for name in sorted(run.params):
        h.update(run.params[name].detach().numpy().tobytes())
    return h.hexdigest()


def test_local_run_is_a_pure_function_of_its_config(corpus: Path) -> None:
    torch.set_num_threads(1)
    assert _final_digest(corpus, "topk:chunk=256,k=16") == _final_digest(corpus, "topk:chunk=256,k=16")
    assert _final_digest(corpus, "fp32") != _final_digest(corpus, "topk:chunk=256,k=16")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--codec", "zip"], "unknown codec"),
        (["--preset", "huge"], "unknown model preset"),
        (["--workers", "0"], "workers must be positive"),
        (["--seq-len", "4096"], "max_seq_len"),
        (["--corpus", "/nonexistent/corpus"], "--corpus"),
    ],
)
def test_user_mistakes_exit_2_with_a_message(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--preset", "tiny", "--seq-len", "32", *flags]) == 2
    assert message in capsys.readouterr().err
