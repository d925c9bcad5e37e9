"""Byzantine benchmark: the same epoch honest-only, then with 25% of hosts adversarial (each behaviour
of the adversary kit, and `rotate`: a different one each round). Each epoch runs in its own process
(`--jobs` at once) with its own embedded chain, aggregator gRPC server and host threads
(gonka_node/testing/byzantine.py). By default the recipe's rounds start fresh and the aggregator replays every
host's round (`--round-state`, `--replay-fraction`).

Reports, per run: final held-out loss and its ratio to the honest-only run, GNK paid to adversaries
and to honest hosts, stake lost (read back from the chain) and the adversaries' net GNK, honest
host-rounds left out of the aggregate (with the reasons) and honest hosts slashed, and how long after
its deadline each round closed. Then, per attack, whether it met the targets (`targets`): attacks that
skip training come out with net GNK ≤ 0; misreporting ones earn per round no more than the median
honest host; `stall` delays no close by more than `--grace` beyond the honest-only run's; the final
loss stays within 2% of honest-only; no honest host is slashed or left out more than honest-only.
Writes JSON and a bar plot.

    .venv/bin/python scripts/bench_byzantine.py --out /tmp/byz.json
    .venv/bin/python scripts/bench_byzantine.py --attacks sign_flip,copy --preset tiny --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gonka_node.core.config import AggregationSettings
from gonka_node.core.recipe import BUILTIN_CORPUS, Recipe
from gonka_node.testing.adversary import BEHAVIOURS
from gonka_node.testing.byzantine import GNK, EpochPlan, EpochReport, run_epoch
from training.model import ModelConfig

TARGET_LOSS_RATIO = 1.02
SKIPS_TRAINING = ("mix", "aggregate_reuse", "grind", "front_run", "lazy_zero", "lazy_base")
MISREPORTS = ("scale3", "scale_half")
# nan, inf and wrong_shape also run inside "protocol" (every refused-at-the-door attack in one round).
DEFAULT_ATTACKS = [b for b in BEHAVIOURS if b not in ("nan", "inf", "wrong_shape")]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench_byzantine.json"))
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--attacks", default=",".join(DEFAULT_ATTACKS), help="comma-separated behaviours")
    ap.add_argument("--hosts", type=int, default=4, help="one of them is the adversary (4 → 25%%)")
    ap.add_argument("--adversaries", type=int, default=1)
    ap.add_argument("--preset", default="devnet")
    ap.add_argument("--corpus", default="", help="default: the built-in corpus, as the devnet")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--rule", default="clip_median", help="robust aggregation rule")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (hosts run in parallel threads)")
    ap.add_argument("--jobs", type=int, default=2, help="epochs run at once, one process each")
    ap.add_argument("--round-state", choices=("fresh", "carry"), default="fresh",
                    help="the recipe's round_state; 'fresh' makes rounds replayable")
    ap.add_argument("--replay-fraction", type=float, default=1.0,
                    help="the epoch's replay probability p (needs --round-state fresh when > 0; 0: no replay "
                    "check, and by the stake rule no rewards either)")
    ap.add_argument("--stake", type=float, default=None,
                    help="each host's stake in GNK (the epoch's min_stake; default: reward per round / p, the "
                    "least the chain's stake rule allows)")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="seconds a round may close later than in the honest-only run (the stall target)")
    ap.add_argument("--stall-cap", type=float, default=120.0,
                    help="seconds a staller holds its stream before cancelling it itself")
    return ap.parse_args()


def recipe_of(a: argparse.Namespace) -> Recipe:
    return Recipe(model=ModelConfig.preset(a.preset), corpus=a.corpus or BUILTIN_CORPUS, seq_len=a.seq_len,
                  micro_batch=a.micro_batch, inner_steps=a.inner_steps, inner_lr=3e-3,
                  warmup_steps=min(10, a.inner_steps // 2), n_rounds=a.rounds,
                  codec=a.codec, round_state=a.round_state).with_data_manifest()


def run_row(attack: str, report: EpochReport, honest: EpochReport, grace_s: float) -> dict[str, Any]:
    slashes = [{"host": d.host, "behaviour": report.adversaries.get(d.host, "honest"),
                "kind": d.evidence.kind, "ngonka": d.amount, "evidence_sha256": d.evidence.hash.hex()}
               for d in report.slashed]
    excluded = report.honest_excluded()
    return {
        "attack": attack,
        "final_loss": report.final_loss,
        "loss_ratio": report.final_loss / honest.final_loss,
        "adversary_gnk": report.gnk(adversarial=True),
        "honest_gnk": report.gnk(adversarial=False),
        "honest_gnk_per_host": report.honest_gnk_per_host(),
        "gnk_by_round": gnk_by_round(report),
        "stake_lost_gnk": {h: lost / GNK for h, lost in report.stake_lost.items() if lost},
        "slashed": report.slashed_adversary(),
        "net_gnk": report.net_gnk(),
        "slashes": slashes,
        "honest_slashed": report.honest_slashed(),
        "honest_excluded": len(excluded),
        "honest_excluded_reasons": [{"host": h, "round": r, "reasons": why} for h, r, why in excluded],
        "max_close_delay_s": report.max_close_delay_s(),
        "close_delay_s": report.close_delay_s,
        "outcomes": sorted({f"{o.attack}: {o.reason or 'accepted'}" for os in report.outcomes.values() for o in os}),
        "attempts": [{"round": o.round, "attack": o.attack, "accepted": o.accepted, "reason": o.reason,
                      "facts": dict(o.facts)} for os in report.outcomes.values() for o in os],
        "seconds": report.seconds,
        "within_target": report.final_loss / honest.final_loss <= TARGET_LOSS_RATIO,
        "targets": targets(attack, report, honest, grace_s),
        "replay": replay_summary(report),
    }


def gnk_by_round(report: EpochReport) -> dict[int, dict[str, float]]:
    """Per round: the most any adversary earned and the median honest host's pay, in GNK."""
    return {r: {"adversary_max": max((report.round_rewards.get(h, {}).get(r, 0) for h in report.adversaries),
                                     default=0) / GNK,
                "honest_median": report.median_honest_reward(r) / GNK} for r in report.rounds}


