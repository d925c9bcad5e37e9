"""A Llama-style decoder-only transformer in one readable file.

RMSNorm, rotary position embeddings, SwiGLU and causal scaled-dot-product attention with grouped
query attention (GQA). Parameter names and the rotary convention (`rotate_half`, no q/k permutation)
equal Hugging Face's `LlamaForCausalLM`, so exporting a checkpoint to HF is a renaming-free copy with
identical logits.

`build_model(cfg, seed)` initialises every tensor from its own `torch.Generator`, seeded from
(seed, tensor name), so the same seed gives the same parameters on any machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

INIT_STD = 0.02
Device = torch.device | str | None


def check_fields(cls: type, data: dict[str, Any]) -> None:
    """Refuse keys that are not fields of the config dataclass `cls` (a typo must not pass silently)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # < n_heads means grouped-query attention; each kv head serves n_heads/n_kv_heads q heads
    ffn_dim: int
    max_seq_len: int
    vocab_size: int = 256  # the byte tokenizer's vocabulary
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (equals `Llama(cfg).num_params()`)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attention + mlp + 2 * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * per_layer + self.dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        check_fields(cls, data)
        return cls(**data)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]

    def to_hf_config(self) -> dict[str, Any]:
        """The matching Hugging Face `LlamaConfig` fields, for a later export."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }


PRESETS: dict[str, ModelConfig] = {
    # ~75k parameters: unit tests.
    "tiny": ModelConfig(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64),
    # ~1.0M parameters: the devnet, trains visibly on 2 CPU cores in a couple of minutes.
    "devnet": ModelConfig(dim=128, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128),
    # ~9.6M parameters: the aggregator benchmark.
    "10m": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=512),
    # ~12.8M parameters: the smallest rig benchmark (scripts/bench_rig.py) and the planner's CPU check.
    "12m": ModelConfig(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=256),
    # The sizes a rig of 1-8 GPUs trains (Llama 3 shapes with the byte vocabulary; scripts/plan_rig.py).
    # ~1.0B parameters (Llama-3.2-1B's body): one GPU, replicated or sharded.
    "1b": ModelConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=2048, rope_theta=500000.0
    ),
    # ~7.0B parameters (Llama-3-8B's body; its 128k vocabulary is most of the other billion).
    "8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=2048, rope_theta=500000.0
    ),
    # ~30.2B parameters: Llama 3 proportions (head_dim 128, 8 kv heads, ffn ≈ 3.7 × dim) at 60 layers;
    # needs its state sharded over 8 × 80 GB.
    "30b": ModelConfig(
        dim=6144, n_layers=60, n_heads=48, n_kv_heads=8, ffn_dim=22528, max_seq_len=2048, rope_theta=500000.0
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as HF does, so bf16 runs stay stable.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq_len, head_dim) in fp32, frequencies repeated twice (HF's layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    positions = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by position: pairs are (i, i + head_dim/2), not interleaved."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # kv head j serves q heads j*r .. j*r+r-1: HF's repeat_kv layout.
            repeats = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, device=device)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, device=device)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.self_attn = Attention(cfg, device)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.mlp = MLP(cfg, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's `LlamaModel`: embeddings, layers, final norm (named `model.` inside `Llama`)."""

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device)

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` as what they are: an nn.ModuleList reads as plain Modules to a type checker."""
        return cast(Sequence[DecoderLayer], self.layers)


class Llama(nn.Module):
    """The full model. Use `build_model` for a seeded init; `Llama(cfg)` uses PyTorch's default one."""

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.config = cfg
        # Activation checkpointing: keep only each layer's input for backward and recompute the rest
        # (a third more compute for ~1/20 of the activation memory; what lets 30B train on 80 GB GPUs).
        self.checkpoint_layers = False
        self.model = LlamaBody(cfg, device)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (batch, seq), got {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = rope_cos_sin(seq, self.config.head_dim, self.config.rope_theta, tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            if self.checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, computed in fp32."""
        logits = self(tokens)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once


def _is_residual_projection(name: str) -> bool:
    return name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"gonka-init-v1:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """GPT-2/Llama init: N(0, 0.02); residual projections N(0, 0.02/sqrt(2*n_layers)); norms 1.

    Each tensor draws from its own CPU generator seeded by (seed, name), in fp64, then rounds to the
    parameter's dtype: the draw does not depend on the device, the thread count or the order of
    initialisation, and rounding to fp32 absorbs last-ulp differences between libm implementations.
    """
    residual_std = INIT_STD / math.sqrt(2 * model.config.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            param.fill_(1.0)
            continue
        std = residual_std if _is_residual_projection(name) else INIT_STD
        generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
        values = torch.empty(param.shape, dtype=torch.float64).normal_(0.0, std, generator=generator)
        param.copy_(values.to(param.dtype))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Llama:
    """A freshly initialised model, identical for the same (cfg, seed) on any machine."""
    model = Llama(cfg)  # PyTorch's default init runs first (cheap); every tensor is overwritten below
    init_weights(model, seed)
    return model.to(device)
