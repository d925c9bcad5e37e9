"""Export a checkpoint as a Hugging Face `LlamaForCausalLM` folder, without importing transformers.

Our parameter names and RoPE convention already equal HF's (see `training/model.py`), so the export
is a copy: `config.json` from the `ModelConfig`, `model.safetensors` with the same tensor names,
`generation_config.json` and a short model card naming the source checkpoint's sha256. Loading the
folder with `LlamaForCausalLM.from_pretrained` gives the same logits as `Llama` (checked in
tests/training/test_hf_export.py).

The vocabulary is the 256 UTF-8 bytes (`ByteTokenizer`): token id = byte value. The folder carries
that tokenizer in the `tokenizers` library's format (`tokenizer.json`: a byte-level BPE with no merges,
each byte one token, the id its value; `tokenizer_config.json`), so `AutoTokenizer` and
`pipeline("text-generation")` load the folder as it is. Documents are separated by NUL (id 0) in
training, so 0 is the end-of-sequence token and prompting after a 0 means "start of a document". There
is no BOS token.

Checkpoints carry their `ModelConfig` as JSON under the metadata key `MODEL_CONFIG_KEY` when their
writer stored it; otherwise the caller names the config (a preset). Either way every tensor's name
and shape is checked against the config before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from training.data import DOCUMENT_SEPARATOR, ByteTokenizer
from training.model import ModelConfig
from training.tokenizer import HFTokenizer

MODEL_CONFIG_KEY = "model_config"  # checkpoint metadata: json.dumps(ModelConfig.to_dict())
EXPORT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class ExportError(Exception):
    """The tensors do not fit the config, or the output folder cannot be written."""


def config_from_metadata(metadata: Mapping[str, str]) -> ModelConfig | None:
    """The `ModelConfig` a checkpoint records in its metadata, or None when it records none."""
    raw = metadata.get(MODEL_CONFIG_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return ModelConfig.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise ExportError(
            f"checkpoint metadata {MODEL_CONFIG_KEY!r} is not a valid ModelConfig: {exc}"
        ) from exc


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in `Llama(cfg).state_dict()`, without building the model.

    (Building one on the meta device costs seconds of one-time torch setup; a 1B model on the CPU
    costs seconds of random init. tests/training/test_hf_export.py checks this against the model.)
    """
    dim, ffn, kv_dim = cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, dim)}
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (cfg.n_heads * cfg.head_dim, dim),
            layer + "self_attn.k_proj.weight": (kv_dim, dim),
            layer + "self_attn.v_proj.weight": (kv_dim, dim),
            layer + "self_attn.o_proj.weight": (dim, cfg.n_heads * cfg.head_dim),
            layer + "mlp.gate_proj.weight": (ffn, dim),
            layer + "mlp.up_proj.weight": (ffn, dim),
            layer + "mlp.down_proj.weight": (dim, ffn),
            layer + "input_layernorm.weight": (dim,),
            layer + "post_attention_layernorm.weight": (dim,),
        }
    return shapes | {"model.norm.weight": (dim,), LM_HEAD: (cfg.vocab_size, dim)}


def check_tensors(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Raise ExportError unless `tensors` are exactly `Llama(cfg)`'s parameters (names and shapes).

    `lm_head.weight` may be missing when the embeddings are tied (it is the embedding matrix).
    """
    expected = expected_shapes(cfg)
    optional = {LM_HEAD} if cfg.tie_embeddings else set()
    missing = sorted(set(expected) - set(tensors) - optional)
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ExportError(
            f"the checkpoint's tensors do not fit the model config: missing {missing[:4]}, unexpected "
            f"{unknown[:4]}; pass the config the checkpoint was trained with"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ExportError(
                f"tensor {name} has shape {tuple(tensor.shape)}, the model config needs {expected[name]}; "
                "pass the config the checkpoint was trained with"
            )
        if not tensor.is_floating_point():
            raise ExportError(f"tensor {name} has dtype {tensor.dtype}; model weights must be floating point")
    if cfg.tie_embeddings and LM_HEAD in tensors and not torch.equal(tensors[LM_HEAD], tensors[EMBED]):
        raise ExportError(
            f"the config ties the embeddings but {LM_HEAD} differs from {EMBED}: "
            "the checkpoint was trained untied; pass a config with tie_embeddings=false"
        )


def hf_config(cfg: ModelConfig, dtype: torch.dtype, eos_id: int = DOCUMENT_SEPARATOR) -> dict[str, Any]:
    """`config.json` for `LlamaForCausalLM`, readable by transformers 4.x and 5.x."""
    dtype_name = _dtype_name(dtype)
    return {
        **cfg.to_hf_config(),
        # transformers 5 reads rope_parameters and dtype; 4.x reads rope_theta and torch_dtype.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
    }


def generation_config(eos_id: int = DOCUMENT_SEPARATOR) -> dict[str, Any]:
    """Defaults for `model.generate`: stop at the document separator; no BOS, no padding token."""
    return {"bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None}


def byte_symbols() -> list[str]:
    """The printable character standing for each byte value in a byte-level tokenizer (GPT-2's table:
    printable Latin-1 bytes stand for themselves, the others for U+0100 onwards, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in symbols]
    symbols |= {b: chr(256 + i) for i, b in enumerate(others)}
    return [symbols[b] for b in range(256)]


def tokenizer_files(cfg: ModelConfig) -> dict[str, dict[str, Any]]:
    """`tokenizer.json` and `tokenizer_config.json` for the byte vocabulary: token id = byte value."""
    symbols = byte_symbols()
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},  # bytes → symbols, never split further
        "post_processor": None,  # no BOS/EOS added to a prompt
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {symbol: byte for byte, symbol in enumerate(symbols)},
            "merges": [],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": symbols[DOCUMENT_SEPARATOR],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_seq_len,
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config,
            "special_tokens_map.json": {"eos_token": symbols[DOCUMENT_SEPARATOR]}}


