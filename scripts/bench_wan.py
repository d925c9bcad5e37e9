"""Compute utilisation of a host over home links: a 1.2B model, real payload sizes, simulated compute.

For Llama-3.2-1B's tensor shapes (1.236B parameters; the `1b` preset with its 128,256-token vocabulary
and tied embeddings), each codec's payload size is the real codec's (`Codec.encoded_size`, exact and
data-independent, checked against `encode` on real tensors of a few of the shapes). A round's compute is
simulated as H × the measured H200 step time (0.237 s per 16k-token step at 1.2B). Transfers run through
the host's own link limiter (`gonka_node.core.link.TokenBucket`, 1 MiB chunks as the gRPC client sends them)
on a simulated clock, so no time scaling is needed and the run takes seconds.

The timeline is the host daemon's (gonka_node/host/node.py), per round r:

- `overlap = "off"`: train r; upload r; the round closes `--close-s` after the last upload arrives
  (every host is alike, so the last upload is this one's); download the round's update; apply it
  (`--apply-s`: the outer step and the sha256 check of the new model); train r + 1.
- `overlap = "delayed"`: train r from the model after r − 2; the upload of r starts when r is trained
  and r is open (it opens when r − 1 closes), queued behind the previous upload on the same uplink; the
  upload thread downloads r's update as soon as r closes; before training r + 1 the daemon waits for
  the update of r − 1 and applies it (`--apply-s`, on the training path).

Utilisation = inner-step seconds / wall seconds from the start of round 1 to the end of round R's
training (the host's own `gonka_host_utilisation` figure over the epoch). The download is the dense
fp32 update (`broadcast = "dense"`) or the round's update encoded with the epoch's codec
(`broadcast = "codec"`, docs/PROTOCOL.md "Compressed download").

    .venv/bin/python scripts/bench_wan.py --out wan.json --plot docs/bench_wan.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gonka_node.core.link import LinkSpec, TokenBucket
from training.codecs import Codec, get_codec
from training.model import Llama, ModelConfig

LINKS = ("1000/1000", "100/10", "20/5")
CODECS = {"int8": "int8", "top-k": "topk:chunk=4096,k=128,bits=2"}  # top-k: the benchmarked 1,798× codec
CHUNK = 1 << 20  # the gRPC client's chunk (the round's max_chunk_bytes)


@dataclass(frozen=True)
class Timing:
    steps: int  # H
    step_s: float  # seconds per inner step (H200, 1.2B, 16k tokens)
    close_s: float  # the aggregator's close after the last upload: decode, check, aggregate, step, finalize
    apply_s: float  # the host's outer step and sha256 of the new model (overlap on: in the upload thread)
    save_s: float  # the host's snapshot of each new model (on the training path in both modes)
    rounds: int
    latency_ms: float

    @property
    def compute_s(self) -> float:
        return self.steps * self.step_s


def llama_1b_spec() -> dict[str, tuple[int, ...]]:
    cfg = dataclasses.replace(ModelConfig.preset("1b"), vocab_size=128_256, tie_embeddings=True)
    model = Llama(cfg, device="meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def checked_size(codec: Codec, spec: Mapping[str, tuple[int, ...]]) -> int:
    """The payload size for `spec`, after checking `encode` on real random tensors of two of its shapes
    (a norm weight and one projection) gives exactly what the size formula says."""
    names = sorted(spec)
    sample = [n for n in names if n.endswith("input_layernorm.weight")][:1] + [n for n in names if "k_proj" in n][:1]
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(spec[n], generator=gen) * 1e-3 for n in sample}
    if len(codec.encode(tensors)) != codec.encoded_size({n: spec[n] for n in sample}):
        raise SystemExit(f"{codec.name}: encode and encoded_size disagree")
    return codec.encoded_size(spec)


def send(bucket: TokenBucket, n: int, at: float) -> float:
    """Push `n` bytes through `bucket` from time `at` in the client's chunks; returns when they passed."""
    done, first = at, True
    for start in range(0, n, CHUNK):
        done = bucket.reserve(min(CHUNK, n - start), at, first)
        first = False
    return max(done, at)


