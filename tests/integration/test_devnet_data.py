"""`gonka-node devnet --dataset DIR --tokenizer FILE`: an epoch on a prepared dataset with a BPE tokenizer.

The same real processes as tests/integration/test_devnet.py (embedded chain on loopback, one aggregator,
two hosts, two rounds), but the data is pre-tokenized shards streamed through each host's shard cache,
the model's vocabulary follows the tokenizer, and the assignment waits for the first block after sign-in.
The trained model, exported with its tokenizer, loads in transformers with `AutoTokenizer`.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest

from gonka_node.cli import main
from gonka_node.core.recipe import Recipe
from gonka_node.host.store import HostStore
from training.checkpoint import canonical_sha256
from training.hf_export import export_hf

os.environ["HF_HUB_OFFLINE"] = "1"


def _texts(folder: Path) -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    names = ("argparse.py", "textwrap.py", "shlex.py", "string.py", "bisect.py", "heapq.py", "calendar.py")
    paths = []
    for name in names:
        path = folder / f"{name}.txt"
        path.write_bytes((lib / name).read_bytes())
        paths.append(path)
    return paths


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_devnet_trains_on_a_prepared_bpe_dataset(tmp_path: Path) -> None:
    (tmp_path / "texts").mkdir()
    texts = _texts(tmp_path / "texts")
    tok = tmp_path / "tokenizer.json"
    assert main(["data", "tokenizer", "--corpus", *map(str, texts), "--vocab", "512", "--out", str(tok)]) == 0
    dataset = tmp_path / "dataset"
    assert main(["data", "prepare", "--input", *map(str, texts), "--tokenizer", str(tok), "--out", str(dataset),
                 "--workers", "1", "--unit-mb", "0.05", "--heldout-fraction", "0.15"]) == 0
    out = tmp_path / "devnet"
    rc = main(["devnet", "--out", str(out), "--hosts", "2", "--rounds", "2", "--inner-steps", "8",
               "--preset", "tiny", "--timeout", "400", "--replay-fraction", "1",
               "--dataset", str(dataset), "--tokenizer", str(tok)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    recipe = Recipe.load(out / "recipe.json")
    assert recipe.model.vocab_size == 512 and recipe.is_dataset() and recipe.assignment_seed == "signin-block"
    assert report["losses"][-1] < report["losses"][0] - 0.1
    assert all(r["earned_ngonka"] > 0 for r in report["rewards"].values())  # replays passed: same windows
    assert list(out.rglob("shards/*.tok"))  # streamed through the shard cache
    snap = HostStore(out / "host1").load()
    assert snap is not None and canonical_sha256(snap.global_params) == report["checkpoint_hashes"][-1]
    folder = export_hf(snap.global_params, recipe.model, tmp_path / "hf", source_sha256=report["checkpoint_hashes"][-1],
                       tokenizer_json=recipe.load_tokenizer().raw)  # type: ignore[union-attr]

    from transformers import AutoTokenizer, LlamaForCausalLM, pipeline

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "def parse_args(self, args=None):"
    assert tokenizer(text)["input_ids"] == recipe.load_tokenizer().encode(text)
    assert LlamaForCausalLM.from_pretrained(folder, local_files_only=True).config.vocab_size == 512
    generated = pipeline("text-generation", model=str(folder), device="cpu")(text, max_new_tokens=5, do_sample=False)
    assert generated[0]["generated_text"].startswith(text)