def targets(attack: str, report: EpochReport, honest: EpochReport, grace_s: float) -> dict[str, bool]:
    """The issue's targets that apply to `attack`, each met or not."""
    met = {
        "loss_within_2pct": report.final_loss / honest.final_loss <= TARGET_LOSS_RATIO,
        "honest_unharmed": report.honest_slashed() == 0
        and len(report.honest_excluded()) <= len(honest.honest_excluded()),
    }
    if attack in SKIPS_TRAINING:
        met["net_gnk_at_most_0"] = report.net_gnk() <= 0
    if attack in MISREPORTS:
        met["per_round_at_most_median_honest"] = all(
            v["adversary_max"] <= v["honest_median"] for v in gnk_by_round(report).values()
        )
    if attack == "stall":
        met["close_within_grace"] = report.max_close_delay_s() <= honest.max_close_delay_s() + grace_s
    return met


def summary_line(row: dict[str, Any]) -> str:
    t = row["targets"]
    verdict = "met" if all(t.values()) else "NOT met: " + ", ".join(k for k, ok in t.items() if not ok)
    return (f"{row['attack']:>16}: {verdict}  (net {row['net_gnk']:+.3f} GNK, loss ×{row['loss_ratio']:.4f}, "
            f"honest excluded {row['honest_excluded']}, slashed {row['honest_slashed']}, "
            f"close delay ≤ {row['max_close_delay_s']:.1f} s)")


def replay_summary(report: EpochReport) -> dict[str, list[list[float]]]:
    """The replay check's (cosine, norm ratio) per round, for honest hosts and for adversaries."""
    out: dict[str, list[list[float]]] = {"honest": [], "adversary": []}
    for host, by_round in report.reasons.items():
        side = "adversary" if host in report.adversaries else "honest"
        for lines in by_round.values():
            for line in lines:
                if line.startswith(("replay: cosine", "replay mismatch: cosine")):
                    cos = float(line.split("cosine ")[1].split(",")[0])
                    ratio = float(line.split("norm ratio ")[1].split()[0])
                    out[side].append([cos, ratio])
    return out


def run_named(job: tuple[str, EpochPlan, Path, int]) -> EpochReport:
    """One epoch in its own process (its own aggregator, chain and host threads)."""
    name, plan, root, threads = job
    torch.set_num_threads(threads)
    rep = run_epoch(plan, root / name, root / "cache")
    replays = replay_summary(rep)
    honest = min((c for c, _ in replays["honest"]), default=float("nan"))
    print(f"{name:>16}: loss {rep.final_loss:.4f}  adversary {rep.gnk(True):7.3f} GNK (net {rep.net_gnk():+.3f})  "
          f"honest {rep.gnk(False):7.3f} GNK  slashed {[d.evidence.kind for d in rep.slashed]}  "
          f"honest replay cosine ≥ {honest:+.4f}  close delay ≤ {rep.max_close_delay_s():.1f} s  "
          f"({rep.seconds:.0f} s)", flush=True)
    return rep


