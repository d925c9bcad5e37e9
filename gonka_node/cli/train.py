"""`gonka-node train`: a short local DiLoCo run, K simulated hosts in one process.

The run itself is `training.local.LocalDiLoCo` (scripts/bench_training.py drives it too); this verb
builds its recipe from the flags (`local_recipe`: a local run's schedule on the recipe's defaults) and
adds a progress bar, a summary table and a JSON file.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gonka_node.cli import CliError
from gonka_node.cli.names import PRESET_NAMES, ROUND_STATES, add_codec_flag
from gonka_node.cli.verbs import add_verb
from gonka_node.core.recipe import BUILTIN_CORPUS, Recipe, recipe_default, recipe_help
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.codecs import get_codec
from training.data import TokenCorpus, Windows
from training.fragments import FragmentError
from training.hf_export import MODEL_CONFIG_KEY
from training.local import LocalDiLoCo, LocalRunConfig, RoundReport, ddp_bytes_per_worker
from training.model import ModelConfig
from training.overlap import OVERLAP_MODES

# A local run's schedule, where it differs from an epoch recipe's defaults (a few minutes on a CPU);
# every other field, and every help text, is the recipe's.
LOCAL_RUN: dict[str, Any] = {"n_rounds": 6, "inner_steps": 40, "warmup_steps": 50}
# The flags of `gonka-node train` that set a recipe field (default and help from LOCAL_RUN and Recipe).
RECIPE_FLAGS = {
    "--rounds": "n_rounds", "--inner-steps": "inner_steps", "--micro-batch": "micro_batch", "--seq-len": "seq_len",
    "--lr": "inner_lr", "--outer-lr": "outer_lr", "--round-state": "round_state", "--overlap": "overlap",
    "--stream-fragments": "stream_fragments", "--stream-mix": "stream_mix",
}
FLAG_CHOICES: dict[str, tuple[str, ...]] = {"round_state": ROUND_STATES, "overlap": OVERLAP_MODES}


def local_default(name: str) -> Any:
    """A recipe field's default in a local run."""
    return LOCAL_RUN.get(name, recipe_default(name))


def local_recipe(model: ModelConfig, *, seed: int = 0, **fields: Any) -> Recipe:
    """A recipe with the local run's schedule, `fields` (Recipe's names) on top, and one seed for both the
    model and the data."""
    return Recipe(model=model, epoch_seed=seed, init_seed=seed, **{**LOCAL_RUN, **fields})


@dataclass
class RunSummary:
    config: dict[str, Any]
    params: int
    initial_heldout_loss: float
    rounds: list[RoundReport] = field(default_factory=list)

    @property
    def bytes_per_worker(self) -> int:
        return sum(r.bytes_per_worker for r in self.rounds)

    @property
    def final_loss(self) -> float:
        return self.rounds[-1].heldout_loss if self.rounds else self.initial_heldout_loss

    def to_json(self, ddp_bytes: int) -> dict[str, Any]:
        return {
            **asdict(self),
            "final_loss": self.final_loss,
            "bytes_per_worker": self.bytes_per_worker,
            "ddp_bytes_per_worker": ddp_bytes,
            "reduction_vs_ddp": ddp_bytes / max(1, self.bytes_per_worker),
        }


