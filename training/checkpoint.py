"""Checkpoints: safetensors files named by a canonical sha256 of their tensors, and training state.

The canonical hash (defined in docs/PROTOCOL.md, "Checkpoint hash") covers names, dtypes, shapes and
values, and nothing about the file layout, so any writer that stores the same tensors gets the same
hash. It is what the chain records for every global checkpoint.

Training state (model, inner optimizer, schedule step, data position, RNG, and any extra state such
as the outer optimizer or an error-feedback residual) is a local file for crash recovery: save,
reload and continue gives bit-identical parameters and losses to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from training.durable import atomic_write
from training.inner import InnerTrainer

HASH_FORMAT = b"gonka-tensors-v1\n"
TRAINING_STATE_FORMAT = "gonka-training-state-v1"
META_SHA256 = "gonka.sha256"
META_FORMAT = "gonka.format"

DTYPE_NAMES: dict[torch.dtype, str] = {  # safetensors' own dtype names
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(Exception):
    """A checkpoint or training-state file is missing, unreadable, corrupted or not the one expected."""


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def canonical_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors in a fixed order; see docs/PROTOCOL.md, "Checkpoint hash"."""
    if sys.byteorder != "little":
        raise CheckpointError(
            "the canonical hash is defined on little-endian bytes; this machine is big-endian"
        )
    digest = hashlib.sha256(HASH_FORMAT)
    digest.update(_u64(len(tensors)))
    for name in sorted(tensors, key=lambda n: n.encode("utf-8")):
        tensor = tensors[name]
        if tensor.dtype not in DTYPE_NAMES:
            raise CheckpointError(
                f"tensor {name!r} has dtype {tensor.dtype}, which checkpoints do not support"
            )
        name_bytes, dtype_bytes = name.encode("utf-8"), DTYPE_NAMES[tensor.dtype].encode("ascii")
        digest.update(_u32(len(name_bytes)) + name_bytes + _u32(len(dtype_bytes)) + dtype_bytes)
        digest.update(_u32(tensor.dim()) + b"".join(_u64(d) for d in tensor.shape))
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(_u64(raw.numel()))
        digest.update(raw.numpy().data)
    return digest.hexdigest()


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; copies where two names share storage (e.g. tied embeddings)."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        cpu = tensor.detach().cpu().contiguous()
        key = (cpu.untyped_storage().data_ptr(), cpu.storage_offset())
        out[name] = cpu.clone() if key in seen else cpu
        seen.add(key)
    return out


def save_checkpoint(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> str:
    """Write `tensors` as safetensors (atomically) with their canonical sha256 in the metadata; return it."""
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"checkpoint metadata must map str to str; got {key!r}: {value!r}")
        if key.startswith("gonka."):
            raise ValueError(f"checkpoint metadata key {key!r} is reserved (prefix 'gonka.')")
    cpu = _cpu_tensors(tensors)
    sha256 = canonical_sha256(cpu)
    metadata |= {META_FORMAT: HASH_FORMAT.decode().strip(), META_SHA256: sha256}
    atomic_write(Path(path), lambda tmp: save_file(cpu, tmp, metadata=metadata))
    return sha256


