"""Streamed epochs over home links: each round's upload and the host's utilisation, at P fragments.

A streamed epoch (training/streaming.py, the recipe's `stream_fragments = P`) syncs one fragment of the
model a round of H / P inner steps, so each fragment still syncs every H steps and the epoch's compute
is unchanged. This bench runs bench_wan's host timeline (scripts/bench_wan.py `simulate`, same link
limiter on a simulated clock) with P times the rounds, each of:

- H / P steps of simulated compute (H × 0.237 s, the H200 step at 1.2B, as bench_wan);
- up, and down (a compressed broadcast): a fragment's real payload (`training.fragments.plan_fragments`,
  balanced by whole tensors; the codec's exact `encoded_size`, checked against `encode`). The timeline
  takes one figure for every round, so each P gets two rows: `fragment = "mean"` (the P fragments'
  payloads summed, over P: what the link carries per round on average, exact over P rounds) and
  `"largest"` (the largest fragment's every round: a bound; the 1.2B model's tied embedding alone is
  21 % of it, so past P = 4 the largest fragment stops shrinking);
- the work proportional to the fragment, scaled to its share of the model from bench_wan's measured
  whole-model figures (`--measured`: a bench_wan JSON): the seal (pseudo-gradient, compress), the
  decode, the outer step and the hash (the round's hash taken as a Merkle root over fragment hashes, as
  a sharded epoch's, so only the synced fragment is hashed again), and the aggregator's close
  (`close_s`); a streamed round signs no residual root (no root time);
- the writer's saves whole, each round, since a streamed host's own model and AdamW state change whole
  every round: the round's save with the AdamW moments beside the residuals (2 × bench_wan's, which has
  residuals only) and the snapshot with the host's own model beside the global one and its momentum
  (1.5 × bench_wan's);
- overlap "off" (the sync in place: the host waits for its fragment's result) or "delayed" (the
  fragment lands one round late, merged before the round after next: bench_wan's "delayed" timeline).

P = 1 is bench_wan's own row for the mode (a whole-model round, its root and saves as measured).
Streamed epochs run in the local simulation; the network does not serve them yet (docs/PROTOCOL.md
"Streaming fragments"), so this is the host they would make.

    .venv/bin/python scripts/bench_wan_stream.py --measured docs/bench_wan.json --out docs/bench_wan_stream.json \
        --plot docs/bench_wan_stream.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_wan import (
    CODECS,
    LINKS,
    Timing,
    checked_size,
    host_timing,
    llama_1b_spec,
    scaled_host,
    simulate,
    speculates,
)

from training.codecs import get_codec
from training.fragments import FragmentError, plan_fragments

FRAGMENTS = (1, 2, 4, 5, 10)  # divisors of bench_wan's H = 500
STREAM_OVERLAPS = ("off", "delayed")  # what a streamed recipe allows (gonka_node/core/recipe.py)


# A streamed round's writer against a whole-model fresh round's (bench_wan's measures): the round's save
# holds the AdamW moments beside both residuals; the snapshot the host's own model beside the global
# model and its momentum.
SAVE_SCALE, SNAPSHOT_SCALE = 2.0, 1.5


def streamed_host(measured: Mapping[str, Any], share: float) -> dict[str, Any]:
    """bench_wan's measured host work for a streamed round whose fragment is `share` of the model: what
    is proportional to the fragment scaled to it, no residual root, the writer's saves whole."""
    host = scaled_host(measured, share)
    seal = measured["seal"]
    host["seal"] |= {"save_s": seal["save_s"] * SAVE_SCALE, "snapshot_s": seal["snapshot_s"] * SNAPSHOT_SCALE,
                     "root_s": {label: 0.0 for label in seal["root_s"]}}
    return host