def load_windows(corpus: Path | None, seq_len: int) -> Windows:
    try:
        tokens = TokenCorpus.from_paths([corpus]) if corpus is not None else TokenCorpus.builtin()
    except (OSError, ValueError) as exc:
        raise CliError(f"--corpus {corpus}: {exc}") from exc
    try:
        return tokens.windows(seq_len)
    except ValueError as exc:
        raise CliError(f"--corpus {corpus or '(built-in)'}: {exc}") from exc


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_verb(
        subparsers, "train",
        help="a short local DiLoCo run: K simulated hosts, compressed pseudo-gradients, outer Nesterov",
        examples=["gonka-node train --preset tiny --rounds 4 --out run1",
                  "gonka-node train --init run1/model.safetensors --first-round 4 --rounds 4 --out run2"],
        next="gonka-node checkpoint generate --checkpoint run1/model.safetensors --prompt \"def \"",
    )
    parser.add_argument("--preset", default="devnet", choices=PRESET_NAMES,
                        help="model preset (default: devnet, ~1M parameters)")
    parser.add_argument("--workers", type=int, default=2, help="simulated hosts (default: 2)")
    for flag, name in RECIPE_FLAGS.items():
        default = local_default(name)
        choices = FLAG_CHOICES.get(name)
        parser.add_argument(flag, dest=name, type=type(default), default=default, help=recipe_help(name, default),
                            choices=choices, metavar=None if choices else flag[2:].upper().replace("-", "_"))
    add_codec_flag(parser, local_default("codec"))
    parser.add_argument("--corpus", type=Path, help="text file or folder (default: Python's stdlib sources)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data assignment seed")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: robust when cores are shared)"
    )
    parser.add_argument(
        "--init",
        type=Path,
        metavar="CHECKPOINT",
        help="start from this safetensors checkpoint (a pulled round, or an earlier run's model.safetensors) "
        "instead of a random init",
    )
    parser.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="start at this round of the seed's data stream (continuing an earlier run of the same --seed: "
        "its number of rounds, so no window is seen twice)",
    )
    parser.add_argument("--out", type=Path, help="write DIR/summary.json and the final DIR/model.safetensors")
    parser.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if args.threads <= 0:
        raise CliError(f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)
    try:
        recipe = local_recipe(
            ModelConfig.preset(args.preset),
            seed=args.seed,
            codec=args.codec,
            corpus=str(args.corpus) if args.corpus is not None else BUILTIN_CORPUS,
            **{name: getattr(args, name) for name in RECIPE_FLAGS.values()},
        )
        get_codec(recipe.codec)  # raises ValueError naming the choices
        config = LocalRunConfig(recipe=recipe, workers=args.workers)
    except ValueError as exc:  # RecipeError included: it names the field
        raise CliError(str(exc)) from exc
    initial = _initial_weights(args.init) if args.init is not None else None
    windows = load_windows(args.corpus, recipe.seq_len)
    try:
        if args.first_round < 0:
            raise CliError(f"--first-round must be >= 0, got {args.first_round}")
        run = LocalDiLoCo(config, windows, initial, args.first_round)
    except ValueError as exc:
        # a recipe the model cannot take (more fragments than tensors) is the flags' mistake, not --init's
        blame_init = args.init is not None and not isinstance(exc, FragmentError)
        raise CliError(f"--init {args.init}: {exc} (preset {args.preset})" if blame_init else str(exc)) from exc
    summary = RunSummary(
        config={**recipe.to_dict(), "workers": config.workers, "eval_windows": config.eval_windows,
                "preset": args.preset},
        params=sum(p.numel() for p in run.params.values()),
        initial_heldout_loss=run.heldout_loss(),
    )
    console.print(
        f"DiLoCo: {args.preset} model ({summary.params:,} parameters), {config.workers} hosts × "
        f"{recipe.n_rounds} rounds × H={recipe.inner_steps}, codec {recipe.codec}, "
        f"{'from ' + str(args.init) if args.init else 'from a random init'}, "
        f"held-out loss {summary.initial_heldout_loss:.3f}"
    )
    _train_with_progress(run, recipe, summary, console)
    ddp = ddp_bytes_per_worker(summary.params, recipe.total_inner_steps)
    console.print(_summary_table(summary, config, ddp))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        metadata = {MODEL_CONFIG_KEY: json.dumps(recipe.model.to_dict(), sort_keys=True)}
        sha256 = save_checkpoint(args.out / "model.safetensors", run.params, metadata)
        report = {**summary.to_json(ddp), "init": str(args.init) if args.init else None, "final_sha256": sha256}
        (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.out / 'summary.json'} and {args.out / 'model.safetensors'} (sha256 {sha256})")
    return 0


def _initial_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_checkpoint(path).tensors
    except CheckpointError as exc:
        raise CliError(f"--init {path}: {exc}") from exc


def _train_with_progress(run: LocalDiLoCo, recipe: Recipe, summary: RunSummary, console: Any) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("round 1", total=recipe.total_inner_steps * run.config.workers)

        def on_step(worker: int, step: int, loss: float) -> None:
            done = run.round - run.first_round
            desc = f"round {done + 1}/{recipe.n_rounds} host {worker} step {step} loss {loss:.3f}"
            progress.update(task, advance=1, description=desc)

        for _ in range(recipe.n_rounds):
            report = run.run_round(on_step)
            summary.rounds.append(report)
            progress.console.print(
                f"round {report.round}: held-out loss {report.heldout_loss:.3f} "
                f"({report.bytes_per_worker:,} bytes per host, {report.seconds:.1f} s)"
            )


def _summary_table(summary: RunSummary, config: LocalRunConfig, ddp_total: int) -> Any:
    from rich.table import Table

    table = Table(title=f"DiLoCo vs data-parallel all-reduce every step ({config.recipe.codec})")
    for column in ("round", "held-out loss", "bytes/host", "DDP bytes/host", "reduction"):
        table.add_column(column, justify="right")
    ddp_round = ddp_total // config.recipe.n_rounds
    table.add_row("0", f"{summary.initial_heldout_loss:.3f}", "-", "-", "-")
    for r in summary.rounds:
        table.add_row(
            str(r.round),
            f"{r.heldout_loss:.3f}",
            f"{r.bytes_per_worker:,}",
            f"{ddp_round:,}",
            _ratio(ddp_round, r.bytes_per_worker),
        )
    table.add_row(
        "total",
        f"{summary.final_loss:.3f}",
        f"{summary.bytes_per_worker:,}",
        f"{ddp_total:,}",
        _ratio(ddp_total, summary.bytes_per_worker),
        style="bold",
    )
    return table


def _ratio(ddp: int, sent: int) -> str:
    return f"{ddp / sent:,.0f}×" if sent else "∞"
