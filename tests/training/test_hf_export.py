"""The HF export loads in transformers and gives our logits and our greedy tokens.

transformers is a test dependency only (training/hf_export.py never imports it). Nothing is
downloaded: every model is built here and loaded from a local folder, with the hub switched off.
"""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported, just below
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import pytest
import torch
from model_helpers import sharp_model
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaForCausalLM, pipeline

from training.checkpoint import load_checkpoint, save_checkpoint
from training.generate import SamplingConfig, generate_tokens
from training.hf_export import (
    MODEL_CONFIG_KEY,
    ExportError,
    config_from_metadata,
    expected_shapes,
    export_hf,
)
from training.model import Llama, ModelConfig, build_model
from training.tokenizer import HFTokenizer, train_bpe

SHA = "ab" * 32
CONFIGS = {
    "gqa-untied": ModelConfig(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64),
    "gqa-tied": ModelConfig(
        dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64, tie_embeddings=True
    ),
    # Multi-head attention, a non-default rope_theta and norm_eps: each must reach config.json.
    "mha-tied-theta": ModelConfig(
        dim=32, n_layers=3, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=48,
        rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True,
    ),
    "mqa-untied": ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_dim=80, max_seq_len=32),
}


def _changed(cfg: ModelConfig, **fields: object) -> ModelConfig:
    return ModelConfig.from_dict({**cfg.to_dict(), **fields})


def load_hf(folder: object) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(folder, local_files_only=True).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_gives_our_logits(tmp_path, one_thread, name):
    cfg = CONFIGS[name]
    model = sharp_model(cfg)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", source_sha256=SHA)
    hf = load_hf(out)
    assert hf.config.num_key_value_heads == cfg.n_kv_heads
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    if cfg.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.max_seq_len), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.std() > 1.0  # the logits are far from uniform: a wrong rotation or norm would show
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_greedy_generation_equals_transformers(tmp_path, one_thread):
    cfg = CONFIGS["gqa-untied"]
    model = sharp_model(cfg, seed=3)
    hf = load_hf(export_hf(model.state_dict(), cfg, tmp_path / "hf", source_sha256=SHA))
    prompt = [0, *b"def main():"]
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0, stop_token=0)
    ours = generate_tokens(model, prompt, sampling)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    assert len(ours) >= 4
    assert ours == theirs.tolist()


def test_auto_tokenizer_maps_each_byte_to_its_value(tmp_path):
    cfg = CONFIGS["gqa-tied"]
    out = export_hf(build_model(cfg, 0).state_dict(), cfg, tmp_path / "hf", source_sha256=SHA)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "\x00def f(x):\n\treturn 'héllo' + \"🎉\"  \x7f"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # no BOS, no merges, no prefix space: the bytes themselves
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 0 and len(tokenizer) == 256
    every_byte = bytes(range(256))
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(list(every_byte))) == list(every_byte)


