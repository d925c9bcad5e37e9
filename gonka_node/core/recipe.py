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
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gonka_node.core.storage import StoreError, open_store

if TYPE_CHECKING:  # imported where used: reading the fields' defaults and help (CLI parsers) needs no torch
    from training.data import TokenCorpus, Windows
    from training.inner import InnerConfig
    from training.model import ModelConfig
    from training.tokenizer import Bytes, HFTokenizer

RECIPE_FORMAT = "gonka-recipe-v1"
BUILTIN_CORPUS = "builtin"
ASSIGNMENT_SEEDS = ("epoch", "signin-block")
# What a recipe for a real epoch (`gonka-node init epoch`, `gov build-spec`, `gov check-spec`) gets for
# a field its file leaves out, where that differs from the dataclass default: the default stays what
# recipes written before the field meant, so their hashes do not change.
EPOCH_DEFAULTS: dict[str, Any] = {"assignment_seed": "signin-block"}


class RecipeError(ValueError):
    """A recipe file that is missing, malformed, or disagrees with the chain; names the file and field."""


def _field(default: Any, help: str) -> Any:
    """A recipe field: its default and its help, the one statement of both that the CLI flags, the
    `gonka-node init epoch` template and the devnet derive theirs from (`recipe_default`, `recipe_help`)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class Recipe:
    model: ModelConfig = dataclasses.field(metadata={"help": "a preset name or a table of ModelConfig fields"})
    corpus: str = _field(
        BUILTIN_CORPUS,
        '"builtin" (the running Python\'s stdlib sources), a text file/folder, or a prepared dataset: a folder '
        "holding manifest.json or s3://bucket/prefix[?endpoint=URL] (docs/DATA.md)",
    )
    data_manifest_sha256: str = _field("", "hex; empty only until `with_data_manifest` fills it in")
    # Both left out of the canonical JSON at their defaults, so recipes written before them keep their hash.
    tokenizer: str = _field("", 'sha256 of the tokenizer.json a prepared dataset was tokenized with; "" = bytes')
    assignment_seed: str = _field(
        "epoch",
        'what seeds the data assignment: "epoch" (epoch_seed alone: computable once the recipe is public) or '
        '"signin-block" (mixed with the first block at or after the sign-in deadline: no host knows its '
        "windows before sign-in closes; docs/SECURITY.md)",
    )
    epoch_seed: int = _field(0, "data assignment and held-out sampling")
    init_seed: int = _field(0, "the round-0 model's initialisation")
    seq_len: int = _field(64, "tokens per window (at most the model's max_seq_len)")
    micro_batch: int = _field(8, "windows per step per process")
    grad_accum: int = _field(1, "micro-batches per step: the chain records batch_size = micro_batch x grad_accum")
    inner_steps: int = _field(20, "H: AdamW steps per round")
    inner_lr: float = _field(2e-3, "AdamW peak learning rate (warm-up, then cosine over the epoch)")
    warmup_steps: int = _field(20, "inner steps of linear warm-up")
    weight_decay: float = _field(0.1, "AdamW decoupled weight decay")
    grad_clip: float = _field(1.0, "gradient norm clipping")
    n_rounds: int = _field(3, "outer rounds of the epoch")
    codec: str = _field("int8", "pseudo-gradient compression, NAME or NAME:key=value,...")
    ef_decay: float = _field(1.0, "error feedback kept on the host (1: all of it)")
    outer_lr: float = _field(0.7, "outer Nesterov learning rate")
    outer_momentum: float = _field(0.9, "outer Nesterov momentum")
    # "fresh": every round starts from zero AdamW moments at its place on the schedule, so anyone can
    # replay a host's round from public data (the aggregator's replay check, docs/SECURITY.md); costs
    # some loss against "carry" (docs/benchmarks.md).
    round_state: str = _field(
        "carry", "carry AdamW state across rounds, or start each round fresh (replayable: docs/SECURITY.md)"
    )
    overlap: str = _field(
        "off", 'which model round r trains from: "off", round r - 1\'s; "delayed", round r - 2\'s, so a host trains '
        'the next round while this one uploads; "eager", the host\'s forecast of round r - 1\'s from round r - 2\'s '
        "(training/overlap.py; omitted from the canonical JSON when off)"
    )
    # Rebases of an eager round (training/overlap.py "Late forecast and merge"; both omitted from the
    # canonical JSON when 0, so earlier recipes keep their hash).
    forecast_step: int = _field(
        0, 'overlap = "eager": the inner step of each round at which a host moves onto its forecast; before it '
        "the round trains from the outer step on round r - 2's model with no update, so the host need not have "
        "sealed round r - 1 to start (0: from the forecast throughout)"
    )
    merge_step: int = _field(
        0, 'overlap = "eager": the inner step of each round at which a host moves onto round r - 1\'s model, '
        "which it must hold by then, and measures its pseudo-gradient from it (0: never)"
    )
    broadcast: str = _field(
        "dense", 'what hosts download each round: "dense" fp32, or "codec": the epoch\'s codec plus the '
        "aggregator's error feedback, the model defined by the decoded update (gonka_node/aggregator/broadcast.py)"
    )
    shards: int = _field(
        1, "aggregators splitting the model by fragment (docs/PROTOCOL.md \"Sharded aggregators\"): the epoch "
        "must name this many aggregators with aggregator_quorum equal to it (omitted from the canonical JSON when 1)"
    )
    # Streamed epochs (training/streaming.py; both omitted from the canonical JSON at their defaults).
    stream_fragments: int = _field(
        1, "P: fragments of the model (balanced by size) synced one a round in turn, so each fragment syncs every "
        "P rounds and a round's upload and download carry 1/P of the model (Streaming DiLoCo; needs "
        'round_state = "carry", overlap "off" or "delayed", so a replay probability of 0; 1: the whole model every '
        'round). docs/PROTOCOL.md "Streaming fragments"'
    )
    stream_mix: float = _field(
        0.0, "streamed epochs: the share of its own fragment a host keeps when the synced one arrives, "
        "θ ← mix·θ_local + (1 − mix)·θ_global, in [0, 1) (0: replace it)"
    )
    # The top-k challenge (docs/PROTOCOL.md "Challenge and opening"): a picked host opens this share of its
    # residual's chunks, and at least this many elements' worth (what the verdict's cosine needs is
    # elements, not chunks). Both omitted from the canonical JSON at their defaults.
    residual_sample: float = _field(
        0.01, "top-k epochs with replays: the fraction of residual chunks a picked host opens, in (0, 1]"
    )
    residual_sample_min: int = _field(
        1_048_576, "top-k epochs with replays: the fewest residual elements a picked host opens (>= 1)"
    )

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "grad_accum", "inner_steps", "n_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise RecipeError(f"{name}: must be a positive integer, got {value!r}")
        if self.seq_len > self.model.max_seq_len:
            raise RecipeError(f"seq_len: {self.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")
        if self.data_manifest_sha256 and len(bytes.fromhex(self.data_manifest_sha256)) != 32:
            raise RecipeError("data_manifest_sha256: must be 64 hex digits")
        if self.overlap not in ("off", "delayed", "eager"):  # training/overlap.py's OVERLAP_MODES (no torch here)
            raise RecipeError(f"overlap: must be one of off, delayed, eager, got {self.overlap!r}")
        self._check_rebases()
        if self.broadcast not in ("dense", "codec"):
            raise RecipeError(f"broadcast: must be one of dense, codec, got {self.broadcast!r}")
        if not isinstance(self.shards, int) or isinstance(self.shards, bool) or self.shards <= 0:
            raise RecipeError(f"shards: must be a positive integer, got {self.shards!r}")
        self._check_streaming()
        if isinstance(self.residual_sample, bool) or not 0.0 < self.residual_sample <= 1.0:
            raise RecipeError(f"residual_sample: must be a fraction in (0, 1], got {self.residual_sample!r}")
        if not isinstance(self.residual_sample_min, int) or isinstance(self.residual_sample_min, bool) \
                or self.residual_sample_min < 1:
            raise RecipeError(f"residual_sample_min: must be a positive integer, got {self.residual_sample_min!r}")
        if self.tokenizer and (len(self.tokenizer) != 64 or set(self.tokenizer) - set("0123456789abcdef")):
            raise RecipeError("tokenizer: must be the 64 lower-case hex digits of tokenizer.json's sha256")
        if self.assignment_seed not in ASSIGNMENT_SEEDS:
            raise RecipeError(f"assignment_seed: {self.assignment_seed!r}; choose one of {list(ASSIGNMENT_SEEDS)}")
        if self.tokenizer and not self.is_dataset():
            raise RecipeError(f"tokenizer: a tokenizer other than bytes needs a prepared dataset as corpus, "
                              f"not {self.corpus!r} (gonka-node data prepare)")
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
        from training.inner import InnerConfig

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

    def is_dataset(self) -> bool:
        """Whether `corpus` names a prepared dataset (rather than text files or the built-in corpus)."""
        return self.corpus.startswith("s3://") or (Path(self.corpus) / "manifest.json").is_file()

    def _dataset_windows(self, cache_dir: Path | None) -> Windows:
        from training.dataset import DatasetError, ShardCache, open_windows, read_manifest

        try:
            store = open_store(self.corpus)
            manifest, _ = read_manifest(store, self.data_manifest_sha256)
        except (StoreError, DatasetError) as exc:
            raise RecipeError(f"corpus: {exc}") from exc
        if manifest.tokenizer_sha256 != self.tokenizer:
            raise RecipeError(f"tokenizer: the dataset was tokenized with {manifest.tokenizer_sha256 or 'bytes'}, "
                              f"the recipe names {self.tokenizer or 'bytes'}")
        if manifest.vocab_size > self.model.vocab_size:
            raise RecipeError(f"model.vocab_size: {self.model.vocab_size} is smaller than the tokenizer's "
                              f"{manifest.vocab_size}")
        folder = (cache_dir or Path(tempfile.gettempdir()) / "gonka-node") / "shards"
        try:
            return open_windows(manifest, ShardCache(store, folder), self.seq_len)
        except DatasetError as exc:
            raise RecipeError(f"corpus: {exc}") from exc

    def dataset_manifest_sha256(self) -> str:
        from training.dataset import DatasetError, read_manifest

        try:
            return read_manifest(open_store(self.corpus))[1]
        except (StoreError, DatasetError) as exc:
            raise RecipeError(f"corpus: {exc}") from exc

    def load_tokenizer(self) -> Bytes | HFTokenizer:
        """The recipe's tokenizer: bytes, or the dataset's tokenizer.json checked against `tokenizer`."""
        from training.dataset import TOKENIZER_KEY
        from training.tokenizer import Bytes, HFTokenizer, TokenizerError

        if not self.tokenizer:
            return Bytes()
        try:
            data = open_store(self.corpus).get_bytes(TOKENIZER_KEY)
            tok = HFTokenizer(data, f"{self.corpus}/{TOKENIZER_KEY}")
        except (StoreError, TokenizerError) as exc:
            raise RecipeError(f"tokenizer: {exc}") from exc
        if tok.sha256 != self.tokenizer:
            raise RecipeError(f"tokenizer: {self.corpus}/{TOKENIZER_KEY} has sha256 {tok.sha256}, the recipe "
                              f"names {self.tokenizer}")
        return tok

    def load_corpus(self, cache_dir: Path | None = None) -> TokenCorpus:
        from training.data import TokenCorpus

        if self.corpus == BUILTIN_CORPUS:
            return TokenCorpus.builtin(cache_dir)
        return TokenCorpus.from_paths([self.corpus], cache_dir)

    def windows(self, cache_dir: Path | None = None) -> Windows:
        """The epoch's data, checked against the recorded manifest hash. A prepared dataset is streamed:
        shards are fetched when a window needs them, into `cache_dir`/shards (size-limited)."""
        if self.is_dataset():
            return self._dataset_windows(cache_dir)
        corpus = self.load_corpus(cache_dir)
        if self.data_manifest_sha256 and corpus.manifest_sha256 != self.data_manifest_sha256:
            raise RecipeError(
                f"corpus: {self.corpus!r} has manifest sha256 {corpus.manifest_sha256}, the recipe "
                f"records {self.data_manifest_sha256}: this machine's data differs from the epoch's"
            )
        return corpus.windows(self.seq_len)

    def with_data_manifest(self, cache_dir: Path | None = None) -> Recipe:
        if self.is_dataset():
            return dataclasses.replace(self, data_manifest_sha256=self.dataset_manifest_sha256())
        return dataclasses.replace(
            self, data_manifest_sha256=self.load_corpus(cache_dir).manifest_sha256
        )

    def _check_rebases(self) -> None:
        for name in ("forecast_step", "merge_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RecipeError(f"{name}: must be a non-negative integer (0: none), got {value!r}")
            if value and self.overlap != "eager":
                raise RecipeError(f'{name}: {value} needs overlap = "eager" (this recipe\'s is {self.overlap!r})')
            if value >= self.inner_steps:
                raise RecipeError(f"{name}: {value} must be below inner_steps ({self.inner_steps}): a step inside the round")
        if self.forecast_step and self.merge_step and self.forecast_step >= self.merge_step:
            raise RecipeError(f"forecast_step ({self.forecast_step}) must come before merge_step ({self.merge_step}): "
                              "a round moves onto its forecast, then onto round r - 1's model")

    def _check_streaming(self) -> None:
        p, mix = self.stream_fragments, self.stream_mix
        if not isinstance(p, int) or isinstance(p, bool) or p <= 0:
            raise RecipeError(f"stream_fragments: must be a positive integer (1: not streamed), got {p!r}")
        if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix < 1.0:
            raise RecipeError(f"stream_mix: must be a fraction in [0, 1), got {mix!r}")
        if p == 1:
            if mix:
                raise RecipeError(f"stream_mix: {mix} needs stream_fragments > 1 (this recipe streams nothing)")
            return
        if self.round_state != "carry":
            raise RecipeError(f'stream_fragments: {p} needs round_state = "carry": a streamed round trains on from '
                              "the host's own model, so no round starts fresh from public inputs")
        if self.overlap not in ("off", "delayed"):
            raise RecipeError(f'stream_fragments: {p} with overlap = {self.overlap!r}: streamed rounds overlap as '
                              '"delayed" (a fragment\'s sync lands one round late) or not at all ("off")')
        if self.shards > 1:
            raise RecipeError(f"stream_fragments: {p} with shards = {self.shards}: a sharded epoch's rounds "
                              "carry every fragment; stream one or the other")
        if self.codec.split(":")[0] == "mask":
            raise RecipeError(f"stream_fragments: {p} with the mask codec: its phase follows the round, so a "
                              "fragment synced every P rounds could keep one phase and never send the others")

    # ---- canonical form --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model"] = self.model.to_dict()
        out["format"] = RECIPE_FORMAT
        if not self.tokenizer:
            del out["tokenizer"]
        if self.assignment_seed == "epoch":
            del out["assignment_seed"]
        for name, default in (("overlap", "off"), ("forecast_step", 0), ("merge_step", 0), ("broadcast", "dense"), ("shards", 1), ("stream_fragments", 1), ("stream_mix", 0.0), ("residual_sample", 0.01),
                              ("residual_sample_min", 1_048_576)):
            if out[name] == default:
                del out[name]
        return out

    def canonical_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def sha256(self) -> bytes:
        return hashlib.sha256(self.canonical_json()).digest()

    def save(self, path: Path) -> None:
        path.write_bytes(self.canonical_json() + b"\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "recipe", defaults: dict[str, Any] | None = None) -> Recipe:
        """`defaults`: values for fields `data` leaves out (EPOCH_DEFAULTS for a real epoch)."""
        data = {**(defaults or {}), **data}
        fmt = data.pop("format", RECIPE_FORMAT)
        if fmt != RECIPE_FORMAT:
            raise RecipeError(f"{where}: format is {fmt!r}, this node reads {RECIPE_FORMAT!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        from training.model import ModelConfig

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
    def load(cls, path: Path, defaults: dict[str, Any] | None = None) -> Recipe:
        """Read a recipe from JSON (the canonical form) or TOML (hand-written); `defaults` as `from_dict`."""
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
        return cls.from_dict(data, where=str(path), defaults=defaults)

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


def recipe_default(name: str) -> Any:
    """The recipe field's default (what an epoch gets when its recipe leaves the field out)."""
    return _FIELDS[name].default


def field_help(name: str) -> str:
    """What the recipe field means."""
    return str(_FIELDS[name].metadata["help"])


def recipe_help(name: str, default: Any = None) -> str:
    """The recipe field's help with the default a flag uses (the recipe's unless given)."""
    return f"{field_help(name)} (default {recipe_default(name) if default is None else default})"


_FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}


def check_network_overlap(recipe: Recipe) -> None:
    """An epoch's recipe must name an overlap rule the host daemon and the aggregator's replay implement:
    all three run in the network, "eager" unsharded only (a shard's replay holds one fragment and cannot
    take the whole-model outer step that makes a host's eager base). Streamed recipes (`stream_fragments`)
    run in the network too: `Recipe` itself holds them to what a streamed round needs."""
    if recipe.overlap == "eager" and recipe.shards > 1:
        raise RecipeError(f"overlap: 'eager' with shards = {recipe.shards}: the sharded replay does not compute "
                          "the hosts' eager bases; use shards = 1 or overlap = \"delayed\"")
