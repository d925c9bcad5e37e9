"""DiLoCoWorker: a round's payload is what the aggregator decodes, with per-round codec state."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from training.codecs import CodecError, get_codec, round_seed, spec_of
from training.data import Windows
from training.inner import InnerConfig
from training.model import ModelConfig, build_model
from training.worker import Assignment, DiLoCoWorker

CFG = ModelConfig.preset("tiny")


def windows() -> Windows:
    rng = np.random.RandomState(0)
    return Windows(rng.randint(0, 256, size=40_000).astype(np.uint8), seq_len=16, heldout_fraction=0.1)


def worker(codec: str, seed: int = 5) -> DiLoCoWorker:
    inner = InnerConfig(steps=3, lr=1e-3, warmup_steps=1, total_steps=30, micro_batch=2, seq_len=16)
    return DiLoCoWorker(build_model(CFG, 0), inner, get_codec(codec), windows(), Assignment(seed, 1, 4))


def global_params() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(CFG, 0).named_parameters()}


def test_shared_mask_payload_decodes_only_with_its_rounds_codec() -> None:
    name = "mask:stride=2,bits=2"
    params = global_params()
    spec = spec_of(params)
    result = worker(name).train_round(3, params)
    own = get_codec(name).for_round(round_seed(5, 3))
    decoded = own.decode(result.payload, spec)
    assert set(decoded) == set(params)
    with pytest.raises(CodecError):  # another round's mask (what a seedless decoder would use)
        get_codec(name).for_round(round_seed(5, 4)).decode(result.payload, spec)


def test_state_dict_resumes_the_next_round_bit_for_bit() -> None:
    params = global_params()
    a = worker("int8")
    a.train_round(1, params)
    b = worker("int8")
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # a restarted host: AdamW state and residual
    assert a.train_round(2, params).payload == b.train_round(2, params).payload
