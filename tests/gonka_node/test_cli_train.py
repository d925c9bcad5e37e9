"""`gonka-node train`: a real (tiny) local DiLoCo run through the CLI entry point."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from gonka_node.cli import main
from gonka_node.cli.train import load_windows, local_recipe
from training.checkpoint import load_checkpoint, save_checkpoint
from training.codecs import get_codec
from training.hf_export import MODEL_CONFIG_KEY
from training.local import LocalDiLoCo, LocalRunConfig
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


def test_a_run_continues_from_the_previous_runs_checkpoint(corpus: Path, tmp_path: Path) -> None:
    base = ["train", "--preset", "tiny", "--workers", "2", "--rounds", "2", "--inner-steps", "3",
            "--micro-batch", "4", "--seq-len", "32", "--corpus", str(corpus)]
    assert main([*base, "--out", str(tmp_path / "first")]) == 0
    first = json.loads((tmp_path / "first" / "summary.json").read_text())
    saved = load_checkpoint(tmp_path / "first" / "model.safetensors")
    assert saved.sha256 == first["final_sha256"]
    assert json.loads(saved.metadata[MODEL_CONFIG_KEY]) == ModelConfig.preset("tiny").to_dict()
    init = str(tmp_path / "first" / "model.safetensors")
    assert main([*base, "--init", init, "--first-round", "2", "--out", str(tmp_path / "second")]) == 0
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert [r["round"] for r in second["rounds"]] == [3, 4]  # the data stream's rounds after the first run's
    # The second run starts where the first ended (same held-out windows: same seed), not at random init.
    assert second["initial_heldout_loss"] == pytest.approx(first["rounds"][-1]["heldout_loss"], abs=1e-6)
    assert second["init"] == init and second["final_sha256"] != first["final_sha256"]


def test_init_that_does_not_fit_the_preset_is_refused_before_training(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = build_model(ModelConfig.preset("tiny"), seed=0)
    tensors = {n: p.detach() for n, p in other.named_parameters()}
    name = sorted(tensors)[0]
    save_checkpoint(tmp_path / "wrong.safetensors", {**tensors, name: torch.zeros(3)})
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint")
    base = ["train", "--preset", "tiny", "--seq-len", "32", "--corpus", str(corpus), "--out", str(tmp_path / "o")]
    assert main([*base, "--init", str(tmp_path / "wrong.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "wrong.safetensors" in err and f"{name} has shape (3,)" in err
    assert main([*base, "--init", str(tmp_path / "garbage.safetensors")]) == 2
    assert "garbage.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _final_digest(corpus: Path, codec: str) -> str:
    recipe = local_recipe(ModelConfig.preset("tiny"), n_rounds=2, inner_steps=3, micro_batch=4, seq_len=32, codec=codec)
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
        (["--preset", "huge"], "invalid choice: 'huge' (choose from 'tiny', 'devnet', '10m', '12m', '1b', '8b', '30b')"),
        (["--workers", "0"], "workers must be positive"),
        (["--seq-len", "4096"], "max_seq_len"),
        (["--corpus", "/nonexistent/corpus"], "--corpus"),
        (["--first-round", "-1"], "--first-round must be >= 0"),
        (["--stream-fragments", "2", "--round-state", "fresh"], 'stream_fragments: 2 needs round_state = "carry"'),
        (["--stream-fragments", "999"], "error: stream_fragments must be between 1 and the model's 21 tensors, got 999"),
        (["--stream-fragments", "2", "--codec", "mask"], "stream_fragments: 2 with the mask codec"),
    ],
)
def test_user_mistakes_exit_2_with_a_message(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--preset", "tiny", "--seq-len", "32", *flags]) == 2
    assert message in capsys.readouterr().err
