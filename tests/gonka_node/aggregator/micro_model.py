"""The micro Llama the whole-model close tests train and replay (test_close_model, test_shard_replay):
one layer, 16 wide, rounds of two inner steps on 8-token windows of a small stdlib corpus."""

from __future__ import annotations

import functools

import numpy as np
from stdlib_corpus import small_corpus_bytes

from training.data import Windows
from training.inner import InnerConfig
from training.model import Llama, ModelConfig, build_model

CFG = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=16)
SEQ, SEED, SLOTS = 8, 7, 8  # SLOTS: the engine kit's epochs' max_hosts
INNER = InnerConfig(steps=2, lr=1e-2, warmup_steps=0, total_steps=6, micro_batch=4, seq_len=SEQ, round_state="fresh")


def model() -> Llama:
    return build_model(CFG, SEED)


@functools.cache
def micro_windows() -> Windows:
    tokens = np.frombuffer(small_corpus_bytes(), dtype=np.uint8).astype(np.int64)[:30_000]
    return Windows(tokens, SEQ, heldout_fraction=0.1)
