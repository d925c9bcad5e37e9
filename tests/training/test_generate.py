import pytest
import torch
from model_helpers import sharp_model

from training.generate import (
    KVCache,
    SamplingConfig,
    forward_cached,
    generate_text,
    generate_tokens,
    pick_token,
)
from training.model import Llama, ModelConfig

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=24)


def reference_greedy(model: Llama, prompt: list[int], steps: int) -> list[int]:
    """No cache: the full forward over the last max_seq_len tokens, every step."""
    context = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([context[-model.config.max_seq_len :]]))[0, -1]
            context.append(int(logits.argmax()))
    return context[len(prompt) :]


def test_cached_forward_equals_full_forward(one_thread):
    model = sharp_model(CFG)
    tokens = torch.randint(0, 256, (2, CFG.max_seq_len), generator=torch.Generator().manual_seed(0))
    cache = KVCache(CFG.n_layers)
    steps = [forward_cached(model, tokens[:, :9], cache)]
    steps += [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(9, CFG.max_seq_len)]
    assert cache.length == CFG.max_seq_len
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(steps, dim=1), model(tokens), atol=1e-5, rtol=1e-5)


def test_cached_forward_refuses_bad_shapes():
    model = sharp_model(CFG)
    cache = KVCache(CFG.n_layers)
    forward_cached(model, torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="one token per step"):
        forward_cached(model, torch.zeros(1, 2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        forward_cached(model, torch.zeros(1, CFG.max_seq_len + 1, dtype=torch.long), KVCache(CFG.n_layers))


@pytest.mark.parametrize("prompt_len", [1, 5, CFG.max_seq_len + 7])
def test_greedy_equals_reference_across_the_window(one_thread, prompt_len):
    # 40 new tokens from a 24-token window: the cache is rebuilt as the window slides.
    model = sharp_model(CFG)
    prompt = torch.randint(1, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    ours = generate_tokens(model, prompt, SamplingConfig(max_new_tokens=40, temperature=0.0))
    assert ours == reference_greedy(model, prompt, 40)


def test_sampling_is_seeded(one_thread):
    model = sharp_model(CFG)
    prompt = [0, *b"abc"]
    runs = [
        generate_tokens(model, prompt, SamplingConfig(max_new_tokens=30, temperature=1.5, seed=seed))
        for seed in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0] != reference_greedy(model, prompt, 30)


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, -2.0, 3.0])
    generator = torch.Generator().manual_seed(0)
    picks = {pick_token(logits, SamplingConfig(temperature=5.0, top_k=2), generator) for _ in range(200)}
    assert picks == {1, 3}
    picks = {pick_token(logits, SamplingConfig(temperature=5.0), generator) for _ in range(400)}
    assert picks == set(range(6))  # a high temperature over the whole vocabulary reaches every token
    assert pick_token(logits, SamplingConfig(temperature=0.0, top_k=3), generator) == 1


def test_stop_token_ends_generation(one_thread):
    model = sharp_model(CFG)
    prompt = [0, *b"xyz"]
    free = generate_tokens(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0))
    stop = free[4]
    stopped = generate_tokens(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0, stop_token=stop))
    assert stopped == free[: free.index(stop) + 1]


def test_generate_text_starts_a_document(one_thread):
    model = sharp_model(CFG)
    sampling = SamplingConfig(max_new_tokens=20, temperature=0.0, stop_token=-1)  # never stops early
    tokens = generate_tokens(model, [0, *b"hi"], sampling)
    text = generate_text(model, "hi", sampling)
    assert text == bytes(tokens).decode("utf-8", errors="replace")
    # Default: stop at the document separator and leave it out.
    default = generate_text(model, "hi", SamplingConfig(max_new_tokens=20, temperature=0.0))
    expected = tokens[: tokens.index(0)] if 0 in tokens else tokens
    assert default == bytes(expected).decode("utf-8", errors="replace")


def test_bad_settings_are_refused():
    model = sharp_model(CFG)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=-1)
    with pytest.raises(ValueError, match="at least one token"):
        generate_tokens(model, [], SamplingConfig())
    with pytest.raises(ValueError, match=r"0\.\.255"):
        generate_tokens(model, [256], SamplingConfig())
    assert generate_tokens(model, [1], SamplingConfig(max_new_tokens=0)) == []
