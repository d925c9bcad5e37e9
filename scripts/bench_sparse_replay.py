"""Does a replay check with residual commitments tell honest top-k hosts from cheats? (issue 14)

Runs a top-k epoch of the tiny model in one process (`LocalDiLoCo`, fresh rounds, no overlap) and, for
every host of every round, what a challenge would see (training/residual_commit.py): the host opens its
residual before (e_{r−1}) and after (e_r) the round on sampled chunks, the aggregator forms
Δ̂ = decode(P_r) + e_r − d·e_{r−1} there and compares it with its replay R_r of the host's round by the
existing verdict (`gonka_node.aggregator.replay.verdict`: cosine ≥ 0.9, norm ratio within 1 ± 0.1),
and checks that each payload is the top-k compression of its decode plus the opened residual
(`payload_misfit`: selection, scales, signs, quantisation).

Beside each honest host, cheats that deviate in this round only (an honest past, the same e_{r−1}):
  skip      no training: sends C(d·e_{r−1}), truthful residual
  other     trained on another slot's windows (that slot's Δ), truthful residual
  scaled    Δ × 2, payload and residual consistent
  copy      trained, but sends another host's payload with its own honest residual
  mix       ½ own Δ + ½ another slot's Δ, truthful residual
  forged    no training, residual forged as truthful + the previous round's mean update (public): its
            best guess of R_r without computing it
and, for every case, the old comparison (decode(P_r) against R_r over all tensors) beside it.

    .venv/bin/python scripts/bench_sparse_replay.py --out sparse_replay.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gonka_node.aggregator.replay import verdict
from gonka_node.cli.train import local_recipe
from training.codecs import Codec, ErrorFeedback, TopKCodec, get_codec, spec_of
from training.data import TokenCorpus, Windows, builtin_corpus_files
from training.local import LocalDiLoCo, LocalRunConfig
from training.model import ModelConfig, build_model
from training.residual_commit import (
    ChunkLayout,
    claimed_delta,
    compare,
    gather_chunks,
    payload_misfit,
    sample_chunks,
)
from training.worker import Assignment, replay_round

Tensors = dict[str, Tensor]
CHEATS = ("skip", "other", "scaled", "copy", "mix", "forged")


class RecordingFeedback(ErrorFeedback):
    """The host's own error feedback, keeping the bytes of its last payload (the aggregator keeps them)."""

    last_payload = b""

    def compress(self, delta: Mapping[str, Tensor], codec: Codec | None = None,
                 kept: dict[str, tuple[Tensor, Tensor]] | None = None, consume: bool = False,
                 squares: dict[str, float] | None = None, part: bool = False) -> bytes:
        self.last_payload = super().compress(delta, codec, kept, consume, squares, part)
        return self.last_payload


@dataclass(frozen=True)
class Sent:
    """One host's round as a challenge sees it: the payload, e_{r−1}, e_r (what it opens)."""

    payload: bytes
    e_prev: Tensors
    e_now: Tensors


@dataclass(frozen=True)
class Bars:
    min_cosine: float
    norm_tolerance: float


def _zeros_like(ref: Mapping[str, Tensor]) -> Tensors:
    return {n: torch.zeros_like(t) for n, t in ref.items()}


def _consistent(codec: TopKCodec, decay: float, e_prev: Tensors, delta: Mapping[str, Tensor]) -> Sent:
    """What error feedback from `e_prev` sends and keeps for `delta`: a cheat consistent with itself."""
    ef = ErrorFeedback(codec, decay)
    ef.residual = dict(e_prev)
    payload = ef.compress(delta)
    return Sent(payload, e_prev, ef.residual)


def cheats(codec: TopKCodec, decay: float, slot: int, honest: list[Sent], replays: list[Tensors],
           public_guess: Tensors) -> dict[str, Sent]:
    """This round's cheats of host `slot`, each from its honest e_{r−1}; `other` is the next slot."""
    own, other = honest[slot], (slot + 1) % len(replays)
    r, o = replays[slot], replays[other]
    made = {
        "skip": _consistent(codec, decay, own.e_prev, _zeros_like(r)),
        "other": _consistent(codec, decay, own.e_prev, o),
        "scaled": _consistent(codec, decay, own.e_prev, {n: 2 * t for n, t in r.items()}),
        "copy": Sent(honest[other].payload, own.e_prev, own.e_now),
        "mix": _consistent(codec, decay, own.e_prev, {n: 0.5 * r[n] + 0.5 * o[n] for n in r}),
    }
    skip = made["skip"]
    made["forged"] = Sent(skip.payload, own.e_prev, {n: skip.e_now[n] + public_guess[n] for n in r})
    return made