def simulate(link: str, up_bytes: int, down_bytes: int, overlap: str, t: Timing) -> dict[str, Any]:
    spec = LinkSpec.parse(f"{link}@{t.latency_ms:g}")
    buckets = spec.buckets(clock=lambda: 0.0)
    ends: list[float] = [0.0]  # end of training of round r (index r); round 0 = the start
    closed: list[float] = [0.0]  # when round r closed at the aggregator
    fetched: list[float] = [0.0]  # when the host holds round r's update
    ready: dict[int, float] = {0: 0.0}  # delayed: when the upload thread has computed the model after r
    for r in range(1, t.rounds + 1):
        if overlap == "off":  # download, apply and save on the training path
            start = fetched[r - 1] + (t.apply_s + t.save_s if r > 1 else 0.0)
        else:  # adopt the model computed ahead, then save it; nothing to apply for rounds 1 and 2
            start = max(ends[r - 1], ready[r - 2] if r >= 3 else 0.0) + (t.save_s if r >= 3 else 0.0)
            # The thread of round r − 1 steps a copy of the model the daemon holds from now on.
            ready[r - 1] = max(fetched[r - 1], start) + t.apply_s
        ends.append(start + t.compute_s)
        opens = closed[r - 1] if overlap == "delayed" else 0.0
        uploaded = send(buckets.up, up_bytes, max(ends[r], opens))
        closed.append(uploaded + t.close_s)
        fetched.append(send(buckets.down, down_bytes, closed[r]))
    wall = ends[-1]
    per_round = [round(t.compute_s / (ends[r] - ends[r - 1]), 4) for r in range(1, t.rounds + 1)]
    return {"utilisation": round(t.rounds * t.compute_s / wall, 4), "utilisation_per_round": per_round,
            "round_wall_s": round(ends[-1] - ends[-2], 2)}


def measure_apply(params: int, numel: int = 1 << 22) -> dict[str, Any]:
    """The host's outer step (bit-exact `fma32`, training/diloco.py) and sha256 of one tensor of `numel`
    elements on this machine's CPU with torch's threads, scaled linearly to `params`."""
    from training.checkpoint import canonical_sha256
    from training.diloco import OuterOptimizer

    gen = torch.Generator().manual_seed(0)
    p, g = {"w": torch.randn(numel, generator=gen)}, {"w": torch.randn(numel, generator=gen) * 1e-3}
    outer = OuterOptimizer(0.7, 0.9)
    outer.step(p, g)  # the first step only copies the momentum: time the second
    started = time.perf_counter()
    outer.step(p, g)
    step_s = time.perf_counter() - started
    started = time.perf_counter()
    canonical_sha256(p)
    hash_s = time.perf_counter() - started
    scale = params / numel
    return {"threads": torch.get_num_threads(), "numel": numel, "step_s": round(step_s * scale, 1),
            "sha256_s": round(hash_s * scale, 1), "where": "this machine's CPU (shared), scaled to the model"}


def sensitivity(up: int, down: int, t: Timing) -> list[dict[str, Any]]:
    """The target configuration (100/10, top-k, overlap on, compressed download) at other host apply times."""
    return [{"apply_s": a, "utilisation": simulate("100/10", up, down, "delayed", dataclasses.replace(t, apply_s=a))
             ["utilisation"]} for a in (0.0, 15.0, 30.0, 45.0, 60.0, 120.0)]


