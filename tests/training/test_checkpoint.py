import hashlib
import struct
from pathlib import Path

import pytest
import torch

from training.checkpoint import (
    CheckpointError,
    canonical_sha256,
    load_checkpoint,
    load_training_state,
    save_checkpoint,
    save_training_state,
)
from training.data import Windows
from training.inner import InnerConfig, InnerTrainer
from training.model import ModelConfig, build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ModelConfig.preset("tiny")


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a.bias": torch.tensor([1, -2], dtype=torch.int64),
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
    }


def test_hash_follows_the_documented_byte_layout() -> None:
    def u32(n: int) -> bytes:
        return struct.pack("<I", n)

    def u64(n: int) -> bytes:
        return struct.pack("<Q", n)

    expected = hashlib.sha256(
        b"gonka-tensors-v1\n"
        + u64(3)
        + u32(6) + b"a.bias" + u32(3) + b"I64" + u32(1) + u64(2)
        + u64(16) + struct.pack("<qq", 1, -2)
        + u32(8) + b"b.weight" + u32(3) + b"F32" + u32(2) + u64(2) + u64(3)
        + u64(24) + struct.pack("<6f", 0, 1, 2, 3, 4, 5)
        + u32(5) + b"scale" + u32(4) + b"BF16" + u32(0)
        + u64(2) + bytes([0x00, 0x3F])  # bf16 0.5 = 0x3F00
    ).hexdigest()  # fmt: skip
    assert canonical_sha256(_tensors()) == expected


def test_hash_ignores_order_layout_and_device_placement() -> None:
    tensors = _tensors()
    reordered = dict(reversed(list(tensors.items())))
    transposed = {**tensors, "b.weight": tensors["b.weight"].t().contiguous().t()}  # non-contiguous view
    assert not transposed["b.weight"].is_contiguous()
    assert canonical_sha256(reordered) == canonical_sha256(transposed) == canonical_sha256(tensors)


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t["b.weight"].view(-1).__setitem__(4, 4.0000005),  # one element, one ulp-ish
        lambda t: t.__setitem__("b.weight", t["b.weight"].double()),  # dtype
        lambda t: t.__setitem__("b.weight", t["b.weight"].reshape(3, 2)),  # shape, same bytes
        lambda t: t.__setitem__("c.weight", t.pop("b.weight")),  # name
        lambda t: t.__setitem__("a.bias", t["a.bias"].to(torch.int32)),  # dtype, same values
    ],
)
def test_hash_changes_with_any_content_change(change) -> None:
    tensors = _tensors()
    original = canonical_sha256(tensors)
    change(tensors)
    assert canonical_sha256(tensors) != original


def test_hash_separates_tensor_boundaries() -> None:
    left = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    right = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0, 3.0])}
    assert canonical_sha256(left) != canonical_sha256(right)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "round-1.safetensors"
    sha = save_checkpoint(path, _tensors(), {"round": "1"})
    assert sha == canonical_sha256(_tensors())
    loaded = load_checkpoint(path, expected_sha256=sha)
    assert loaded.sha256 == sha and loaded.metadata == {"round": "1"}
    for name, tensor in _tensors().items():
        assert torch.equal(loaded.tensors[name], tensor) and loaded.tensors[name].dtype == tensor.dtype
    assert sorted(p.name for p in path.parent.iterdir()) == ["round-1.safetensors"]  # no temporary left


def test_a_model_with_tied_embeddings_saves(tmp_path: Path) -> None:
    model = build_model(ModelConfig.from_dict({**TINY.to_dict(), "tie_embeddings": True}), seed=0)
    sha = save_checkpoint(tmp_path / "tied.safetensors", model.state_dict())
    loaded = load_checkpoint(tmp_path / "tied.safetensors", expected_sha256=sha).tensors
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_bad_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'gonka\.sha256' is reserved"):
        save_checkpoint(tmp_path / "x.safetensors", _tensors(), {"gonka.sha256": "0" * 64})
    with pytest.raises(ValueError, match="must map str to str"):
        save_checkpoint(tmp_path / "x.safetensors", _tensors(), {"round": 1})  # type: ignore[dict-item]
    assert not (tmp_path / "x.safetensors").exists()


def test_flipped_data_byte_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, _tensors())
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # inside the tensor data: safetensors itself cannot notice
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="is corrupted: its tensors hash to"):
        load_checkpoint(path)


def test_truncated_or_missing_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, _tensors())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint file at"):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_unexpected_hash_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    sha = save_checkpoint(path, _tensors())
    with pytest.raises(CheckpointError, match=f"has sha256 {sha}, expected {'ab' * 32}"):
        load_checkpoint(path, expected_sha256="ab" * 32)


# --- training state: save, reload, continue == uninterrupted --------------------------------------

