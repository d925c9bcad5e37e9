import math

import pytest
import torch
import torch.nn.functional as F

from training.model import (
    PRESETS,
    Attention,
    Llama,
    ModelConfig,
    apply_rope,
    build_model,
    rope_cos_sin,
)

TINY = ModelConfig.preset("tiny")

# LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, attention_bias=False, mlp_bias=False)).state_dict() keys.
HF_NAMES_2_LAYERS = [
    "model.embed_tokens.weight",
    *[
        f"model.layers.{i}.{suffix}"
        for i in range(2)
        for suffix in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
    ],
    "model.norm.weight",
    "lm_head.weight",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parameter_names_equal_hugging_face_llama() -> None:
    model = build_model(TINY, seed=0)
    assert TINY.n_layers == 2
    assert sorted(model.state_dict()) == sorted(HF_NAMES_2_LAYERS)
    assert all("bias" not in name for name, _ in model.named_parameters())


def test_shapes_follow_gqa_and_swiglu() -> None:
    params = dict(build_model(TINY, seed=0).named_parameters())
    kv_dim = TINY.n_kv_heads * TINY.head_dim
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (kv_dim, TINY.dim)
    assert params["model.layers.1.mlp.down_proj.weight"].shape == (TINY.dim, TINY.ffn_dim)
    assert params["lm_head.weight"].shape == (TINY.vocab_size, TINY.dim)


@pytest.mark.parametrize("name", ["tiny", "devnet", "10m"])  # "1b" is too big to build here; same formula
def test_num_params_matches_the_model(name: str) -> None:
    cfg = ModelConfig.preset(name)
    assert build_model(cfg, seed=0).num_params() == cfg.num_params()


def test_preset_sizes() -> None:
    assert 50_000 <= PRESETS["tiny"].num_params() <= 100_000
    assert 0.8e6 <= PRESETS["devnet"].num_params() <= 1.3e6
    assert 8e6 <= PRESETS["10m"].num_params() <= 12e6
    assert 0.9e9 <= PRESETS["1b"].num_params() <= 1.1e9


def test_tied_embeddings_share_one_tensor() -> None:
    cfg = ModelConfig.from_dict({**TINY.to_dict(), "tie_embeddings": True})
    model = build_model(cfg, seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.num_params() == cfg.num_params() == TINY.num_params() - TINY.vocab_size * TINY.dim


def test_config_round_trips_and_rejects_bad_values() -> None:
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ValueError, match="divisible by n_heads"):
        ModelConfig(dim=50, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        ModelConfig(dim=48, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match="must be even"):
        ModelConfig(dim=12, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match="n_layers must be a positive integer"):
        ModelConfig(dim=48, n_layers=0, n_heads=4, n_kv_heads=2, ffn_dim=8, max_seq_len=8)
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['hidden'\]"):
        ModelConfig.from_dict({**TINY.to_dict(), "hidden": 3})
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")


def test_init_is_deterministic_and_seeded_per_tensor() -> None:
    a, b, c = build_model(TINY, seed=7), build_model(TINY, seed=7), build_model(TINY, seed=8)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # Each tensor has its own generator: a deeper model keeps the shallower one's tensors.
    deeper = build_model(ModelConfig.from_dict({**TINY.to_dict(), "n_layers": 3}), seed=7)
    assert torch.equal(deeper.model.embed_tokens.weight, a.model.embed_tokens.weight)
    assert torch.equal(
        deeper.model.layers[1].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight
    )


def test_init_golden_values() -> None:
    # Recorded once; a change means every published initial checkpoint hash changes too.
    weight = build_model(TINY, seed=0).model.embed_tokens.weight
    golden = torch.tensor([-0.010120643302798271, 0.017833737656474113, -0.010261389426887035])
    assert torch.equal(weight.detach()[0, :3], golden)


def test_init_statistics() -> None:
    model = build_model(ModelConfig.preset("devnet"), seed=0)
    params = dict(model.named_parameters())
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    assert params["model.layers.0.mlp.gate_proj.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    assert params["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.02)
    assert params["model.layers.3.self_attn.o_proj.weight"].std().item() == pytest.approx(
        residual_std, rel=0.05
    )
    assert torch.equal(params["model.norm.weight"], torch.ones(model.config.dim))


def test_initial_loss_is_near_uniform() -> None:
    model = build_model(TINY, seed=0)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)


def test_attention_is_causal() -> None:
    model = build_model(TINY, seed=0).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-6)
    assert (before[:, 12:] - after[:, 12:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_rope_uses_rotate_half_pairs() -> None:
    head_dim, theta = 8, 10000.0
    cos, sin = rope_cos_sin(5, head_dim, theta, torch.device("cpu"))
    x = torch.randn(1, 1, 5, head_dim, generator=torch.Generator().manual_seed(0))
    out = apply_rope(x, cos, sin)
    pos, i = 3, 1  # element i pairs with i + head_dim/2 (HF's convention, not interleaved)
    angle = pos * theta ** (-2 * i / head_dim)
    a, b = x[0, 0, pos, i].item(), x[0, 0, pos, i + head_dim // 2].item()
    assert out[0, 0, pos, i].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-6)
    assert out[0, 0, pos, i + head_dim // 2].item() == pytest.approx(
        b * math.cos(angle) + a * math.sin(angle), abs=1e-6
    )


def test_rope_scores_depend_on_relative_position_only() -> None:
    head_dim = 16
    cos, sin = rope_cos_sin(40, head_dim, 10000.0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)

    def score(m: int, n: int) -> float:
        qm = apply_rope(q.view(1, 1, 1, -1), cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k.view(1, 1, 1, -1), cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum().item()

    assert score(7, 3) == pytest.approx(score(30, 26), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)
    rotated = apply_rope(q.view(1, 1, 1, -1), cos[11:12], sin[11:12])
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-6)


def test_gqa_kv_head_j_serves_consecutive_query_heads() -> None:
    cfg = TINY
    attention = Attention(cfg)
    x = torch.randn(1, 6, cfg.dim, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(6, cfg.head_dim, cfg.rope_theta, x.device)
    with torch.no_grad():
        got = attention(x, cos, sin)
        q = apply_rope(attention.q_proj(x).view(1, 6, cfg.n_heads, -1).transpose(1, 2), cos, sin)
        k = apply_rope(attention.k_proj(x).view(1, 6, cfg.n_kv_heads, -1).transpose(1, 2), cos, sin)
        v = attention.v_proj(x).view(1, 6, cfg.n_kv_heads, -1).transpose(1, 2)
        group = cfg.n_heads // cfg.n_kv_heads
        heads = []
        for h in range(cfg.n_heads):
            scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
            heads.append(F.softmax(scores, dim=-1) @ v[:, h // group])
        expected = attention.o_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_forward_rejects_too_long_sequences() -> None:
    model = Llama(TINY)
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
