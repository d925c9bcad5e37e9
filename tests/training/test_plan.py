"""The rig memory plan: activation counts against a measurement, and the presets on 8 × 80 GB."""

from __future__ import annotations

import json

import pytest
from script_kit import load_script

from training.model import ModelConfig
from training.plan import (
    Dtypes,
    activation_bytes,
    choose_sharding,
    layer_activation_bytes,
    measure_activation_bytes,
    plan_rig,
)

pytestmark = pytest.mark.usefixtures("one_thread")
FP32 = Dtypes(4, 4)


@pytest.mark.parametrize(("preset", "micro_batch", "seq_len"), [("tiny", 4, 64), ("devnet", 2, 128)])
def test_activation_formula_matches_what_autograd_keeps(preset: str, micro_batch: int, seq_len: int) -> None:
    cfg = ModelConfig.preset(preset)
    tokens = micro_batch * seq_len
    measured = measure_activation_bytes(cfg, micro_batch, seq_len, checkpoint=False)
    assert abs(activation_bytes(cfg, tokens, FP32, False) - measured) <= 0.05 * measured
    # Checkpointed, the forward keeps layer inputs (the plan adds one layer recomputed in backward).
    measured = measure_activation_bytes(cfg, micro_batch, seq_len, checkpoint=True)
    forward_only = activation_bytes(cfg, tokens, FP32, True) - tokens * layer_activation_bytes(cfg, FP32)
    assert abs(forward_only - measured) <= 0.25 * measured


def test_30b_fits_eight_80gb_gpus_only_sharded_and_checkpointed() -> None:
    cfg = ModelConfig.preset("30b")
    plan = plan_rig(cfg, preset="30b", gpus=8, gpu_mem_gb=80)
    assert plan.fits and plan.sharded and plan.checkpoint_activations and plan.max_micro_batch >= 1
    per_gpu = plan.bytes_per_gpu
    assert per_gpu["parameters"] == 4 * cfg.num_params() // 8 and per_gpu["optimizer"] == 2 * per_gpu["parameters"]
    assert per_gpu["total"] <= plan.usable_bytes < 80e9
    assert plan.host_ram_bytes >= 16 * cfg.num_params()  # global model, momentum, update, residual
    assert not plan_rig(cfg, gpus=1, gpu_mem_gb=80).fits
    assert not plan_rig(cfg, gpus=8, gpu_mem_gb=80, sharded=True, checkpoint_activations=False).fits


def test_smaller_models_pick_the_cheapest_setting_that_fits() -> None:
    one_b = plan_rig(ModelConfig.preset("1b"), gpus=8, gpu_mem_gb=80)
    assert one_b.fits and not one_b.sharded and not one_b.checkpoint_activations  # replicated: no gathers
    eight_b = plan_rig(ModelConfig.preset("8b"), gpus=8, gpu_mem_gb=80)
    assert eight_b.fits and eight_b.sharded and not eight_b.checkpoint_activations
    bigger = plan_rig(ModelConfig.preset("8b"), gpus=8, gpu_mem_gb=80, micro_batch=eight_b.max_micro_batch + 1)
    assert bigger.checkpoint_activations or not bigger.fits  # one more sequence does not fit without it
    assert choose_sharding(ModelConfig.preset("8b"), 8, 80 * 10**9, 1, 2048)
    assert not choose_sharding(ModelConfig.preset("1b"), 8, 80 * 10**9, 1, 2048)
    assert not choose_sharding(ModelConfig.preset("30b"), 8, None, 1, 2048)  # a CPU rig replicates


def test_plan_rig_script_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    main = load_script("plan_rig").main
    assert main(["--preset", "30b", "--gpus", "8", "--gpu-mem-gb", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["preset"] == "30b" and out["gpus"] == 8
    assert out["bytes_per_gpu"]["total"] <= out["usable_bytes"]
    assert main(["--preset", "huge", "--gpus", "8", "--gpu-mem-gb", "80"]) == 2
    assert "unknown model preset 'huge'" in capsys.readouterr().err
