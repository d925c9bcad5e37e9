"""The batching engine on the tiny model (real torch): sequences joining and leaving the batch step by
step give the tokens `training.generate` gives each alone; the queue, cancellation, retirement."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gonka_node.serve.batching import SlotCache, decode, prefill
from gonka_node.serve.engine import BatchEngine, EngineStopped, Saturated, Sequence
from gonka_node.serve.sampling import SamplingParams, nucleus, pick
from training.generate import KVCache, SamplingConfig, forward_cached, generate_tokens
from training.model import ModelConfig, build_model

TINY = ModelConfig.preset("tiny")  # max_seq_len 64: longer sequences slide their window


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(TINY, seed=3).eval()


class Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.tokens: list[int] = []
        self.reason: str | BaseException | None = None
        self.done = threading.Event()
        self.stop_after = stop_after

    def on_token(self, token: int, logprobs: object) -> bool:
        self.tokens.append(token)
        return self.stop_after is not None and len(self.tokens) >= self.stop_after

    def on_finish(self, reason: str) -> None:
        self.reason = reason
        self.done.set()

    def on_error(self, error: BaseException) -> None:
        self.reason = error
        self.done.set()


def sequence(prompt: list[int], max_tokens: int, temperature: float, seed: int, **kw: object) -> Sequence:
    return Sequence(prompt, max_tokens, SamplingParams(temperature=temperature, seed=seed), Recorder(**kw))


def wait(*sequences: Sequence) -> None:
    for s in sequences:
        assert s.sink.done.wait(60), "the engine did not finish a sequence"  # type: ignore[attr-defined]


def test_batched_sequences_equal_each_generated_alone(model, one_thread):
    """Prompts of several lengths (one longer than the window), greedy and sampled, some joining while
    others run: every sequence's tokens are those of `generate_tokens` for it alone."""
    cases = [(4, 0.0, 90), (11, 0.9, 120), (70, 1.0, 30), (2, 0.0, 5), (31, 0.5, 80), (6, 1.3, 150), (11, 0.7, 40)]
    made = [sequence([0, *((7 * i + j) % 250 + 1 for j in range(n))], mt, t, seed=i) for i, (n, t, mt) in
            enumerate(cases)]
    engine = BatchEngine(model, max_batch=4, max_waiting=16).start()
    try:
        engine.submit(made[:4])
        while engine.steps < 10:  # the others join a running batch
            time.sleep(0.001)
        engine.submit(made[4:])
        wait(*made)
    finally:
        engine.stop()
    assert engine.largest_batch == 4
    for s, (_, temperature, max_tokens) in zip(made, cases, strict=True):
        alone = generate_tokens(model, s.prompt, SamplingConfig(max_new_tokens=max_tokens, temperature=temperature,
                                                                seed=s.params.seed))
        assert (s.sink.tokens, s.sink.reason) == (alone, "length")  # type: ignore[attr-defined]


def test_stop_token_and_stop_from_the_sink(model, one_thread):
    greedy = generate_tokens(model, [0, 5, 6], SamplingConfig(max_new_tokens=12, temperature=0.0))
    by_token = sequence([0, 5, 6], 12, 0.0, 0)
    by_token.stop_token = greedy[4]
    by_sink = sequence([0, 5, 6], 12, 0.0, 0, stop_after=3)
    engine = BatchEngine(model, max_batch=2, max_waiting=2).start()
    try:
        engine.submit([by_token, by_sink])
        wait(by_token, by_sink)
    finally:
        engine.stop()
    first = greedy.index(greedy[4])
    assert (by_token.sink.tokens, by_token.sink.reason, by_token.generated) == (greedy[:first], "stop", first + 1)
    assert (by_sink.sink.tokens, by_sink.sink.reason) == (greedy[:3], "stop")


def test_a_full_queue_takes_nothing(model):
    engine = BatchEngine(model, max_batch=1, max_waiting=3)  # not started: nothing leaves the queue
    engine.submit([sequence([0, 1], 5, 0.0, 0) for _ in range(2)])
    with pytest.raises(Saturated):
        engine.submit([sequence([0, 1], 5, 0.0, 0) for _ in range(2)])
    assert engine.load() == (0, 2)


