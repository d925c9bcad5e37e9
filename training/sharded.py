"""Sharded state inside a rig (FSDP2): parameters, gradients and AdamW state split over its processes.

`shard_model` applies `torch.distributed.fsdp.fully_shard` to every decoder layer and to the model:
each process keeps rows [r·c, (r+1)·c) of every parameter (c = ceil(rows / N), FSDP2's dim-0 split),
the layer being computed is all-gathered and freed again, and gradients are reduce-scattered. On CUDA
the gathered copies are bf16 while the shards (the master weights, the optimizer's) and the gradient
reductions stay fp32 (`MixedPrecisionPolicy`); on CPU everything is fp32. Gradients are *summed* over
the rig (not averaged): the inner loop already divides by the global micro-batch count, as the
replicated rig's all-reduce does.

`ShardedWorker` is the rig's side of one host's DiLoCo round when its state is sharded. The
pseudo-gradient Δ = θ_global − θ_local is elementwise, so each process computes it for its rows; each
tensor then goes to one *owner* process, which adds its error-feedback residual, encodes the tensor's
payload part and keeps the new residual (`ErrorFeedback.compress_tensor`). Owners are a balanced
split of the tensors: no process ever holds the whole model, its whole Δ or its whole residual, only
one tensor at a time beyond its share. Payload parts are independent per tensor, so rank 0 writes the
codec header and concatenates the owners' parts in name order: the payload is byte for byte the one
a single process sends from the same Δ (tests/training/test_sharded.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from training.codecs import Codec
from training.data import Windows
from training.durable import durable_replace
from training.inner import InnerConfig, InnerResult
from training.model import Llama
from training.overlap import base_round
from training.residual_commit import commitment_layout, root_of_leaves, tensor_leaves
from training.rig import Rig
from training.rig_moves import RigMove
from training.streaming import StreamSchedule, merge_tensor
from training.worker import Assignment, Rebase, RoundFigures, SlotWorker, check_rebases

Parts = tuple[dict[str, int], dict[str, float], dict[str, list[bytes]]]  # one process's index, Σ Δ², leaves


@dataclass(frozen=True)
class ShardOptions:
    """How a sharded rig computes (host-local choices: the round's result does not depend on them
    beyond floating-point rounding)."""

    bf16: bool | None = None  # None: bf16 compute on CUDA, fp32 on CPU
    checkpoint_activations: bool = False
    compile: bool = False  # torch.compile each decoder layer (CUDA; on CPU it needs a C++ compiler)


def shard_model(model: Llama, mesh: DeviceMesh, options: ShardOptions = ShardOptions()) -> Llama:
    """FSDP2 over `mesh`, one unit per decoder layer plus the root (embeddings, final norm, head)."""
    bf16 = options.bf16 if options.bf16 is not None else mesh.device_type == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else (
        MixedPrecisionPolicy()
    )
    model.checkpoint_layers = options.checkpoint_activations
    for layer in model.model.layers:
        if options.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The root is needed again right at the start of backward: keeping it gathered saves one all-gather.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, like the replicated rig's all-reduce
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no PREMUL_SUM
    return model


class ShardedSync:
    """`GradSync` for an FSDP2 model: FSDP has reduce-scattered the gradients during backward, so each
    process holds its rows of the summed gradient; the norm adds the processes' partial sums."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.world_size = rig.world_size

    def all_reduce_grads(self, params: list[nn.Parameter]) -> None:
        return None

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return self.rig.all_reduce_sum(tensor)

    def grad_sq_total(self, local: Tensor) -> Tensor:
        return self.rig.all_reduce_sum(local)


@dataclass(frozen=True)
class TensorShard:
    shape: tuple[int, ...]
    start: int  # this process's first row
    stop: int
    chunk: int  # rows per process (the last ones may hold fewer, or none)
    owner: int  # the process that encodes this tensor and keeps its residual


