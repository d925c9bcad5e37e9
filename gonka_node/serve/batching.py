"""The KV-cached generator of `training/generate.py`, run for many sequences in one forward per step.

Every sequence owns a slot of a preallocated cache (slots, kv_heads, max_seq_len, head_dim) per layer,
so sequences of different lengths join and leave the batch between steps without copying anyone
else's keys. A sequence enters with a prefill (`training.generate.forward_cached` on a fresh cache,
copied into its slot: alone, the very computation `checkpoint generate` does; sequences of one length
share one prefill); after that, one
`decode` call advances every running sequence by one token: each row attends to its own slot up to
its own position (a boolean mask where positions differ, none where they are equal, as in the
unbatched decode). When a sequence reaches `max_seq_len` it is prefilled again from its last
`max_seq_len` tokens, the sliding window of `training.generate.iter_tokens`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.generate import KVCache, forward_cached
from training.model import Attention, Llama, apply_rope, rope_cos_sin


class SlotCache:
    """Keys and values (after RoPE) of up to `slots` sequences, and the RoPE tables for every position."""

    def __init__(self, model: Llama, slots: int) -> None:
        config, weight = model.config, model.lm_head.weight
        shape = (slots, config.n_kv_heads, config.max_seq_len, config.head_dim)
        self.keys = [torch.zeros(shape, device=weight.device, dtype=weight.dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        # Row p of a table is the same whatever the table's length (an outer product), so one table of
        # max_seq_len rows gives what `rope_cos_sin(p + 1)[p]` gives in the unbatched decode.
        self.cos, self.sin = rope_cos_sin(config.max_seq_len, config.head_dim, config.rope_theta, weight.device)
        self.slots = slots

    def store(self, slot: int, cache: KVCache, row: int) -> None:
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            assert k is not None and v is not None, "a prefill fills every layer"
            self.keys[layer][slot, :, : cache.length] = k[row]
            self.values[layer][slot, :, : cache.length] = v[row]


@torch.no_grad()
def prefill(model: Llama, cache: SlotCache, slots: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """Logits (B, vocab) after each row of `tokens` (rows of one length, at positions 0..), whose keys and
    values now fill the row's slot."""
    fresh = KVCache(model.config.n_layers)
    logits = forward_cached(model, torch.tensor(tokens, device=model.lm_head.weight.device), fresh)
    for row, slot in enumerate(slots):
        cache.store(slot, fresh, row)
    return logits[:, -1]


@torch.no_grad()
def decode(model: Llama, cache: SlotCache, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits (B, vocab): row i is `tokens[i]` at `positions[i]` of the sequence in `slots[i]`."""
    device = model.lm_head.weight.device
    slot_index = torch.tensor(slots, device=device)
    position_index = torch.tensor(positions, device=device)
    span = max(positions) + 1  # keys past every row's position are never read
    mask = None
    if min(positions) != span - 1:
        mask = (torch.arange(span, device=device)[None, :] <= position_index[:, None])[:, None, None, :]
    cos = cache.cos[position_index][:, None, None, :]
    sin = cache.sin[position_index][:, None, None, :]
    x = model.model.embed_tokens(torch.tensor(tokens, device=device)[:, None])
    for i, layer in enumerate(model.model.decoder_layers()):
        where = _Rows(cache.keys[i], cache.values[i], slot_index, position_index, span, mask)
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, where)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[:, 0]


class _Rows:
    """One layer's slot cache seen through the batch's (slot, position) rows."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, span: int,
        mask: torch.Tensor | None,
    ) -> None:
        self.keys, self.values, self.slots, self.positions = keys, values, slots, positions
        self.span, self.mask = span, mask

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new key/value (B, kv_heads, 1, head_dim) at its position; return its keys and
        values up to the batch's span (B, kv_heads, span, head_dim)."""
        self.keys[self.slots, :, self.positions] = k[:, :, 0]
        self.values[self.slots, :, self.positions] = v[:, :, 0]
        # narrow, then gather whole slots: a copy of only the span, faster than one advanced index
        return (self.keys.narrow(2, 0, self.span).index_select(0, self.slots),
                self.values.narrow(2, 0, self.span).index_select(0, self.slots))


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: _Rows) -> torch.Tensor:
    batch = x.shape[0]
    q = attn.q_proj(x).view(batch, 1, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    k, v = rows.append(apply_rope(k, cos, sin), v)
    q = apply_rope(q, cos, sin)
    if attn.n_kv_heads != attn.n_heads:
        repeats = attn.n_heads // attn.n_kv_heads
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.mask)
    return attn.o_proj(y.transpose(1, 2).reshape(batch, 1, -1))