def test_a_cancelled_sequence_frees_its_slot(model, one_thread):
    engine = BatchEngine(model, max_batch=1, max_waiting=2).start()
    try:
        long, after = sequence([0, 1], 100_000, 1.0, 0), sequence([0, 2], 5, 1.0, 1)
        engine.submit([long, after])
        while len(long.sink.tokens) < 3:  # type: ignore[attr-defined]
            time.sleep(0.001)
        engine.cancel(long)
        wait(after)  # it had no slot until the cancelled one left
        assert after.sink.reason == "length" and not long.sink.done.is_set()  # type: ignore[attr-defined]
        # The engine drops a finished sequence from its batch just after telling its sink.
        until = time.monotonic() + 10
        while engine.load() != (0, 0) and time.monotonic() < until:
            time.sleep(0.01)
        assert engine.load() == (0, 0)
    finally:
        engine.stop()


def test_retire_finishes_what_it_holds_then_ends(model, one_thread):
    engine = BatchEngine(model, max_batch=1, max_waiting=4).start()
    held = [sequence([0, 3], 20, 1.0, i) for i in range(3)]
    engine.submit(held)
    engine.retire()
    with pytest.raises(EngineStopped):
        engine.submit([sequence([0, 3], 1, 1.0, 0)])
    assert engine.join(60)
    assert [s.sink.reason for s in held] == ["length"] * 3  # type: ignore[attr-defined]


def test_stop_fails_what_is_left(model):
    engine = BatchEngine(model, max_batch=1, max_waiting=4)
    left = [sequence([0, 3], 20, 1.0, i) for i in range(2)]
    engine.submit(left)
    engine.stop()  # before its thread ever ran: the thread is not started, nothing ran
    engine.start()  # a stopped engine's thread ends at once and fails what waits
    assert engine.join(10)
    assert all(isinstance(s.sink.reason, EngineStopped) for s in left)  # type: ignore[attr-defined]


def test_a_failing_step_fails_its_sequences_and_the_engine_goes_on(model, one_thread):
    engine = BatchEngine(model, max_batch=2, max_waiting=4).start()
    try:
        broken = sequence([0, 999], 5, 1.0, 0)  # no such token: the embedding lookup fails
        engine.submit([broken])
        wait(broken)
        assert isinstance(broken.sink.reason, IndexError)  # type: ignore[attr-defined]
        fine = sequence([0, 9], 5, 1.0, 0)
        engine.submit([fine])
        wait(fine)
        assert fine.sink.reason == "length"  # type: ignore[attr-defined]
    finally:
        engine.stop()


def test_nucleus_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.1, 0.25, 0.1]))
    kept = nucleus(logits, 1.0, 0.8).isfinite().tolist()
    assert kept == [False, True, False, True, True] or kept == [False, True, True, True, False]
    assert nucleus(logits, 1.0, 0.5).isfinite().tolist() == [False, True, False, False, False]
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=0.3)
    assert {pick(logits, params, params.config(), generator) for _ in range(20)} == {1}


def test_one_sequence_decodes_bit_for_bit_as_the_unbatched_generator(model, one_thread):
    """Alone, a decode step is `forward_cached`'s, to the bit; beside others of other lengths (a mask,
    other rows in the products) it is equal up to float rounding."""
    prompts = {0: [0, 1, 2, 3], 1: [0, *range(5, 25)], 2: [0, 4]}
    cache, alone = SlotCache(model, 3), {}
    for slot, tokens in prompts.items():
        prefill(model, cache, [slot], [tokens])
        unbatched = KVCache(TINY.n_layers)
        forward_cached(model, torch.tensor([tokens]), unbatched)
        alone[slot] = forward_cached(model, torch.tensor([[42]]), unbatched)[0, -1]
    single = decode(model, cache, [1], [len(prompts[1])], [42])[0]
    assert torch.equal(single, alone[1])
    batched = decode(model, cache, [0, 1, 2], [len(p) for p in prompts.values()], [42, 42, 42])
    for row, slot in enumerate(prompts):
        torch.testing.assert_close(batched[row], alone[slot], rtol=0, atol=1e-5)