def run(t: Timing, measured: Mapping[str, Any], fragments: Sequence[int] = FRAGMENTS) -> dict[str, Any]:
    """Every (P, fragment kind, codec, overlap, link) row: the payload each way a round, and the utilisation."""
    spec = llama_1b_spec()
    params = sum(int(torch.Size(s).numel()) for s in spec.values())
    runs = []
    for p in fragments:
        if t.steps % p:
            raise SystemExit(f"H = {t.steps} is not a multiple of {p} fragments")
        plan = plan_fragments(spec, p, what="fragments")
        largest = max(plan, key=lambda f: f.numel)
        for codec_label, codec_name in CODECS.items():
            codec = get_codec(codec_name)
            sizes = [checked_size(codec, f.spec(spec)) for f in plan]
            kinds = [("mean", 1 / p, round(sum(sizes) / p))]
            if p > 1:
                kinds.append(("largest", largest.numel / params, max(sizes)))
            for kind, share, size in kinds:
                host = streamed_host(measured, share) if p > 1 else dict(measured)
                for overlap in STREAM_OVERLAPS:
                    speculated = speculates(overlap, "codec", codec_name)
                    timing = host_timing(dataclasses.replace(t, steps=t.steps // p, rounds=t.rounds * p,
                                                             close_s=t.close_s * share),
                                         host, overlap, speculated, codec_label, "codec")
                    for link in LINKS:
                        # the per-round figures left out: 12 x P rounds each, bench_wan's JSON has P = 1's
                        result = {k: v for k, v in simulate(link, size, size, overlap, timing).items()
                                  if k != "utilisation_per_round"}
                        runs.append({"params": params, "fragments": p, "fragment": kind, "share": round(share, 4),
                                     "link": link, "codec": codec_label, "codec_spec": codec_name,
                                     "overlap": overlap, "broadcast": "codec", "steps_per_round": timing.steps,
                                     "upload_bytes": size, "download_bytes": size, "step_ahead": speculated,
                                     "seal_s": round(timing.seal_s, 2), "keep_s": round(timing.keep_s, 2),
                                     "snapshot_s": round(timing.save_s, 2), "apply_s": round(timing.apply_s, 2),
                                     "close_s": round(timing.close_s, 2), **result})
    return {
        "model": "Llama-3.2-1B shapes (preset 1b, vocab 128256, tied embeddings)",
        "params": params,
        "sync_every_steps": t.steps,
        "host_work": "bench_wan's measured whole-model figures (apply_measured): the fragment's work and the "
                     f"close scaled to its share, no residual root; the writer whole, the round's save x{SAVE_SCALE} "
                     f"and the snapshot x{SNAPSHOT_SCALE} (the AdamW moments, the host's own model)",
        "compute": f"simulated: H / P x {t.step_s} s per inner step (H200, 16k tokens, measured), no GPU used",
        "timing": dataclasses.asdict(t) | {"compute_s": t.compute_s},
        "runs": runs,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6))
    colors = dict(zip(LINKS, ("tab:green", "tab:blue", "tab:red"), strict=True))
    for codec, marker in zip(CODECS, ("s", "o"), strict=True):
        rows = [r for r in report["runs"] if r["codec"] == codec and r["link"] == LINKS[0] and r["overlap"] == "off"]
        for kind, style in (("mean", "-"), ("largest", "--")):
            shown = [r for r in rows if r["fragment"] == kind or r["fragments"] == 1]
            left.plot([r["fragments"] for r in shown], [r["upload_bytes"] / 1e6 for r in shown], style, marker=marker,
                      color="black", label=f"{codec}: {kind} fragment")
        for link in LINKS:
            for overlap, style in (("off", ":"), ("delayed", "-")):
                rows = [r for r in report["runs"] if r["codec"] == codec and r["link"] == link and r["overlap"] == overlap
                        and r["fragment"] == "mean"]
                right.plot([r["fragments"] for r in rows], [r["utilisation"] for r in rows], style, marker=marker,
                           color=colors[link], label=f"{codec}, {link} Mbit/s, overlap {overlap}")
    left.set(xscale="log", yscale="log", xlabel="fragments P", ylabel="upload per round (MB)",
             title="each round's upload (= its compressed download)")
    right.set(xscale="log", xlabel="fragments P", ylabel="utilisation (mean fragment)", ylim=(0, 1.05),
              title=f"utilisation, each fragment synced every H = {report['sync_every_steps']} steps")
    right.axhline(0.98, color="gray", linestyle="--", linewidth=1)
    for ax in (left, right):
        ps = sorted({r["fragments"] for r in report["runs"]})
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", type=Path, required=True,
                   help="a bench_wan JSON written with --apply-measured: the host's work and the timing it ran")
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("--plot", type=Path, help="PNG: upload per round and utilisation against P")
    p.add_argument("--fragments", default=",".join(map(str, FRAGMENTS)),
                   help="the values of P, comma-separated divisors of the report's H (default %(default)s)")
    args = p.parse_args(argv)
    try:
        fragments = tuple(int(v) for v in args.fragments.split(","))
        if any(v <= 0 for v in fragments):
            raise ValueError("each must be positive")
    except ValueError as exc:
        raise SystemExit(f"--fragments {args.fragments!r}: a comma-separated list of positive integers ({exc})") from exc
    try:
        wan = json.loads(args.measured.read_text())
        measured, timing = wan["apply_measured"], wan["timing"]
        if not isinstance(measured, dict) or "seal" not in measured:
            raise KeyError("apply_measured.seal")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--measured {args.measured}: not a bench_wan report written with --apply-measured ({exc})") from exc
    try:
        t = Timing(**{k: v for k, v in timing.items() if k != "compute_s"})
        report = run(t, measured, fragments)
    except (TypeError, FragmentError) as exc:  # another bench_wan's timing fields; more fragments than tensors
        raise SystemExit(f"--measured {args.measured} --fragments {args.fragments}: {exc}") from exc
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in report["runs"]:
        print(f"P={r['fragments']} {r['fragment']:>7} {r['link']:>9} {r['codec']:>5} overlap {r['overlap']:>7}: up/down "
              f"{r['upload_bytes'] / 1e6:8,.1f} MB a round of {r['steps_per_round']} steps, "
              f"utilisation {r['utilisation']:.3f}")
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