class ShardLayout:
    """Which rows of every parameter each process holds (FSDP2's split) and who owns each tensor."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        owners = balanced_owners(shapes, world_size)
        self.tensors: dict[str, TensorShard] = {}
        for name in sorted(shapes):
            shape = tuple(shapes[name])
            chunk = math.ceil(shape[0] / world_size)
            start, stop = min(rank * chunk, shape[0]), min((rank + 1) * chunk, shape[0])
            self.tensors[name] = TensorShard(shape, start, stop, chunk, owners[name])

    @classmethod
    def of(cls, model: nn.Module, rank: int, world_size: int) -> ShardLayout:
        """The layout of a `shard_model` model, checked against the shards FSDP2 actually made."""
        params = dict(model.named_parameters())
        layout = cls({n: tuple(p.shape) for n, p in params.items()}, rank, world_size)
        for name, shard in layout.tensors.items():
            local = tuple(_local(params[name]).shape)
            if local != (shard.stop - shard.start, *shard.shape[1:]):
                raise RuntimeError(f"{name}: FSDP holds a {local} shard here, the layout expects rows "
                                   f"{shard.start}:{shard.stop} of {shard.shape}; torch changed its split")
        return layout

    def spec(self) -> dict[str, tuple[int, ...]]:
        return {n: t.shape for n, t in self.tensors.items()}

    def describe(self) -> dict[str, Any]:
        """What a saved state depends on: it loads only into the same split."""
        return {"world_size": self.world_size, "rank": self.rank, "spec": {n: list(s) for n, s in self.spec().items()}}

    def gather_to_owner(self, name: str, rows: Tensor) -> Tensor | None:
        """The whole tensor on its owner (None elsewhere), from every process's rows."""
        shard = self.tensors[name]
        padded = rows.new_zeros((shard.chunk, *shard.shape[1:]))
        padded[: rows.shape[0]] = rows
        if self.rank != shard.owner:
            dist.gather(padded, None, dst=shard.owner)
            return None
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.gather(padded, pieces, dst=shard.owner)
        return torch.cat(pieces)[: shard.shape[0]]


def balanced_owners(shapes: Mapping[str, tuple[int, ...]], world_size: int) -> dict[str, int]:
    """Largest tensors first, each to the least-loaded process (ties: lowest rank): a deterministic
    split whose largest share is at most the mean plus one tensor."""
    load = [0] * world_size
    owners = {}
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += math.prod(shapes[name])
    return owners


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class GlobalRows:
    """This process's rows of every tensor of a global-model safetensors file, read on demand (the file
    is memory-mapped: nothing beyond the rows asked for is read)."""

    def __init__(self, path: Path, layout: ShardLayout, device: torch.device) -> None:
        self.path, self.layout, self.device = path, layout, device

    def __enter__(self) -> GlobalRows:
        self._file = safe_open(str(self.path), "pt").__enter__()
        missing = sorted(set(self.layout.tensors) - set(self._file.keys()))
        if missing:
            raise ValueError(f"{self.path} lacks {missing[:3]}: not this model's checkpoint")
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(*exc)

    def __getitem__(self, name: str) -> Tensor:
        shard = self.layout.tensors[name]
        view = self._file.get_slice(name)
        if tuple(view.get_shape()) != shard.shape:
            raise ValueError(f"{self.path}: {name} has shape {tuple(view.get_shape())}, the model {shard.shape}")
        return view[shard.start : shard.stop].to(self.device)


