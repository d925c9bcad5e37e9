"""One token per row, as `training.generate.pick_token` draws it, plus nucleus (top-p) and logprobs.

Each sequence has its own `torch.Generator` seeded with its seed, so its draws do not depend on
which other requests share the batch: with the same seed, prompt and settings, a served completion
is the one `gonka-node checkpoint generate` prints (temperature 0 is greedy, as there). Top-p keeps
the most likely tokens whose probability mass before them is below p (at least one), then draws as
`pick_token` does. Logprobs are the model's own (log-softmax of the raw logits, before temperature
and top-p), as OpenAI's completions report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.generate import SamplingConfig, pick_token


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    logprobs: int | None = None  # how many alternatives to report per token (0: only the chosen one)

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        SamplingConfig(temperature=self.temperature)  # the generator's own checks

    def config(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=0, temperature=self.temperature, seed=self.seed)


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the chosen token
    top: tuple[tuple[int, float], ...]  # the most likely tokens, most likely first


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """`logits` with every token outside the top-p nucleus (at this temperature) set to -inf."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # mass before it already reaches p
    drop = torch.zeros_like(outside).scatter(-1, order, outside)
    return logits.masked_fill(drop, float("-inf"))


def pick(
    logits: torch.Tensor, params: SamplingParams, config: SamplingConfig, generator: torch.Generator | None
) -> int:
    """One token from a (vocab,) logits row."""
    if params.top_p < 1.0 and params.temperature > 0:
        logits = nucleus(logits, params.temperature, params.top_p)
    return pick_token(logits, config, generator)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprobs(float(logprobs[token]), tuple(zip(indices.tolist(), values.tolist(), strict=True)))