def tensors_view(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in memory, as read-only views of `data` (no copy: what
    keeps the host's outer step within its model, momentum and one update, `gonka_node.host.follow`).
    Raises CheckpointError unless the header is well formed and the tensors tile the data exactly."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise CheckpointError(f"safetensors data is {len(view)} bytes, shorter than its 8-byte header length")
    (length,) = struct.unpack_from("<Q", view, 0)
    if length > len(view) - 8:
        raise CheckpointError(f"safetensors header claims {length} bytes, the data has {len(view) - 8}")
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
    except ValueError as exc:
        raise CheckpointError(f"safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    body = view[8 + length :]
    entries = sorted((_entry(name, info), name) for name, info in header.items())
    end = 0
    out = {}
    for (begin, stop, dtype, shape), name in entries:
        if begin != end:
            raise CheckpointError(f"safetensors tensor {name!r} starts at byte {begin}, expected {end}")
        out[name] = _frombuffer(body, begin, stop, dtype).reshape(shape)
        end = stop
    if end != len(body):
        raise CheckpointError(f"safetensors data has {len(body) - end} trailing bytes")
    return out


_DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def _entry(name: str, info: Any) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    try:
        dtype = _DTYPES_BY_NAME[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, stop = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"safetensors entry {name!r} is malformed: {info!r}") from None
    numel = 1
    for d in shape:
        numel *= d
    if min(shape, default=0) < 0 or stop - begin != numel * dtype.itemsize:
        raise CheckpointError(f"safetensors tensor {name!r}: {stop - begin} bytes for shape {shape} {dtype}")
    return begin, stop, dtype, shape


def _frombuffer(body: memoryview, begin: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    if stop == begin:
        return torch.empty(0, dtype=dtype)
    if begin % dtype.itemsize:  # misaligned for its type: the one case that copies
        return torch.frombuffer(bytearray(body[begin:stop]), dtype=dtype)
    with warnings.catch_warnings():  # read-only data: the views are only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(body, dtype=dtype, count=(stop - begin) // dtype.itemsize, offset=begin)


@dataclass(frozen=True)
class Checkpoint:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]  # the caller's metadata, without the reserved "gonka." keys
    sha256: str


def load_checkpoint(
    path: str | Path, expected_sha256: str | None = None, device: torch.device | str = "cpu"
) -> Checkpoint:
    """Read and verify a checkpoint: its recorded hash, and `expected_sha256` (e.g. from the chain)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}); it is truncated or corrupted: fetch it again"
        ) from exc
    sha256 = canonical_sha256(tensors)
    recorded = metadata.get(META_SHA256)
    if recorded is not None and recorded != sha256:
        raise CheckpointError(
            f"{path} is corrupted: its tensors hash to {sha256} but the file records {recorded}; fetch it again"
        )
    if expected_sha256 is not None and expected_sha256 != sha256:
        raise CheckpointError(
            f"{path} has sha256 {sha256}, expected {expected_sha256}: it is not the checkpoint asked for"
        )
    user_metadata = {k: v for k, v in metadata.items() if not k.startswith("gonka.")}
    return Checkpoint({k: v.to(device) for k, v in tensors.items()}, user_metadata, sha256)


@dataclass(frozen=True)
class TrainingState:
    step: int  # inner optimizer steps taken
    data_position: dict[str, Any]  # whatever the caller needs to resume its data stream
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. outer optimizer state, error-feedback residual


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_training_state(
    path: str | Path,
    *,
    model: torch.nn.Module,
    trainer: InnerTrainer,
    data_position: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Everything needed to continue training exactly where it stopped, in one file (atomic).

    `data_position` and `extra` hold tensors, numbers, strings, lists and dicts (loaded back with
    `torch.load(weights_only=True)`, which refuses arbitrary objects).
    """
    model_state = _cpu_tensors(model.state_dict())
    state = {
        "format": TRAINING_STATE_FORMAT,
        "model": model_state,
        "model_sha256": canonical_sha256(model_state),
        "trainer": trainer.state_dict(),
        "data_position": dict(data_position),
        "rng": _rng_state(),
        "extra": dict(extra or {}),
    }
    atomic_write(Path(path), lambda tmp: torch.save(state, tmp))


def _check_same_shapes(
    path: Path, saved: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> None:
    if set(saved) != set(current):
        raise CheckpointError(f"{path} holds a different model: its tensor names differ from this model's")
    for name, tensor in current.items():
        if saved[name].shape != tensor.shape or saved[name].dtype != tensor.dtype:
            raise CheckpointError(
                f"{path} holds a different model: {name} is {tuple(saved[name].shape)} {saved[name].dtype}, "
                f"this model has {tuple(tensor.shape)} {tensor.dtype}"
            )


def load_training_state(path: str | Path, *, model: torch.nn.Module, trainer: InnerTrainer) -> TrainingState:
    """Restore model, trainer and RNG from `save_training_state`; changes nothing if the file is bad."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no training state file at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types on damaged zips and pickles; all mean the same
        raise CheckpointError(f"{path} is not a readable training state file ({exc})") from exc
    if not isinstance(state, dict) or state.get("format") != TRAINING_STATE_FORMAT:
        raise CheckpointError(f"{path} is not a {TRAINING_STATE_FORMAT} file")
    if canonical_sha256(state["model"]) != state["model_sha256"]:
        raise CheckpointError(f"{path} is corrupted: the model tensors do not match their recorded sha256")
    _check_same_shapes(path, state["model"], model.state_dict())
    try:
        trainer.load_state_dict(state["trainer"])  # validates before it changes anything
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{path} holds optimizer state for a different model or config ({exc})"
        ) from exc
    model.load_state_dict(state["model"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return TrainingState(step=trainer.step, data_position=state["data_position"], extra=state["extra"])