class ShardedWorker(SlotWorker):
    """A host slot's rounds on an FSDP2 rig. Call every method in every process of the rig."""

    def __init__(
        self,
        model: Llama,
        inner: InnerConfig,
        codec: Codec,
        windows: Windows,
        assignment: Assignment,
        rig: Rig,
        ef_decay: float = 1.0,
        first_round: int = 1,
        stream: StreamSchedule | None = None,
        overlap: str = "off",
    ) -> None:
        # the residuals `feedback` holds are those of the tensors this process owns
        super().__init__(model, inner, codec, windows, assignment, ef_decay, first_round, sync=ShardedSync(rig))
        self.rig = rig
        self.layout = ShardLayout.of(model, rig.rank, rig.world_size)
        # A streamed epoch (training/streaming.py): rounds train on from the rig's own model (its rows here),
        # landing synced fragments first; `landed` as `DiLoCoWorker.landed` (None: no own model yet).
        self.stream, self.overlap = stream, overlap
        self.landed: int | None = None

    def run_round(
        self, round_index: int, global_path: Path, payload_path: Path, on_step: Callable[[int, float], None] | None = None,
        skipped: Sequence[int] = (), moves: Sequence[RigMove] = (),
    ) -> RoundFigures:
        """Train `round_index` from the global model in `global_path`; rank 0 writes the payload. A streamed
        round trains on from the rig's own model and sends its fragment (`skipped`: `_start`). `moves`: an
        eager round's moves onto other bases partway (`_move`), its Δ measured from the last one."""
        segments = check_rebases([Rebase(m.step, lambda: {}) for m in moves], self.trainer.config.steps)
        with contextlib.ExitStack() as files:
            rows = files.enter_context(GlobalRows(global_path, self.layout, self.rig.device))
            names = self._start(round_index, rows, skipped)
            batches = iter(self.rig.shard(self.start_round(round_index, self.trainer.config.micro_batch)))
            parts_run = []
            for move, segment in zip((None, *moves), segments, strict=True):
                if move is not None:
                    rows = self._move(rows, move, files)
                parts_run.append(self.trainer.run(batches, steps=segment, on_step=on_step))
            result = InnerResult.joined(parts_run)
            codec = self.round_codec(round_index)
            parts = part_path(payload_path, self.rig.rank)
            mine = self._encode_parts(rows, codec, parts, names)
        return self._finish(round_index, result, codec, parts, mine, payload_path, names)

    @torch.no_grad()
    def _move(self, base: GlobalRows, move: RigMove, files: contextlib.ExitStack) -> GlobalRows:
        """`training.worker.move_onto` on this process's rows: θ ← θ + (target − base), or + the shift the
        daemon took already (`Shifted`); elementwise, so the rows move as one process's whole tensors do.
        Returns the target's rows (the base from here on)."""
        at, shift = move.wait()
        target = files.enter_context(GlobalRows(at, self.layout, self.rig.device))
        moved = None if shift is None else files.enter_context(GlobalRows(shift, self.layout, self.rig.device))
        for name, param in self.model.named_parameters():
            local = _local(param)
            if moved is None:
                local.add_(target[name].to(local.device, torch.float32) - base[name].to(local.device, torch.float32))
            else:
                local.add_(moved[name].to(local.device, torch.float32))
        return target

    def _start(self, round_index: int, rows: GlobalRows, skipped: Sequence[int]) -> list[str] | None:
        """Bring the model to where the round trains from: the global model (`rows`), or in a streamed
        epoch the rig's own model with the fragments synced since its last landing taken back from the
        global model, which is the one after the round's base (`DiLoCoWorker.network_stream_round`, row
        by row). Returns the names of the tensors the round sends (None: all)."""
        if self.stream is None:
            self._load(rows)
            return None
        held = base_round(round_index, self.overlap)
        if self.landed is None:
            self._load(rows)
        else:
            params = dict(self.model.named_parameters())
            for fragment in self.stream.landing(self.landed, held, skipped=skipped):
                for name in fragment.names:
                    merge_tensor(_local(params[name]), rows[name], self.stream.mix)
        self.landed = held if self.landed is None else max(self.landed, held)
        return list(self.stream.fragment_of(round_index).names)

    @torch.no_grad()
    def _load(self, rows: GlobalRows) -> None:
        for name, param in self.model.named_parameters():
            _local(param).copy_(rows[name])

    @torch.no_grad()
    def _encode_parts(self, rows: GlobalRows, codec: Codec, path: Path, names: Sequence[str] | None = None) -> Parts:
        """Δ's rows here, each tensor gathered on its owner, which appends its payload part to `path`.
        Returns {name: part length}, {name: Σ Δ²} and {name: its chunks' leaves of the new residual} for
        the tensors this process owns: rank 0 joins the leaves into the root (32 bytes per 4096 elements
        travel, not the residual, and each owner hashes only its own tensors). `names`: the tensors sent
        (a streamed round's fragment); the leaves cover every owned tensor, so the root is the whole
        residual's, the others' residuals as earlier rounds left them."""
        params = dict(self.model.named_parameters())
        commit = commitment_layout(self.layout.spec(), codec)
        index: dict[str, int] = {}
        squares: dict[str, float] = {}
        leaves: dict[str, list[bytes]] = {}
        with path.open("wb") as out:
            for name in sorted(params if names is None else names):  # every process takes part in every gather, in one order
                delta = rows[name].float() - _local(params[name]).detach().float()
                whole = self.layout.gather_to_owner(name, delta)
                if whole is None:
                    continue
                # whole: read no more (the residual is made in it); its squares as DiLoCoWorker's delta_norm
                part = self.feedback.compress_tensor(name, whole.cpu(), codec, consume=True, squares=squares)
                out.write(part)
                index[name] = len(part)
                leaves[name] = tensor_leaves(self.feedback.residual, commit, name)
        for name, shard in self.layout.tensors.items():
            if shard.owner == self.rig.rank and name not in leaves:  # not sent this round: its residual as it was
                leaves[name] = tensor_leaves(self.feedback.residual, commit, name)
        return index, squares, leaves

    def _finish(
        self, round_index: int, result: InnerResult, codec: Codec, parts: Path, mine: Parts, payload_path: Path,
        names: Sequence[str] | None = None,
    ) -> RoundFigures:
        gathered = self.rig.gather_object(mine)
        norm, root = math.nan, b""
        if self.rig.is_rank0:
            assert gathered is not None
            spec = self.layout.spec()
            header = codec.header(spec if names is None else {n: spec[n] for n in names})
            norm = assemble_payload(header, [(i, s) for i, s, _ in gathered], payload_path)
            leaves = {name: ls for _, _, owned in gathered for name, ls in owned.items()}
            root = root_of_leaves([leaf for name in sorted(leaves) for leaf in leaves[name]])
        self.rig.barrier()  # the parts are read before anyone deletes theirs
        parts.unlink(missing_ok=True)
        return RoundFigures(round_index, norm, result.mean_loss, result.last_loss, result.tokens, result.seconds, root)

    def reset(self) -> None:
        """The state before the epoch's first round: fresh AdamW, schedule at 0, no residual (nor own model)."""
        self.trainer.restart(0)
        self.feedback.residual = {}
        self.landed = None

    def state_dict(self) -> dict[str, Any]:
        """This process's share: its optimizer rows (none in a `fresh` epoch, whose rounds restart AdamW:
        `DiLoCoWorker.state_dict`), its tensors' residuals, the layout they fit."""
        inner: dict[str, Any] = {"step": self.trainer.step}
        if self.trainer.config.round_state != "fresh":
            optimizer = self.trainer.optimizer.state_dict()
            optimizer["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in optimizer["state"].items()}
            inner["optimizer"] = optimizer
        state = {"layout": self.layout.describe(), "inner": inner, "feedback": self.feedback.state_dict()}
        if self.landed is not None:  # a streamed epoch: this process's rows of its own model (saved before it trains on)
            state["stream"] = {"landed": self.landed,
                               "model": {n: _local(p).detach() for n, p in self.model.named_parameters()}}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("layout") != self.layout.describe():
            saved = state.get("layout", {})
            raise ValueError(
                f"this rig state was saved by rank {saved.get('rank')} of {saved.get('world_size')} processes "
                f"for another split; this is rank {self.rig.rank} of {self.rig.world_size}"
            )
        stream = state.get("stream")
        if stream is not None and set(stream["model"]) != set(self.layout.tensors):  # checked before anything loads
            raise ValueError("this rig state's own model is not this model's")
        inner = dict(state["inner"])
        if "optimizer" in inner:
            optimizer = dict(inner["optimizer"])
            params = [p for group in self.trainer.optimizer.param_groups for p in group["params"]]
            optimizer["state"] = {
                i: {k: _like(params[int(i)], v) for k, v in s.items()} for i, s in optimizer["state"].items()
            }
            inner["optimizer"] = optimizer
        self.trainer.load_state_dict(inner)
        self.feedback.load_state_dict(state["feedback"])
        self.landed = None if stream is None else int(stream["landed"])
        if stream is not None:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    _local(param).copy_(stream["model"][name])

    def held_bytes(self) -> dict[str, int]:
        return held_bytes(self.model, self.trainer.optimizer)


def _like(param: Tensor, value: Tensor) -> Tensor:
    """A saved local optimizer tensor back as a shard of `param` (scalars such as `step` stay plain)."""
    if isinstance(param, DTensor) and value.dim() > 0:
        return DTensor.from_local(
            value.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return value


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this process holds of parameters, gradients (fp32, shaped like the parameters from backward
    to the optimizer step) and optimizer state: the "state" a rig splits."""
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    opt = sum(
        _local(v).numel() * _local(v).element_size()
        for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0
    )
    return {"parameters": params, "gradients": params, "optimizer": opt}


def part_path(payload_path: Path, rank: int) -> Path:
    """Where process `rank` writes the payload parts of the tensors it owns."""
    return payload_path.with_name(f"{payload_path.name}.part{rank}")


def assemble_payload(header: bytes, indexes: list[tuple[dict[str, int], dict[str, float]]], out: Path) -> float:
    """Write the payload (header, then every tensor's part in name order) from the processes' part
    files into `out` (atomically); returns the norm of Δ summed as one process sums it."""
    where: dict[str, tuple[Path, int, int]] = {}
    squares: dict[str, float] = {}
    for rank, (index, sq) in enumerate(indexes):
        offset = 0
        source = part_path(out, rank)
        for name in sorted(index):
            where[name] = (source, offset, index[name])
            offset += index[name]
        squares.update(sq)
    staged = out.with_name(out.name + ".tmp")
    with staged.open("wb") as sink:
        sink.write(header)
        for name in sorted(where):
            sink.write(_read_range(*where[name]))
    durable_replace(staged, out)
    return math.sqrt(sum(squares[name] for name in sorted(squares)))


def _read_range(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)