def bpe_tokenizer_files(cfg: ModelConfig, tokenizer_json: bytes) -> tuple[dict[str, bytes], int]:
    """The files of a trained tokenizer (its tokenizer.json as it is, so its sha256 stays the recipe's)
    and its end-of-text id."""
    tok = HFTokenizer(tokenizer_json)
    if tok.vocab_size > cfg.vocab_size:
        raise ExportError(f"the tokenizer has {tok.vocab_size} tokens, the model only {cfg.vocab_size}")
    eos = tok.inner.id_to_token(tok.eot_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_seq_len,
    }
    files = {"tokenizer.json": tokenizer_json, "tokenizer_config.json": _json_bytes(config),
             "special_tokens_map.json": _json_bytes({"eos_token": eos})}
    return files, tok.eot_id


def _json_bytes(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")  # as _write_json writes


def model_card(cfg: ModelConfig, source_sha256: str, source: Mapping[str, str]) -> str:
    provenance = "".join(f"- {key}: `{value}`\n" for key, value in sorted(source.items()))
    return f"""---
library_name: transformers
pipeline_tag: text-generation
---
# gonka-node checkpoint

A Llama-style model trained with decentralized DiLoCo by gonka-node, exported from the checkpoint
whose canonical sha256 (the hash recorded on chain) is:

    {source_sha256}

{provenance}
Parameters: {cfg.num_params():,}; layers {cfg.n_layers}, hidden size {cfg.dim}, heads {cfg.n_heads}
(key/value heads {cfg.n_kv_heads}), context {cfg.max_seq_len} tokens.

## Tokens

The vocabulary is the 256 UTF-8 bytes ({ByteTokenizer.name}): a token id is a byte value. The
folder's tokenizer files say so, so `AutoTokenizer` and the `text-generation` pipeline load it. Token
{DOCUMENT_SEPARATOR} (NUL) separates documents; start a prompt with it to begin a new document.
Generation stops when the model emits it.

```python
from transformers import pipeline

generate = pipeline("text-generation", model="path/to/this/folder")
print(generate("def main(", max_new_tokens=64, do_sample=False)[0]["generated_text"])
```
"""


def export_hf(
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    source_sha256: str,
    source: Mapping[str, str] | None = None,
    dtype: torch.dtype | None = None,
    tokenizer_json: bytes | None = None,
) -> Path:
    """Write the HF folder `out_dir` (which must not exist or be empty); return it.

    `source` adds provenance lines to the model card (e.g. epoch, round, chain). `dtype` casts the
    weights (default: the checkpoint's own dtype). `tokenizer_json`: the epoch's tokenizer file (a recipe's
    `tokenizer`), shipped as it is; without it the byte tokenizer's files are written. The folder appears whole or not at all: it is
    built next to `out_dir` and renamed into place.
    """
    check_tensors(tensors, cfg)
    if tokenizer_json:
        tok_files, eos_id = bpe_tokenizer_files(cfg, tokenizer_json)
    else:
        tok_files = {name: _json_bytes(content) for name, content in tokenizer_files(cfg).items()}
        eos_id = DOCUMENT_SEPARATOR
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty folder; choose another --out")
    weights = _hf_tensors(tensors, cfg, dtype)
    out_dtype = weights[EMBED].dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "config.json", hf_config(cfg, out_dtype, eos_id))
        _write_json(staging / "generation_config.json", generation_config(eos_id))
        for name, content in tok_files.items():
            (staging / name).write_bytes(content)
        (staging / "README.md").write_text(model_card(cfg, source_sha256, source or {}), encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty (checked above); os.replace cannot replace a folder with a folder
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _hf_tensors(
    tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies in the export dtype; a tied lm_head is left out (HF re-ties it on load)."""
    target = dtype or tensors[EMBED].dtype
    _dtype_name(target)
    return {
        name: tensor.detach().to("cpu", target).contiguous()
        for name, tensor in sorted(tensors.items())
        if not (cfg.tie_embeddings and name == LM_HEAD)
    }


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in EXPORT_DTYPES.items():
        if value == dtype:
            return name
    raise ExportError(f"cannot export weights as {dtype}; choose one of {sorted(EXPORT_DTYPES)}")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    # ensure_ascii: the byte symbols (U+0100…) travel as escapes, whatever the reader's locale
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