def challenge(
    codec: TopKCodec, decay: float, sent: Sent, replay: Tensors, prev_payload: bytes | None,
    indices: tuple[int, ...], layout: ChunkLayout, bars: Bars,
) -> dict[str, Any]:
    """What the aggregator concludes from the opened chunks: the verdict on Δ̂ and the bound checks."""
    spec = spec_of(replay)
    decoded = codec.decode(sent.payload, spec)
    e_prev, e_now = gather_chunks(sent.e_prev, layout, indices), gather_chunks(sent.e_now, layout, indices)
    cos, ratio = compare(claimed_delta(gather_chunks(decoded, layout, indices), e_prev, e_now, decay),
                         gather_chunks(replay, layout, indices))
    prev_ok = prev_payload is None or payload_misfit(codec, prev_payload, spec, layout, indices, e_prev) is None
    now_ok = payload_misfit(codec, sent.payload, spec, layout, indices, e_now) is None
    passed = verdict(0, 0, cos, ratio, bars.min_cosine, bars.norm_tolerance)[0]
    return {"cosine": cos, "norm_ratio": ratio, "verdict_passes": passed, "prev_fits": prev_ok,
            "now_fits": now_ok, "accepted": passed and prev_ok and now_ok}


def dense_old(codec: TopKCodec, payload: bytes, replay: Tensors, bars: Bars) -> dict[str, Any]:
    """Today's comparison: the decoded payload against the replay over all tensors."""
    decoded = codec.decode(payload, spec_of(replay))
    names = sorted(replay)
    cos, ratio = compare(torch.cat([decoded[n].reshape(-1) for n in names]),
                         torch.cat([replay[n].reshape(-1) for n in names]))
    return {"cosine": cos, "norm_ratio": ratio,
            "verdict_passes": verdict(0, 0, cos, ratio, bars.min_cosine, bars.norm_tolerance)[0]}


def _sample_seed(round_: int, slot: int) -> bytes:
    return hashlib.sha256(f"bench-sparse-replay:{round_}:{slot}".encode()).digest()


def judge_round(
    args: argparse.Namespace, codec: TopKCodec, decay: float, round_: int, honest: list[Sent],
    replays: list[Tensors], prev_payloads: list[bytes | None], public_guess: Tensors,
) -> list[dict[str, Any]]:
    """Every host of one round: the honest case and its cheats, at each sample fraction."""
    layout = ChunkLayout.of(spec_of(replays[0]), args.commit_chunk)
    bars = Bars(args.min_cosine, args.norm_tolerance)
    rows = []
    for slot, own in enumerate(honest):
        cases = {"honest": own, **cheats(codec, decay, slot, honest, replays, public_guess)}
        for case, sent in cases.items():
            row: dict[str, Any] = {"round": round_, "slot": slot, "case": case,
                                   "old_dense": dense_old(codec, sent.payload, replays[slot], bars)}
            for fraction in args.fractions:
                indices = sample_chunks(_sample_seed(round_, slot), layout.n_chunks, fraction, args.minimum)
                row[f"f={fraction:g}"] = challenge(codec, decay, sent, replays[slot], prev_payloads[slot],
                                                   indices, layout, bars) | {"chunks": len(indices)}
            rows.append(row)
    return rows


def run_epoch(args: argparse.Namespace, windows: Windows, codec_name: str, decay: float) -> list[dict[str, Any]]:
    """One top-k epoch of `args.hosts` hosts and `args.rounds` rounds, every host judged every round."""
    model = ModelConfig.preset("tiny")
    recipe = local_recipe(model, n_rounds=args.rounds, inner_steps=args.inner_steps, micro_batch=args.micro_batch,
                          seq_len=args.seq_len, codec=codec_name, ef_decay=decay, round_state="fresh")
    run = LocalDiLoCo(LocalRunConfig(recipe=recipe, workers=args.hosts, eval_windows=4), windows)
    codec = get_codec(codec_name)
    if not isinstance(codec, TopKCodec):
        raise SystemExit(f"--codecs: {codec_name} is not a top-k codec")
    for host in run.hosts:
        host.feedback = RecordingFeedback(codec, decay)
    rows: list[dict[str, Any]] = []
    prev_payloads: list[bytes | None] = [None] * args.hosts
    public_guess: Tensors = {n: torch.zeros_like(p) for n, p in run.params.items()}
    for round_ in range(args.rounds):
        base = {n: p.detach().clone() for n, p in run.params.items()}
        run.run_round()
        honest = [_sent(host.feedback) for host in run.hosts]
        replays = [_replay(recipe.inner_config(), windows, model, args, slot, round_, base) for slot in range(args.hosts)]
        rows += judge_round(args, codec, decay, round_, honest, replays, prev_payloads, public_guess)
        prev_payloads = [s.payload for s in honest]
        public_guess = {n: base[n] - p.detach() for n, p in run.params.items()}  # the round's whole outer step
        print(f"{codec_name} decay {decay}: round {round_} judged", file=sys.stderr)
    return rows