ROUND_STEPS = 3
CONFIG = InnerConfig(steps=ROUND_STEPS, lr=3e-3, warmup_steps=2, total_steps=20, micro_batch=4, seq_len=32)


def _round_batches(windows: Windows, round_index: int):
    ids = windows.assignment(
        epoch_seed=7, round_index=round_index, slot=0, max_slots=1, windows_per_host=CONFIG.windows_per_round
    )
    return windows.batches(ids, CONFIG.micro_batch)


def _train_round(trainer: InnerTrainer, windows: Windows, round_index: int) -> list[float]:
    # torch.randn stands for any RNG use between rounds (e.g. a random held-out sample seed).
    noise = torch.randn(())
    return [*trainer.run(_round_batches(windows, round_index)).losses, noise.item()]


def test_resume_gives_the_same_parameters_optimizer_state_and_losses(
    tmp_path: Path, small_windows: Windows
) -> None:
    torch.manual_seed(123)
    model = build_model(TINY, seed=0)
    trainer = InnerTrainer(model, CONFIG)
    uninterrupted = [_train_round(trainer, small_windows, r) for r in range(3)]

    torch.manual_seed(123)
    first = build_model(TINY, seed=0)
    first_trainer = InnerTrainer(first, CONFIG)
    resumed = [_train_round(first_trainer, small_windows, 0)]
    residual = {"lm_head.weight": torch.full((3,), 0.25)}
    save_training_state(
        tmp_path / "state.pt",
        model=first,
        trainer=first_trainer,
        data_position={"round": 1},
        extra={"ef": residual},
    )
    torch.manual_seed(999)  # whatever happens in between must not matter

    second = build_model(TINY, seed=1)  # different weights: all must come from the file
    second_trainer = InnerTrainer(second, CONFIG)
    state = load_training_state(tmp_path / "state.pt", model=second, trainer=second_trainer)
    assert state.step == ROUND_STEPS and state.data_position == {"round": 1}
    assert torch.equal(state.extra["ef"]["lm_head.weight"], residual["lm_head.weight"])
    resumed += [
        _train_round(second_trainer, small_windows, r) for r in range(state.data_position["round"], 3)
    ]

    assert resumed == uninterrupted
    for (name, a), b in zip(model.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    opt_a, opt_b = trainer.optimizer.state_dict(), second_trainer.optimizer.state_dict()
    for key, value in opt_a["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(value[field], opt_b["state"][key][field])
    assert opt_a["param_groups"] == opt_b["param_groups"]


def test_training_state_for_another_model_changes_nothing(tmp_path: Path) -> None:
    model = build_model(TINY, seed=0)
    save_training_state(tmp_path / "s.pt", model=model, trainer=InnerTrainer(model, CONFIG), data_position={})
    bigger = build_model(ModelConfig.from_dict({**TINY.to_dict(), "ffn_dim": 160}), seed=3)
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"holds a different model: model\.layers\.0\.mlp\.gate_proj\.weight is \(128, 48\)",
    ):
        load_training_state(tmp_path / "s.pt", model=bigger, trainer=InnerTrainer(bigger, CONFIG))
    assert all(torch.equal(before[k], v) for k, v in bigger.state_dict().items())


def test_damaged_training_state_is_an_error(tmp_path: Path) -> None:
    model = build_model(TINY, seed=0)
    trainer = InnerTrainer(model, CONFIG)
    path = tmp_path / "s.pt"
    save_training_state(path, model=model, trainer=trainer, data_position={})
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="not a readable training state file"):
        load_training_state(path, model=model, trainer=trainer)
    with pytest.raises(CheckpointError, match="no training state file"):
        load_training_state(tmp_path / "none.pt", model=model, trainer=trainer)


def test_tensors_view_reads_safetensors_bytes_without_copying_and_refuses_garbage() -> None:
    from safetensors.torch import save

    from training.checkpoint import tensors_view

    tensors = {"a": torch.randn(3, 4), "h": torch.randn(3).half(), "i": torch.arange(5), "e": torch.zeros(0, 2)}
    data = save(tensors, metadata={"k": "v"})
    view = tensors_view(data)
    assert set(view) == set(tensors) and all(torch.equal(view[n], tensors[n]) for n in tensors)
    assert view["a"].dtype == torch.float32 and view["i"].dtype == torch.int64
    header = int.from_bytes(data[:8], "little")
    with pytest.raises(CheckpointError, match="trailing bytes"):
        tensors_view(data + b"\0\0\0\0")
    with pytest.raises(CheckpointError, match="header claims"):
        tensors_view(data[:8] + data[8:20])
    with pytest.raises(CheckpointError, match="not JSON"):
        tensors_view(data[:8] + b"x" * header + data[8 + header :])
    with pytest.raises(CheckpointError, match="shorter than"):
        tensors_view(b"\1\2")