def main() -> int:
    a = parse()
    torch.set_num_threads(a.threads)
    attacks = [x for x in a.attacks.split(",") if x]
    unknown = sorted(set(attacks) - set(BEHAVIOURS))
    if unknown:
        raise SystemExit(f"--attacks: unknown behaviour(s) {unknown}; choose from {', '.join(BEHAVIOURS)}")
    if not 1 <= a.adversaries < a.hosts <= 8:
        raise SystemExit("--hosts must be in (adversaries, 8] and --adversaries >= 1")
    if a.replay_fraction > 0 and a.round_state != "fresh":
        raise SystemExit("--replay-fraction > 0 needs --round-state fresh (a 'carry' round cannot be replayed)")
    if (a.stake is not None and a.stake <= 0) or a.grace < 0 or a.stall_cap <= 0:
        raise SystemExit("--stake and --stall-cap must be positive and --grace at least 0")
    if not 0 <= a.replay_fraction <= 1:
        raise SystemExit("--replay-fraction must be in [0, 1]")
    recipe = recipe_of(a)
    agg = AggregationSettings(rule=a.rule)
    reward = 100 * GNK if a.replay_fraction > 0 else 0  # the stake rule: an unverified epoch cannot pay
    bad = {a.hosts - k: "" for k in range(a.adversaries)}  # the last hosts; host 1 is the tapped victim
    plans = {"honest": {}} | {x: {i: x for i in bad} for x in attacks}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_byz_") as tmp:
        root = Path(tmp)
        recipe.windows(root / "cache")  # tokenize once, before the epochs share the cache
        # A staller may hold every round's close for its whole cap (today's aggregator does wait).
        timeout = 900.0 + (a.rounds * a.stall_cap if "stall" in attacks else 0.0)
        stake = None if a.stake is None else int(a.stake * GNK)
        jobs = [(name, EpochPlan(recipe, a.hosts, adv, reward_per_round=reward, aggregation=agg,
                                 replay_probability=a.replay_fraction, stake=stake, stall_cap_s=a.stall_cap,
                                 timeout_s=timeout), root, a.threads)
                for name, adv in plans.items()]
        with ProcessPoolExecutor(max(1, a.jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
            reports = dict(zip(plans, pool.map(run_named, jobs), strict=True))
    honest = reports.pop("honest")
    rows = [run_row(x, reports[x], honest, a.grace) for x in attacks]
    out = {
        "honest_loss": honest.final_loss,
        "initial_loss": honest.initial_loss,
        "honest_only_gnk": honest.gnk(adversarial=False),
        "honest_only_gnk_per_host": honest.honest_gnk_per_host(),
        "honest_only_slashed": len(honest.slashed),
        "honest_only_excluded": len(honest.honest_excluded()),
        "honest_only_max_close_delay_s": honest.max_close_delay_s(),
        "runs": rows,
        "summary": [summary_line(r) for r in rows],
        "setup": {"hosts": a.hosts, "adversaries": a.adversaries, "preset": a.preset,
                  "params": recipe.model.num_params(), "rounds": a.rounds, "inner_steps": a.inner_steps,
                  "seq_len": a.seq_len, "micro_batch": a.micro_batch, "codec": a.codec, "rule": a.rule,
                  "corpus": a.corpus or "built-in", "round_state": a.round_state,
                  "replay_fraction": a.replay_fraction, "jobs": a.jobs, "stake_gnk": honest.stake / GNK,
                  "grace_s": a.grace, "stall_cap_s": a.stall_cap},
        "seconds": round(time.monotonic() - started, 1),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    plot(a.plot or a.out.with_suffix(".png"), out)
    print("targets per attack:", *out["summary"], sep="\n")
    print(f"wrote {a.out} ({out['seconds']:.0f} s)")
    return 0


def plot(path: Path, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    names = [r["attack"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.bar(names, [r["loss_ratio"] for r in runs], color=["C0" if r["within_target"] else "C3" for r in runs])
    ax1.axhline(TARGET_LOSS_RATIO, color="k", ls="--", lw=1, label="target (1.02)")
    ax1.axhline(1.0, color="gray", lw=0.5)
    lo = min(0.98, *(r["loss_ratio"] for r in runs))
    ax1.set_ylim(lo - 0.005, max(1.03, *(r["loss_ratio"] for r in runs)) + 0.005)
    ax1.set_ylabel("final loss / honest-only")
    ax1.legend()
    share = [r["adversary_gnk"] / max(1e-9, r["adversary_gnk"] + r["honest_gnk"]) for r in runs]
    ax2.bar(names, share, color="C1")
    ax2.set_ylabel("share of GNK paid to adversaries")
    ax2.tick_params(axis="x", rotation=60)
    s = out["setup"]
    fig.suptitle(f"byzantine bench: {s['hosts']} hosts, {s['adversaries']} adversarial, {s['params']:,} params, "
                 f"{s['rounds']} rounds × H={s['inner_steps']}, {s['rule']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