def run(t: Timing, apply_measured: bool = False) -> dict[str, Any]:
    """`apply_measured`: the host's apply is this machine's measured outer step plus sha256 (scaled to
    the model), not `t.apply_s`."""
    spec = llama_1b_spec()
    params = sum(int(torch.Size(s).numel()) for s in spec.values())
    measured = measure_apply(params)
    if apply_measured:
        t = dataclasses.replace(t, apply_s=measured["step_s"] + measured["sha256_s"])
    dense = get_codec("fp32").encoded_size(spec)
    runs = []
    for codec_label, codec_name in CODECS.items():
        size = checked_size(get_codec(codec_name), spec)
        for link in LINKS:
            for overlap in ("off", "delayed"):
                for broadcast, down in (("dense", dense), ("codec", size)):
                    result = simulate(link, size, down, overlap, t)
                    runs.append({"params": params, "link": link, "codec": codec_label, "codec_spec": codec_name,
                                 "overlap": "on" if overlap == "delayed" else "off", "overlap_mode": overlap,
                                 "broadcast": broadcast, "upload_bytes": size, "download_bytes": down, **result})
    topk = checked_size(get_codec(CODECS["top-k"]), spec)
    return {
        "model": "Llama-3.2-1B shapes (preset 1b, vocab 128256, tied embeddings)",
        "params": params,
        "apply_measured": measured,
        "apply_s_source": "measured (apply_measured: step_s + sha256_s)" if apply_measured else "--apply-s",
        "target": {"link": "100/10", "codec": "top-k", "overlap": "on", "broadcast": "codec",
                   "steps": t.steps, "utilisation_goal": 0.98},
        "sensitivity_to_apply_s": sensitivity(topk, topk, t),
        "compute": f"simulated: H x {t.step_s} s per inner step (H200, 16k tokens, measured), no GPU used",
        "clock": "simulated (the link limiter's own arithmetic on a simulated clock); time_scale 1.0",
        "time_scale": 1.0,
        "timing": dataclasses.asdict(t) | {"compute_s": t.compute_s},
        "runs": runs,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, codec in zip(axes, CODECS, strict=True):
        rows = [r for r in report["runs"] if r["codec"] == codec]
        labels = [f"{o}/{b}" for o in ("off", "on") for b in ("dense", "codec")]
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            o, b = label.split("/")
            values = [next(r["utilisation"] for r in rows if r["link"] == link and r["overlap"] == o
                           and r["broadcast"] == b) for link in LINKS]
            ax.bar([x + i * width for x in range(len(LINKS))], values, width, label=f"overlap {o}, download {b}")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(LINKS))], [f"{link} Mbit/s" for link in LINKS])
        ax.axhline(0.98, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{codec}: upload {rows[0]['upload_bytes'] / 1e6:,.0f} MB per round")
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(f"utilisation (H = {report['timing']['steps']})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("--plot", type=Path, help="PNG of utilisation by link, codec, overlap and download")
    p.add_argument("--steps", type=int, default=500, help="H, inner steps per round (default 500)")
    p.add_argument("--step-s", type=float, default=0.237, help="seconds per inner step (default 0.237, H200)")
    p.add_argument("--close-s", type=float, default=10.0, help="the aggregator's close after the last upload")
    p.add_argument("--apply-s", type=float, default=60.0,
                   help="the host's outer step and sha256 of the new model on its CPU (default 60; see the JSON)")
    p.add_argument("--apply-measured", action="store_true",
                   help="use this machine's measured outer step + sha256 (scaled to the model) as --apply-s")
    p.add_argument("--save-s", type=float, default=0.0,
                   help="the host's per-round snapshot write, on the training path (default 0: not modelled)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--latency-ms", type=float, default=20.0, help="before each transfer's first byte")
    args = p.parse_args()
    timing = Timing(args.steps, args.step_s, args.close_s, args.apply_s, args.save_s, args.rounds, args.latency_ms)
    report = run(timing, args.apply_measured)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in report["runs"]:
        print(f"{r['link']:>9} {r['codec']:>5} overlap {r['overlap']:>3} download {r['broadcast']:>5}: "
              f"up {r['upload_bytes'] / 1e6:8,.1f} MB down {r['download_bytes'] / 1e6:8,.1f} MB "
              f"utilisation {r['utilisation']:.3f} (round {r['round_wall_s']:.0f} s)")
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