def test_text_generation_pipeline_runs_on_the_folder(tmp_path, one_thread):
    cfg = CONFIGS["gqa-untied"]
    model = sharp_model(cfg, seed=3)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", source_sha256=SHA)
    generate = pipeline("text-generation", model=str(out), device="cpu")
    text = generate("def main():", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    ours = generate_tokens(model, list(b"def main():"), SamplingConfig(max_new_tokens=12, temperature=0.0, stop_token=0))
    assert text == "def main():" + bytes(ours).decode("utf-8", errors="replace")


def test_a_bpe_tokenizer_ships_with_the_model(tmp_path, one_thread):
    corpus = ["def add(a, b):\n    return a + b\n", "print('hello world')\n"] * 100
    tok_json = train_bpe(iter(corpus), vocab_size=300)
    ours = HFTokenizer(tok_json)
    cfg = _changed(CONFIGS["gqa-untied"], vocab_size=300)
    model = sharp_model(cfg, seed=4)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", source_sha256=SHA, tokenizer_json=tok_json)
    assert (out / "tokenizer.json").read_bytes() == tok_json  # byte for byte: the recipe's sha256 names it
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "def add(x, y):\n    return x * y  # é"
    assert tokenizer(text)["input_ids"] == ours.encode(text) and tokenizer.decode(ours.encode(text)) == text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == ours.eot_id == 0
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    generate = pipeline("text-generation", model=str(out), device="cpu")
    text = generate("def add(", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    prompt = ours.encode("def add(")
    new = generate_tokens(model, prompt, SamplingConfig(max_new_tokens=8, temperature=0.0, stop_token=0))
    assert text == ours.decode(prompt + list(new))
    with pytest.raises(ExportError, match=f"the tokenizer has {ours.vocab_size} tokens, the model only 256"):
        export_hf(build_model(CONFIGS["gqa-tied"], 0).state_dict(), CONFIGS["gqa-tied"], tmp_path / "small",
                  source_sha256=SHA, tokenizer_json=tok_json)


def test_folder_contents(tmp_path):
    cfg = CONFIGS["gqa-tied"]
    model = build_model(cfg, 0)
    out = export_hf(
        model.state_dict(), cfg, tmp_path / "hf", source_sha256=SHA, source={"epoch": "3", "round": "7"}
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (48, 96, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (4, 2, 256)
    assert config["eos_token_id"] == 0 and config["bos_token_id"] is None
    assert config["torch_dtype"] == config["dtype"] == "float32"
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "lm_head.weight" not in names  # tied: HF re-ties it to the embeddings on load
    assert names == set(model.state_dict()) - {"lm_head.weight"}
    card = (out / "README.md").read_text()
    assert SHA in card and "- epoch: `3`" in card and "- round: `7`" in card


def test_bfloat16_export(tmp_path):
    cfg = CONFIGS["gqa-untied"]
    model = sharp_model(cfg)
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", source_sha256=SHA, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = load_hf(out)
    assert hf.dtype == torch.bfloat16
    torch.testing.assert_close(
        hf.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight.bfloat16()
    )


def test_through_a_checkpoint_file_with_its_config(tmp_path):
    cfg = CONFIGS["gqa-tied"]
    model = sharp_model(cfg)
    path = tmp_path / "ckpt.safetensors"
    sha = save_checkpoint(path, model.state_dict(), {MODEL_CONFIG_KEY: json.dumps(cfg.to_dict())})
    checkpoint = load_checkpoint(path)
    assert config_from_metadata(checkpoint.metadata) == cfg
    hf = load_hf(export_hf(checkpoint.tensors, cfg, tmp_path / "hf", source_sha256=sha))
    tokens = torch.arange(40).view(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_expected_shapes_are_the_models(name):
    cfg = CONFIGS[name]
    assert expected_shapes(cfg) == {n: tuple(t.shape) for n, t in Llama(cfg).state_dict().items()}


def test_config_from_metadata():
    assert config_from_metadata({"steps": "3"}) is None
    with pytest.raises(ExportError, match="model_config"):
        config_from_metadata({MODEL_CONFIG_KEY: '{"dim": 48}'})
    with pytest.raises(ExportError, match="model_config"):
        config_from_metadata({MODEL_CONFIG_KEY: "not json"})


def test_wrong_config_is_refused_and_writes_nothing(tmp_path):
    tensors = build_model(CONFIGS["gqa-untied"], 0).state_dict()
    out = tmp_path / "hf"
    with pytest.raises(ExportError, match=r"k_proj.weight has shape \(24, 48\)"):
        export_hf(tensors, _changed(CONFIGS["gqa-untied"], n_kv_heads=4), out, source_sha256=SHA)
    with pytest.raises(ExportError, match="missing"):
        export_hf(tensors, CONFIGS["mha-tied-theta"], out, source_sha256=SHA)
    with pytest.raises(ExportError, match="trained untied"):
        export_hf(tensors, _changed(CONFIGS["gqa-untied"], tie_embeddings=True), out, source_sha256=SHA)
    with pytest.raises(ExportError, match=r"cannot export weights as torch\.int8"):
        export_hf(tensors, CONFIGS["gqa-untied"], out, source_sha256=SHA, dtype=torch.int8)
    assert list(tmp_path.iterdir()) == []  # no folder, no staging leftovers


def test_existing_output_is_not_overwritten(tmp_path):
    cfg = CONFIGS["gqa-untied"]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_hf(build_model(cfg, 0).state_dict(), cfg, out, source_sha256=SHA)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_hf(build_model(cfg, 0).state_dict(), cfg, empty, source_sha256=SHA) / "config.json").is_file()
