"""`training.checkpoint` behind the aggregator's narrow `CheckpointIO` (hashes as 32 raw bytes)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from training.checkpoint import canonical_sha256, load_checkpoint, save_checkpoint


class TrainingCheckpoints:
    """Safetensors files with the canonical tensor sha256 (the hash recorded on chain)."""

    def save(self, path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        return bytes.fromhex(save_checkpoint(path, tensors, metadata))

    def load(self, path: Path, expected_sha256: bytes | None = None) -> dict[str, Tensor]:
        expected = None if expected_sha256 is None else expected_sha256.hex()
        return load_checkpoint(path, expected_sha256=expected).tensors

    def sha256(self, tensors: Mapping[str, Tensor]) -> bytes:
        return bytes.fromhex(canonical_sha256(tensors))
