"""The epoch recipe: everything a host and an aggregator must agree on to train one epoch.

The chain records an epoch's *model spec hash*; that hash is the sha256 of this recipe's canonical JSON
(sorted keys, no spaces, UTF-8). Whoever holds the recipe file can check it against the chain before
spending a GPU-hour on it, and two parties holding the same recipe build the same model, the same data
windows, the same inner schedule and the same codec.

The hyperparameters the chain also carries in clear (H, inner lr, batch, outer lr and momentum, codec)
must equal the recipe's; `check_against_chain` compares them field by field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.data import TokenCorpus, Windows
from training.inner import InnerConfig
from training.model import ModelConfig

RECIPE_FORMAT = "gonka-recipe-v1"
BUILTIN_CORPUS = "builtin"


class RecipeError(ValueError):
    """A recipe file that is missing, malformed, or disagrees with the chain; names the file and field."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    model: ModelConfig
    corpus: str = BUILTIN_CORPUS  # "builtin" (the running Python's stdlib sources) or a path
    data_manifest_sha256: str = ""  # hex; empty only until `with_data_manifest` fills it in
    epoch_seed: int = 0  # data assignment and held-out sampling
    init_seed: int = 0  # model initialisation
    seq_len: int = 64
    micro_batch: int = 8
    grad_accum: int = 1
    inner_steps: int = 20
    inner_lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    n_rounds: int = 3
    codec: str = "int8"
    ef_decay: float = 1.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # "fresh": every round starts from zero AdamW moments at its place on the schedule, so anyone can
    # replay a host's round from public data (the aggregator's replay check, docs/SECURITY.md); costs
    # some loss against "carry" (docs/benchmarks.md).
    round_state: str = "carry"

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "grad_accum", "inner_steps", "n_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise RecipeError(f"{name}: must be a positive integer, got {value!r}")
        if self.seq_len > self.model.max_seq_len:
            raise RecipeError(f"seq_len: {self.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")
        if self.data_manifest_sha256 and len(bytes.fromhex(self.data_manifest_sha256)) != 32:
            raise RecipeError("data_manifest_sha256: must be 64 hex digits")
        self.inner_config()  # validates the schedule fields with InnerConfig's own messages

    # ---- derived settings ------------------------------------------------------------------------

    @property
    def total_inner_steps(self) -> int:
        return self.n_rounds * self.inner_steps

    @property
    def batch_size(self) -> int:
        """Windows per inner optimizer step, whole rig (what the chain's `batch_size` records)."""
        return self.micro_batch * self.grad_accum

    def inner_config(self) -> InnerConfig:
        try:
            return InnerConfig.fitted(
                steps=self.inner_steps,
                lr=self.inner_lr,
                warmup_steps=self.warmup_steps,
                total_steps=self.total_inner_steps,
                weight_decay=self.weight_decay,
                grad_clip=self.grad_clip,
                micro_batch=self.micro_batch,
                grad_accum=self.grad_accum,
                seq_len=self.seq_len,
                round_state=self.round_state,
            )
        except ValueError as exc:
            raise RecipeError(str(exc)) from exc

    def load_corpus(self, cache_dir: Path | None = None) -> TokenCorpus:
        if self.corpus == BUILTIN_CORPUS:
            return TokenCorpus.builtin(cache_dir)
        return TokenCorpus.from_paths([self.corpus], cache_dir)

    def windows(self, cache_dir: Path | None = None) -> Windows:
        """The epoch's data, checked against the recorded manifest hash."""
        corpus = self.load_corpus(cache_dir)
        if self.data_manifest_sha256 and corpus.manifest_sha256 != self.data_manifest_sha256:
            raise RecipeError(
                f"corpus: {self.corpus!r} has manifest sha256 {corpus.manifest_sha256}, the recipe "
                f"records {self.data_manifest_sha256}: this machine's data differs from the epoch's"
            )
        return corpus.windows(self.seq_len)

    def with_data_manifest(self, cache_dir: Path | None = None) -> Recipe:
        return dataclasses.replace(
            self, data_manifest_sha256=self.load_corpus(cache_dir).manifest_sha256
        )

    # ---- canonical form --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model"] = self.model.to_dict()
        out["format"] = RECIPE_FORMAT
        return out

    def canonical_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def sha256(self) -> bytes:
        return hashlib.sha256(self.canonical_json()).digest()

    def save(self, path: Path) -> None:
        path.write_bytes(self.canonical_json() + b"\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "recipe") -> Recipe:
        data = dict(data)
        fmt = data.pop("format", RECIPE_FORMAT)
        if fmt != RECIPE_FORMAT:
            raise RecipeError(f"{where}: format is {fmt!r}, this node reads {RECIPE_FORMAT!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        model = data.pop("model", None)
        try:
            if isinstance(model, str):
                model_cfg = ModelConfig.preset(model)
            elif isinstance(model, dict):
                model_cfg = ModelConfig.from_dict(model)
            else:
                raise RecipeError("model: give a preset name or a table of ModelConfig fields")
            return cls(model=model_cfg, **data)
        except RecipeError as exc:
            raise RecipeError(f"{where}: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"{where}: {exc}") from exc

    @classmethod
    def load(cls, path: Path) -> Recipe:
        """Read a recipe from JSON (the canonical form) or TOML (hand-written)."""
        try:
            text = path.read_text()
        except OSError as exc:
            raise RecipeError(f"{path}: cannot read recipe: {exc.strerror}") from exc
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise RecipeError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from exc
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: a recipe is a table of fields")
        return cls.from_dict(data, where=str(path))

    def check_against_chain(self, spec: Any) -> None:
        """Refuse to train an epoch whose on-chain record (a `chain.types.EpochSpec`) does not describe
        this recipe: the model spec hash, then each hyperparameter the chain carries in clear."""
        if spec.model_spec_hash != self.sha256():
            raise RecipeError(
                f"model_spec_hash: the chain records {spec.model_spec_hash.hex()}, this recipe hashes to "
                f"{self.sha256().hex()}"
            )
        mine = {
            "inner_steps": self.inner_steps,
            "inner_lr": self.inner_lr,
            "batch_size": self.batch_size,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "codec": self.codec,
            "n_rounds": self.n_rounds,
        }
        for name, value in mine.items():
            theirs = getattr(spec, name)
            same = abs(theirs - value) < 1e-9 if isinstance(value, float) else theirs == value
            if not same:
                raise RecipeError(f"{name}: the chain records {theirs!r}, the recipe says {value!r}")
        if self.data_manifest_sha256 != spec.data_manifest_hash.hex():
            raise RecipeError(
                f"data_manifest_sha256: the chain records {spec.data_manifest_hash.hex()}, the recipe says "
                f"{self.data_manifest_sha256 or '(empty)'}"
            )