def _sent(feedback: ErrorFeedback) -> Sent:
    assert isinstance(feedback, RecordingFeedback)
    e_now = dict(feedback.residual)
    e_prev = {n: feedback.previous.get(n, torch.zeros_like(t)) for n, t in e_now.items()}
    return Sent(feedback.last_payload, e_prev, e_now)


def _replay(inner: Any, windows: Windows, model: ModelConfig, args: argparse.Namespace, slot: int, round_: int,
            base: Tensors) -> Tensors:
    assignment = Assignment(args.seed, slot, args.hosts)
    return replay_round(build_model(model, seed=args.seed), inner, windows, assignment, round_, base, first_round=0)


def summarize(rows: list[dict[str, Any]], fractions: list[float]) -> dict[str, Any]:
    """Per case: how often each comparison accepts, and the range of its cosine and norm ratio."""
    out: dict[str, Any] = {}
    for case in ("honest", *CHEATS):
        mine = [r for r in rows if r["case"] == case]
        entry = {"old_dense": _span([r["old_dense"] for r in mine], "verdict_passes")}
        for fraction in fractions:
            key = f"f={fraction:g}"
            entry[key] = _span([r[key] for r in mine], "accepted") | {
                "verdict_passes": sum(r[key]["verdict_passes"] for r in mine),
                "payloads_fit": sum(r[key]["prev_fits"] and r[key]["now_fits"] for r in mine),
            }
        out[case] = entry
    return out


def _span(results: list[dict[str, Any]], accept_key: str) -> dict[str, Any]:
    cos = [r["cosine"] for r in results]
    ratio = [r["norm_ratio"] for r in results]
    return {"n": len(results), "accepted": sum(bool(r[accept_key]) for r in results),
            "cosine": [min(cos), max(cos)], "norm_ratio": [min(ratio), max(ratio)]}


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="write the JSON results here")
    parser.add_argument("--codecs", nargs="+", default=["topk:chunk=4096,k=128,bits=2", "topk:chunk=4096,k=32,bits=2"])
    parser.add_argument("--decays", nargs="+", type=float, default=[1.0, 0.9])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.01, 0.05, 1.0])
    parser.add_argument("--minimum", type=int, default=4, help="chunks a challenge opens at least")
    parser.add_argument("--commit-chunk", type=int, default=4096, help="elements per committed chunk")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=200_000)
    parser.add_argument("--min-cosine", type=float, default=0.9)
    parser.add_argument("--norm-tolerance", type=float, default=0.1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    windows = TokenCorpus.from_files(builtin_corpus_files(max_bytes=args.corpus_bytes)).windows(
        seq_len=args.seq_len, heldout_fraction=0.05)
    results: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "epochs": []}
    for codec_name in args.codecs:
        for decay in args.decays:
            rows = run_epoch(args, windows, codec_name, decay)
            summary = summarize(rows, args.fractions)
            results["epochs"].append({"codec": codec_name, "decay": decay, "summary": summary, "rows": rows})
            out(_table(codec_name, decay, summary, args.fractions))
    args.out.write_text(json.dumps(results, indent=1))
    return results


def _table(codec_name: str, decay: float, summary: dict[str, Any], fractions: list[float]) -> str:
    lines = [f"{codec_name}, decay {decay}: accepted / judged, cosine range (old dense | sampled Δ̂ per fraction)"]
    for case, entry in summary.items():
        cells = [_cell(entry["old_dense"])] + [_cell(entry[f"f={f:g}"]) for f in fractions]
        lines.append(f"  {case:7s} " + " | ".join(cells))
    return "\n".join(lines)


def _cell(span: dict[str, Any]) -> str:
    lo, hi = span["cosine"]
    rlo, rhi = span["norm_ratio"]
    return f"{span['accepted']}/{span['n']} cos {lo:+.3f}..{hi:+.3f} ratio {rlo:.2f}..{rhi:.2f}"


if __name__ == "__main__":
    main()
