"""Autoregressive sampling from `Llama`, with a key/value cache.

Each new token costs one position's worth of compute: the keys and values of earlier positions are
kept per layer. The cached forward reuses the model's own modules and RoPE helpers, so its logits
equal `model(tokens)` (checked in tests/training/test_generate.py). When the context reaches
`max_seq_len`, the window slides: the cache is rebuilt from the last `max_seq_len` tokens, so the
next-token distribution is always that of `model(context[-max_seq_len:])`.

Sampling: temperature 0 is greedy (argmax, first index on ties, as HF's `do_sample=False`);
otherwise softmax(logits / temperature), optionally restricted to the top k, drawn from a
`torch.Generator` seeded by `seed`, so the same seed gives the same text on the same machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from training.model import Attention, Llama, apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = None  # None: the whole vocabulary
    seed: int = 0
    stop_token: int | None = None  # stop after emitting this token (it is returned)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k <= 0):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")


class KVCache:
    """Keys and values (batch, kv_heads, positions, head_dim) per layer, after RoPE."""

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        new_k = k if old_k is None else torch.cat((old_k, k), dim=2)
        new_v = v if old_v is None else torch.cat((old_v, v), dim=2)
        self.keys[layer], self.values[layer] = new_k, new_v
        return new_k, new_v


def _cached_attention(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
) -> torch.Tensor:
    batch, seq, _ = x.shape
    q = attn.q_proj(x).view(batch, seq, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, seq, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, seq, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    k, v = cache.extend(layer, apply_rope(k, cos, sin), v)
    q = apply_rope(q, cos, sin)
    if attn.n_kv_heads != attn.n_heads:
        repeats = attn.n_heads // attn.n_kv_heads
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    # A prefill starts at position 0 (plain causal mask); a decode step is one query that sees every
    # cached key, so it needs no mask. `forward_cached` allows only these two shapes.
    y = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1)
    return attn.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


@torch.no_grad()
def forward_cached(model: Llama, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, T, vocab) for `tokens` at positions cache.length.. ; appends their keys/values.

    Either a prefill (empty cache, any T) or a decode step (T = 1).
    """
    start, seq = cache.length, tokens.shape[1]
    if start > 0 and seq != 1:
        raise ValueError("a non-empty cache takes one token per step")
    if start + seq > model.config.max_seq_len:
        raise ValueError(f"position {start + seq} exceeds max_seq_len {model.config.max_seq_len}")
    cos, sin = rope_cos_sin(start + seq, model.config.head_dim, model.config.rope_theta, tokens.device)
    cos, sin = cos[start:], sin[start:]
    x = model.model.embed_tokens(tokens)
    for i, layer in enumerate(model.model.decoder_layers()):
        x = x + _cached_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, i)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length = start + seq
    return model.lm_head(model.model.norm(x))


def pick_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from a (vocab,) logits row."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    scaled = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scaled.numel():
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def iter_tokens(model: Llama, prompt: Sequence[int], sampling: SamplingConfig) -> Iterator[int]:
    """New tokens one at a time (the prompt is not repeated)."""
    if len(prompt) == 0:
        raise ValueError("the prompt must hold at least one token")
    vocab = model.config.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt tokens must lie in 0..{vocab - 1}")
    device = model.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    window = model.config.max_seq_len
    context, pending = list(prompt), list(prompt)
    cache = KVCache(model.config.n_layers)
    for _ in range(sampling.max_new_tokens):
        if cache.length + len(pending) > window:
            cache, pending = KVCache(model.config.n_layers), context[-window:]  # slide the window
        logits = forward_cached(model, torch.tensor([pending], device=device), cache)[0, -1]
        token = pick_token(logits, sampling, generator)
        yield token
        if token == sampling.stop_token:
            return
        context.append(token)
        pending = [token]


def generate_tokens(model: Llama, prompt: Sequence[int], sampling: SamplingConfig) -> list[int]:
    was_training = model.training
    model.eval()
    try:
        return list(iter_tokens(model, prompt, sampling))
    finally:
        model.train(was_training)


def generate_ids(model: Llama, prompt: str, sampling: SamplingConfig, tokenizer: Tokenizer | None = None) -> list[int]:
    """The ids continuing `prompt` as the start of a document, up to the end-of-text token (not returned).

    Training documents follow an end-of-text token (NUL for bytes), so the prompt is prefixed with one:
    an empty prompt asks for a whole new document. Default tokenizer: bytes.
    """
    from training.tokenizer import Bytes

    tokenizer = tokenizer or Bytes()
    if sampling.stop_token is None:
        sampling = dataclasses.replace(sampling, stop_token=tokenizer.eot_id)
    tokens = generate_tokens(model, [tokenizer.eot_id, *tokenizer.encode(prompt)], sampling)
    if tokens and tokens[-1] == sampling.stop_token:
        tokens = tokens[:-1]
    return tokens


def generate_text(model: Llama, prompt: str, sampling: SamplingConfig, tokenizer: Tokenizer | None = None) -> str:
    """`generate_ids`, decoded by the same tokenizer."""
    from training.tokenizer import Bytes

    tokenizer = tokenizer or Bytes()
    return tokenizer.decode(generate_ids(model, prompt, sampling, tokenizer))
