"""Memory plan of a rig: what each GPU and the host hold when a model trains on N processes.

Per GPU, for P parameters (fp32 master weights, fp32 gradients, AdamW's two fp32 moments: 16 bytes a
parameter) split N ways when sharded, plus:

- *gathered*: with FSDP2 the layer being computed (and the next, prefetched) is all-gathered in the
  compute dtype and its gradient reduced from a full-size copy; replicated with bf16 autocast, the
  weights' bf16 copies live from forward to backward (2 bytes a parameter);
- *activations*: what autograd keeps for backward, per micro-batch, counted tensor by tensor for
  `training.model` (`activation_bytes`; checked against a measurement in tests/training/test_plan.py);
  with activation checkpointing only each layer's input, plus one layer recomputed during backward;
- a *workspace* of one layer's activations for the gradients flowing back through it.

Host RAM: the daemon's copy of the global model, the outer momentum and one aggregated update (fp32,
12 bytes a parameter, `gonka_node.host.follow`), plus the error-feedback residual (4 bytes a parameter,
split over the processes when sharded, one whole copy per process when replicated), plus a base per
process (the CUDA context and the Python runtime).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from training.model import ModelConfig

GIB = 1 << 30
USABLE = 0.92  # of a GPU's memory the plan may fill: the allocator's fragmentation and NCCL buffers
PROCESS_BASE_RAM = 3 * GIB  # host RAM a GPU process takes before any tensor (CUDA context, torch)
DAEMON_BYTES_PER_PARAM = 12  # global model + outer momentum + one aggregated update, fp32


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: the residual stream's and the matmuls' (bf16 on GPUs, fp32 on CPU)."""

    stream: int
    compute: int

    @classmethod
    def for_run(cls, device: str, sharded: bool) -> Dtypes:
        if device == "cpu":
            return cls(4, 4)
        # Replicated with autocast the stream stays fp32 (embeddings and adds are not autocast);
        # sharded, FSDP2 hands every layer bf16 weights, so the stream is bf16 too.
        return cls(2 if sharded else 4, 2)


def layer_activation_bytes(cfg: ModelConfig, dt: Dtypes) -> int:
    """Bytes autograd keeps per token for one decoder layer (`training.model.DecoderLayer`)."""
    d, f = cfg.dim, cfg.ffn_dim
    norms = 2 * (4 * d + dt.stream * d)  # fp32 input of x², and the normalised x the gain multiplies
    # q/k/v input; SDPA's q, repeated k and v, output; o_proj's input; 4-byte logsumexp per head
    attention = dt.compute * (6 * d) + 4 * cfg.n_heads
    mlp = dt.compute * (d + 4 * f)  # its input; gate, silu(gate), up, their product
    return norms + attention + mlp


def head_activation_bytes(cfg: ModelConfig, dt: Dtypes) -> int:
    """Per token outside the layers: final norm, lm_head's input, the fp32 log-softmax."""
    return 4 * cfg.dim + dt.stream * cfg.dim + dt.compute * cfg.dim + 4 * cfg.vocab_size


def activation_bytes(cfg: ModelConfig, tokens: int, dt: Dtypes, checkpoint: bool) -> int:
    """Kept for backward over one micro-batch of `tokens` tokens (batch × sequence)."""
    layer = layer_activation_bytes(cfg, dt)
    head = head_activation_bytes(cfg, dt)
    if checkpoint:  # each layer's input, and one layer's activations while it is recomputed
        return tokens * (cfg.n_layers * dt.stream * cfg.dim + head + layer)
    return tokens * (cfg.n_layers * layer + head)


def layer_params(cfg: ModelConfig) -> int:
    kv = cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim


@dataclass(frozen=True)
class RigPlan:
    preset: str
    params: int
    gpus: int
    gpu_mem_gb: float
    sharded: bool
    checkpoint_activations: bool
    micro_batch: int
    seq_len: int
    bytes_per_gpu: dict[str, int]  # parameters, gradients, optimizer, gathered, activations, workspace, total
    usable_bytes: int
    fits: bool
    max_micro_batch: int  # 0: not even one sequence fits
    host_ram_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_rig(
    cfg: ModelConfig,
    *,
    preset: str = "",
    gpus: int,
    gpu_mem_gb: float,
    micro_batch: int = 1,
    seq_len: int | None = None,
    sharded: bool | None = None,
    checkpoint_activations: bool | None = None,
    device: str = "cuda",
) -> RigPlan:
    """The plan for `cfg` on `gpus` devices of `gpu_mem_gb` GB. `sharded` / `checkpoint_activations`
    None: the cheapest setting that fits (replicated before sharded, no checkpointing before it)."""
    if gpus < 1 or micro_batch < 1 or gpu_mem_gb <= 0:
        raise ValueError("gpus and micro_batch must be >= 1 and gpu_mem_gb > 0")
    seq = seq_len or cfg.max_seq_len
    shard_options = [sharded] if sharded is not None else ([False, True] if gpus > 1 else [False])
    ckpt_options = [checkpoint_activations] if checkpoint_activations is not None else [False, True]
    candidates = [
        _plan(cfg, preset, gpus, gpu_mem_gb, micro_batch, seq, s, c, device)
        for c in ckpt_options for s in shard_options
    ]
    return next((p for p in candidates if p.fits), candidates[-1])


def _plan(
    cfg: ModelConfig, preset: str, gpus: int, gpu_mem_gb: float, micro_batch: int, seq: int,
    sharded: bool, checkpoint: bool, device: str,
) -> RigPlan:
    p = cfg.num_params()
    split = gpus if sharded else 1
    dt = Dtypes.for_run(device, sharded)
    fixed = {
        "parameters": 4 * p // split,
        "gradients": 4 * p // split,
        "optimizer": 8 * p // split,
        "gathered": _gathered(cfg, sharded, device),
        "workspace": seq * layer_activation_bytes(cfg, dt),  # one micro-batch row's layer, as gradients
    }
    per_sequence = activation_bytes(cfg, seq, dt, checkpoint)
    usable = int(gpu_mem_gb * 1e9 * USABLE)
    room = usable - sum(fixed.values())
    max_mb = max(0, room // per_sequence)
    sizes = {**fixed, "activations": micro_batch * per_sequence}
    sizes["total"] = sum(sizes.values())
    residual = 4 * p if sharded else 4 * p * gpus
    host = DAEMON_BYTES_PER_PARAM * p + residual + gpus * PROCESS_BASE_RAM
    return RigPlan(preset, p, gpus, gpu_mem_gb, sharded, checkpoint, micro_batch, seq, sizes, usable,
                   sizes["total"] <= usable, int(max_mb), host)


def _gathered(cfg: ModelConfig, sharded: bool, device: str) -> int:
    compute = 4 if device == "cpu" else 2
    if not sharded:
        return 0 if device == "cpu" else 2 * cfg.num_params()  # autocast's bf16 weight copies
    root = cfg.num_params() - cfg.n_layers * layer_params(cfg)  # embeddings, head, final norm: kept gathered
    # two layers gathered (computing one, prefetching the next), one layer's full gradient in compute
    # dtype plus its fp32 copy for the reduce-scatter
    return compute * root + layer_params(cfg) * (2 * compute + compute + 4)


def choose_sharding(cfg: ModelConfig, gpus: int, gpu_mem_bytes: int | None, micro_batch: int, seq_len: int) -> bool:
    """Shard when several GPUs cannot each hold the whole training state (CPU rigs: replicate)."""
    if gpus < 2 or gpu_mem_bytes is None:
        return False
    replicated = _plan(cfg, "", gpus, gpu_mem_bytes / 1e9, micro_batch, seq_len, False, False, "cuda")
    return not replicated.fits


def measure_activation_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, checkpoint: bool) -> int:
    """What autograd really keeps for backward over one micro-batch on this machine (CPU, fp32): the
    bytes of the distinct storages packed by `saved_tensors_hooks`, parameters excluded. The check of
    `activation_bytes` (tests/training/test_plan.py, scripts/bench_rig.py)."""
    import torch

    from training.model import build_model

    model = build_model(cfg, 0)
    model.checkpoint_layers = checkpoint
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model.loss(tokens, tokens)
    loss.backward()
    return sum(kept.values())
