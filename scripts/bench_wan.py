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
  upload thread downloads r's update as soon as r closes and steps the model with it (`--apply-s`);
  before training r + 2 the daemon adopts that model. With a sparse broadcast (top-k, `broadcast =
  "codec"`) the host takes the dense part of the step ahead of the update (`training.diloco.
  SpeculativeStep`, `--ahead-s`), from when it holds the base (the start of round r + 1), so only the
  step's nonzero entries and the hash are left for when the update arrives.
- `overlap = "eager"`: as "delayed", and before training r the daemon forecasts r's base from the model
  after r − 2 and its own payload of r − 1 (`--forecast-s`, on the training path): with a sparse
  broadcast written over round r − 1's step taken ahead, which the upload thread of r − 2 takes right
  after computing the model after r − 2 (the daemon joins that thread first); else a whole step.

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
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gonka_node.core.link import LinkSpec, TokenBucket
from training.codecs import Codec, get_codec
from training.model import Llama, ModelConfig

LINKS = ("1000/1000", "100/10", "20/5")
OVERLAPS = ("off", "delayed", "eager")  # training/overlap.py
# each overlap mode, and eager with the recipe's merge_step, then its forecast_step, at H/4 (the step
# their loss was measured at, docs/benchmarks.md): (mode, merge step for H, forecast step for H)
MODES: tuple[tuple[str, Callable[[int], int], Callable[[int], int]], ...] = (
    *((o, lambda h: 0, lambda h: 0) for o in OVERLAPS), ("eager", lambda h: h // 4, lambda h: 0),
    ("eager", lambda h: 0, lambda h: h // 4))
CODECS = {"int8": "int8", "top-k": "topk:chunk=4096,k=128,bits=2"}  # top-k: the benchmarked 1,798× codec
CHUNK = 1 << 20  # the gRPC client's chunk (the round's max_chunk_bytes)


@dataclass(frozen=True)
class Timing:
    steps: int  # H
    step_s: float  # seconds per inner step (H200, 1.2B, 16k tokens)
    close_s: float  # the aggregator's close after the last upload: decode, check, aggregate, step, finalize
    apply_s: float  # the host's outer step and sha256 of the new model once the update is there (overlap on:
    # in the upload thread)
    save_s: float  # the host's snapshot of each adopted model: written behind by the host's writer
    rounds: int
    latency_ms: float
    # overlap on, a sparse broadcast: the part of the step taken before its update (`SpeculativeStep.run`),
    # from when the daemon releases the base to the round's upload thread; eager: round k's right after
    # the model after k − 1, by the thread that computed that model (round 1's from the release)
    ahead_s: float = 0.0
    forecast_s: float = 0.0  # eager: the forecast of a round's base, on the training path (from round 3)
    first_forecast_s: float | None = None  # eager: round 2's (no step taken ahead yet); None: forecast_s
    # the worker's end of each round, after its last inner step and before both its upload and the next
    # round: pseudo-gradient, norm, compress, residual root (`measure_seal`)
    seal_s: float = 0.0
    # the round's residual root and durable save before its upload: on the training path without overlap
    # (`_keep`), written behind with it (`_keep_behind`: the writer's queue, before the snapshot asked
    # for after it)
    keep_s: float = 0.0
    # eager with the recipe's merge_step: after this many of its steps round r moves onto the model after
    # r − 1, which it waits for there (the upload thread's, as the daemon adopts it: HostNode._merge); 0: none
    merge_step: int = 0
    # eager with the recipe's forecast_step (a `fresh` epoch: a `carry` one seals on the path): round r
    # starts from the +0 step (taken ahead by the upload thread with a sparse broadcast, else here,
    # `zero_s`, on the path; round 2's always here) once round r − 1's pseudo-gradient is formed
    # (`pseudo_s`, on the path); its seal runs beside round r's first steps, and from the first step on
    # (host/sealing.py `Beside`) the forecast once the seal is done (`forecast_s`, then `shift_s`: the
    # shift formed, with a sparse broadcast); after this many steps the round makes the move (`move_s`,
    # on the path: the shift added, or the difference taken and added); 0: none
    forecast_step: int = 0
    pseudo_s: float = 0.0
    zero_s: float = 0.0
    shift_s: float = 0.0
    move_s: float = 0.0
    # eager with the step taken ahead: an upload thread handed round r's step (the daemon's, written
    # over by the forecast) takes the next step's +0 part on its +0 model while the upload is in flight
    # (`ahead_s` from the release, `SpeculativeStep.take_after`), and once the update is there fixes it at
    # the entries the update and the forecast changed (`fix_s`, after the finish): the next round's start
    fix_s: float = 0.0

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
    sealed: list[float] = [0.0]  # when round r's payload is compressed
    writer = 0.0  # when the host's writer (one thread, saves in the order asked for) is free
    closed: list[float] = [0.0]  # when round r closed at the aggregator
    fetched: list[float] = [0.0]  # when the host holds round r's update
    ready: dict[int, float] = {0: 0.0}  # overlap on: when the upload thread has computed the model after r
    ahead: dict[int, float] = {}  # overlap on: when round k's step is taken ahead of its update
    handed: dict[int, bool] = {}  # eager: round k's upload thread was handed round k's step (`fix_s`)
    first_forecast = t.forecast_s if t.first_forecast_s is None else t.first_forecast_s
    for r in range(1, t.rounds + 1):
        if overlap == "off":  # download and apply on the training path, the snapshot written behind
            start = fetched[r - 1] + (t.apply_s if r > 1 else 0.0)
            if r > 1:
                writer = max(writer, start) + t.save_s
        else:
            # Adopt the model after r − 2 computed ahead, then save it (nothing to adopt for rounds 1, 2);
            # eager: forecast from it (previewing round r − 1's step taken ahead, from round 3 on).
            eager = overlap == "eager"
            late = eager and t.forecast_step > 0 and r >= 2
            held = ready[r - 2] if r >= 3 else 0.0
            if eager and r >= 3 and t.ahead_s:  # round r − 1's step: fixed after round r − 2's update from
                # the one taken ahead of it (`fix_s`), or taken then by that upload thread (`ahead_s`)
                ahead[r - 1] = ready[r - 2] + (t.fix_s if handed[r - 2] else t.ahead_s)
                held = ahead[r - 1]
            forecast = 0.0 if not eager or r == 1 else first_forecast if r == 2 else t.forecast_s
            # a late forecast's round waits for the pseudo-gradient only, the seal runs beside it
            adopted = max(ends[r - 1] + t.pseudo_s if late else sealed[r - 1], held)
            if r >= 3:  # the snapshot of the model adopted, asked of the writer then
                writer = max(writer, adopted) + t.save_s
            if late and r == 2 and t.ahead_s:  # the +0 step of the initial model, taken beside round 1
                ahead[1] = t.ahead_s
            if late:  # from the +0 step (here when none was taken ahead); the forecast beside the first steps,
                # written over that step with a sparse broadcast
                start = max(adopted, ahead[1]) if r == 2 and t.ahead_s else \
                    adopted + (0.0 if t.ahead_s else t.zero_s)
                forecast_done = max(start + t.step_s, sealed[r - 1]) + t.forecast_s + t.shift_s
                released = max(start + t.forecast_step * t.step_s, forecast_done) + t.move_s
            else:
                released = start = adopted + forecast
            if r >= 2:  # round r − 1's upload thread: handed round r − 1's step with the base's release (eager,
                # from round 3, or round 2 of a late forecast), it takes the next one's +0 part beside the
                # upload; else it takes round r − 1's step itself then; it finishes with the update
                handed[r - 1] = bool(eager and t.ahead_s and (r >= 3 or late))
                if not handed[r - 1] and (r == 2 or not eager or not t.ahead_s):
                    ahead[r - 1] = released + t.ahead_s
                taken = released + t.ahead_s if handed[r - 1] else released
                ready[r - 1] = max(fetched[r - 1], ahead[r - 1], taken) + t.apply_s
        if overlap == "eager" and (t.merge_step or t.forecast_step) and r >= 2:
            moved = released if t.forecast_step else start  # the forecast's move (`forecast_step`) first
            done = t.forecast_step
            if t.merge_step:  # the merge waits for the model after r − 1
                moved, done = max(moved + (t.merge_step - done) * t.step_s, ready[r - 1]), t.merge_step
            ends.append(moved + (t.steps - done) * t.step_s)
        else:
            ends.append(start + t.compute_s)
        sealed.append(ends[r] + t.seal_s + (t.keep_s if overlap == "off" else 0.0))
        kept = sealed[r]
        if overlap != "off":  # the next round starts now; the upload waits for the round's save
            writer = kept = max(writer, sealed[r]) + t.keep_s
        opens = closed[r - 1] if overlap != "off" else 0.0
        uploaded = send(buckets.up, up_bytes, max(kept, opens))
        closed.append(uploaded + t.close_s)
        fetched.append(send(buckets.down, down_bytes, closed[r]))
    wall = ends[-1]
    per_round = [round(t.compute_s / (ends[r] - ends[r - 1]), 4) for r in range(1, t.rounds + 1)]
    return {"utilisation": round(t.rounds * t.compute_s / wall, 4), "utilisation_per_round": per_round,
            "round_wall_s": round(ends[-1] - ends[-2], 2)}


Measures = dict[str, tuple[Callable[[Any], Any], Callable[[], Any] | None]]  # key: (f(prepare()), prepare)


def shape_classes(spec: Mapping[str, tuple[int, ...]]) -> list[tuple[int, int]]:
    """(elements, how many tensors) for each tensor size of `spec`, largest first (Llama-3.2-1B: the
    262M-element embedding once, 48 MLP projections of 16.8M, ...)."""
    counts = Counter(math.prod(shape) for shape in spec.values())
    return sorted(counts.items(), reverse=True)


def measure_classes(classes: Sequence[tuple[int, int]], build: Callable[[int], Measures], repeat: int,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each measure `build(numel)` gives, timed on one tensor of each class's real size and counted as
    many times as the class has tensors, summed over the classes: the median over `repeat` rounds, round
    robin (a shared machine's slow spells fall on every figure alike). Real sizes, not one small tensor
    scaled: a tensor of 16M elements and one of 262M each cost more per element than one of 4M (fresh
    pages to fault in, caches), ~2x for the top-k compress here. A measure's `prepare()` is not timed,
    and its result is freed before the next (as a host's tensors are)."""
    built = [(count, build(numel)) for numel, count in classes]
    keys = list(built[0][1]) if built else []
    totals: dict[str, list[float]] = {key: [] for key in keys}
    for _ in range(repeat):
        for key in keys:
            total = 0.0
            for count, measures in built:
                f, prepare = measures[key]
                arg = prepare() if prepare is not None else None
                started = clock()
                f(arg)
                total += (clock() - started) * count
                del arg
            totals[key].append(total)
    return {key: sorted(t)[len(t) // 2] for key, t in totals.items()}


def apply_measures(numel: int) -> Measures:
    """The host's work on the global model for one tensor of `numel` elements (see `measure_apply`)."""
    from training.checkpoint import canonical_sha256
    from training.diloco import OuterOptimizer, SpeculativeStep

    gen = torch.Generator().manual_seed(0)
    p, g = {"w": torch.randn(numel, generator=gen)}, {"w": torch.randn(numel, generator=gen) * 1e-3}
    own = {"w": torch.randn(numel, generator=gen) * 1e-3}
    spec = {"w": (numel,)}
    payloads = {label: get_codec(name).encode(g) for label, name in CODECS.items()}
    topk = get_codec(CODECS["top-k"])
    own_payload = topk.encode(own)
    own_kept = {"w": topk.encode_kept("w", own["w"])[1]}  # what a one-process eager host forecasts with
    outer = OuterOptimizer(0.7, 0.9)
    outer.step(p, g)  # the first step only copies the momentum: time later ones

    def speculated() -> SpeculativeStep:
        step = SpeculativeStep(outer, p)
        step.run()
        return step

    def forecasted() -> SpeculativeStep:
        step = speculated()
        step.forecast(topk.decode_sparse(own_payload, spec))
        return step

    def finished_after() -> SpeculativeStep:
        step = forecasted()
        step.take_after()
        step.finish(topk.decode_sparse(payloads["top-k"], spec))
        return step

    measures: Measures = {
        "step_s": (lambda _: outer.copy().step({"w": p["w"].clone()}, g), None),  # on a copy, as the upload thread
        "ahead_s": (lambda _: speculated(), None),
        "finish_s": (lambda step: step.finish(topk.decode_sparse(payloads["top-k"], spec)), speculated),
        # the host's payload's entries as its encoder kept them (a one-process host: `Forecasts._own_entries`)
        "forecast_s": (lambda step: step.forecast(own_kept), speculated),
        "forecast_decoded_s": (lambda step: step.forecast(topk.decode_sparse(own_payload, spec)), speculated),
        "finish_after_forecast_s": (lambda step: step.finish(topk.decode_sparse(payloads["top-k"], spec)),
                                    forecasted),
        "sha256_s": (lambda _: canonical_sha256(p), None),
        # a late forecast's move on the training path (`training.worker.shift_by` / `shift_onto`): the shift
        # added (taken beside the first steps, over the step ahead), or the difference taken and added
        "move_add_s": (lambda x: x.add_(own["w"]), lambda: p["w"].clone()),
        "forecast_shift_s": (lambda step: step.forecast_shift(), lambda: forecasted()),
        # the next step taken ahead of the update on the forecast's +0 model, fixed once it is finished
        "fix_s": (lambda step: step.after_finish(), lambda: finished_after()),
        "move_onto_s": (lambda x: x.add_(own["w"] - g["w"]), lambda: p["w"].clone()),
    } | {f"decode_{label}": (lambda _, name=name, data=data: get_codec(name).decode(data, spec), None)
         for (label, name), data in zip(CODECS.items(), payloads.values(), strict=True)}
    return measures


def measure_apply(spec: Mapping[str, tuple[int, ...]], repeat: int = 5) -> dict[str, Any]:
    """The host's work on the global model on this machine's CPU with torch's threads, on tensors of the
    model's real sizes (`measure_classes`): the bit-exact outer step (`fma32`, training/diloco.py) on a
    copy, each codec's dense decode of an update, sha256 of the model, and the step taken ahead of a
    top-k update (`SpeculativeStep`): its dense part, its finish from the update's bytes
    (`Codec.decode_sparse`), an eager forecast from the host's own payload's entries as its encoder kept
    them (`Codec.encode_kept`; `forecast_decoded_s`: from the payload's bytes, as a rig host or a
    restarted one forecasts), and the finish after such a forecast (which copies the model the forecast
    wrote over)."""
    classes = shape_classes(spec)
    median = {key: round(t, 1) for key, t in measure_classes(classes, apply_measures, repeat).items()}
    numel = classes[0][0]
    update = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3}
    nonzero = int((get_codec(CODECS["top-k"]).decode(get_codec(CODECS["top-k"]).encode(update),
                                                    {"w": (numel,)})["w"] != 0).sum())
    return {"threads": torch.get_num_threads(), "sizes": classes, "repeat": repeat,
            "load_average_1min": round(os.getloadavg()[0], 2),
            **{k: v for k, v in median.items() if not k.startswith("decode_")},
            "decode_s": {label: median[f"decode_{label}"] for label in CODECS},
            "top_k_density": round(nonzero / numel, 4),
            "where": "this machine's CPU (shared), on tensors of the model's sizes"}


def seal_measures(numel: int) -> Measures:
    """The worker's end of a round for one tensor of `numel` elements (see `measure_seal`): each codec's
    compress is a second round's (the residual is added), of a fresh pseudo-gradient it consumes, its
    squares (Δ's norm) taken on the way, as `DiLoCoWorker.train_round` does."""
    from training.codecs import ErrorFeedback
    from training.diloco import pseudo_gradient
    from training.worker import commitment_root

    gen = torch.Generator().manual_seed(1)
    glob = {"w": torch.randn(numel, generator=gen)}
    local = {"w": glob["w"] + torch.randn(numel, generator=gen) * 1e-3}
    spec = {"w": (numel,)}
    feedback = {label: ErrorFeedback(get_codec(name)) for label, name in CODECS.items()}
    for ef in feedback.values():
        ef.compress(pseudo_gradient(glob, local), consume=True)  # the residual every later round adds
    measures: Measures = {"pseudo_gradient_s": (lambda _: pseudo_gradient(glob, local), None)}

    def compress(ef: ErrorFeedback) -> Callable[[Any], Any]:
        return lambda d: ef.compress(d, consume=True, squares={})

    def root(ef: ErrorFeedback) -> Callable[[Any], Any]:
        return lambda _: commitment_root(ef.residual, spec, ef.codec)

    for label, ef in feedback.items():
        measures[f"compress_{label}"] = (compress(ef), lambda: pseudo_gradient(glob, local))
        measures[f"root_{label}"] = (root(ef), None)
    return measures


def measure_seal(spec: Mapping[str, tuple[int, ...]], save_numel: int = 1 << 25, repeat: int = 5) -> dict[str, Any]:
    """The worker's end of a round on this machine's CPU, per codec, on tensors of the model's real sizes
    (`measure_classes`): what a host does between its last inner step and both the round's upload and
    its next round's first step (training/worker.py `train_round`, gonka_node/host/node.py `_keep`): the
    pseudo-gradient, the compress with error feedback (Δ's norm taken within it), the root over the
    residual the host signs; and, on `save_numel` elements scaled linearly to the model (the disk sets their rate), the
    durable save of the round before its upload (`HostStore.save_sent`: the payload and the worker state,
    both residuals, fsynced) and the snapshot the host saves each time it adopts a new global model
    (`HostStore.save`: the model, its outer momentum, the worker state linked; fsynced)."""
    import tempfile

    from gonka_node.host.store import HostStore, Progress

    classes = shape_classes(spec)
    params = sum(numel * count for numel, count in classes)
    median = {key: round(t, 2) for key, t in measure_classes(classes, seal_measures, repeat).items()}
    gen = torch.Generator().manual_seed(1)
    big = {"w": torch.randn(save_numel, generator=gen) * 1e-3}
    save_state = {"feedback": {"residual": big, "previous": {"w": big["w"].clone()}}}
    model, momentum = {"w": torch.randn(save_numel, generator=gen)}, {"w": torch.randn(save_numel, generator=gen)}
    saves: dict[str, list[float]] = {"save_s": [], "snapshot_s": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_WAN_DISK")) as tmp:
        store = HostStore(Path(tmp), epoch=1)
        for i in range(repeat):
            started = time.perf_counter()
            store.save_sent(i + 1, b"p" * 1024, bytes(32), save_state)
            saves["save_s"].append((time.perf_counter() - started) * params / save_numel)
            started = time.perf_counter()  # the worker state linked from the round's save, as the host does
            store.save(Progress(1, 0, i + 1, "00" * 32), model, momentum, save_state, store.sent_state_path(i + 1))
            saves["snapshot_s"].append((time.perf_counter() - started) * params / save_numel)
    median |= {key: round(sorted(t)[len(t) // 2], 2) for key, t in saves.items()}
    common = median["pseudo_gradient_s"]
    return {"sizes": classes, "save_numel": save_numel, "repeat": repeat, "threads": torch.get_num_threads(),
            "load_average_1min": round(os.getloadavg()[0], 2),
            "pseudo_gradient_s": median["pseudo_gradient_s"], "save_s": median["save_s"],
            "snapshot_s": median["snapshot_s"],
            # fp32 bytes a parameter the host's writer writes each round, behind the training: the round's
            # save (both residuals) and the snapshot (model and momentum; its worker state is a link)
            "written_bytes_per_round": 16 * params,
            "compress_s": {label: median[f"compress_{label}"] for label in CODECS},
            "root_s": {label: median[f"root_{label}"] for label in CODECS},
            # on the training path: what the payload needs; the root is hashed where the round is saved
            "seal_s": {label: round(common + median[f"compress_{label}"], 1) for label in CODECS},
            "where": "this machine's CPU (shared), on tensors of the model's sizes; the saves on its disk, scaled"}


def speculates(overlap: str, broadcast: str, codec_name: str) -> bool:
    """Whether the host takes the step ahead of the update (gonka_node/host/node.py `_speculates`)."""
    return overlap != "off" and broadcast == "codec" and get_codec(codec_name).sparse


def host_timing(
    t: Timing, measured: Mapping[str, Any] | None, overlap: str, speculated: bool, codec: str = "top-k",
    broadcast: str = "codec",
) -> Timing:
    """`t` with the host's work measured (`measured`, else `t`'s own figures) placed as the host does it
    for `codec` (a CODECS label) and `broadcast`: with a sparse broadcast, the step's dense part ahead of
    the update and an eager forecast written over it from the payload's bytes; else the update decoded
    (a codec's broadcast), the whole step after it and an eager forecast stepping a copy of the model."""
    eager = overlap == "eager"
    if measured is None:  # a late forecast's +0 step, where taken on the path, costs about a step
        t = dataclasses.replace(t, zero_s=t.zero_s or t.apply_s)
        t = t if speculated else dataclasses.replace(t, ahead_s=0.0)
        return t if eager else dataclasses.replace(t, forecast_s=0.0, first_forecast_s=None)
    seal = measured.get("seal")
    if seal is not None:  # the round's end, its save and the snapshot, placed by `simulate`
        t = dataclasses.replace(t, seal_s=seal["seal_s"][codec], keep_s=seal["root_s"][codec] + seal["save_s"],
                                save_s=seal["snapshot_s"], pseudo_s=seal["pseudo_gradient_s"])
    # a late forecast's +0 step where none was taken ahead, and its move (added over the step ahead)
    t = dataclasses.replace(t, zero_s=measured["ahead_s"], shift_s=measured["forecast_shift_s"] if speculated else 0.0,
                            move_s=measured["move_add_s" if speculated else "move_onto_s"],
                            fix_s=measured["fix_s"] if speculated and eager else 0.0)
    step, sha, decode = measured["step_s"], measured["sha256_s"], measured["decode_s"][codec]
    if speculated:
        finish = measured["finish_after_forecast_s" if eager else "finish_s"]
        return dataclasses.replace(t, ahead_s=measured["ahead_s"], apply_s=finish + sha,
                                   forecast_s=measured["forecast_s"] if eager else 0.0,
                                   # round 2: nothing taken ahead yet, the own payload decoded and stepped
                                   first_forecast_s=step + decode if eager else None)
    return dataclasses.replace(t, ahead_s=0.0, apply_s=step + sha + (decode if broadcast == "codec" else 0.0),
                               forecast_s=step + decode if eager else 0.0, first_forecast_s=None)


def scaled_host(measured: Mapping[str, Any], slower: float) -> dict[str, Any]:
    """`measured` with every time multiplied by `slower` (CPU and disk alike)."""
    disk = slower
    out = {k: v * slower for k, v in measured.items() if k.endswith("_s") and k != "decode_s"}
    out["decode_s"] = {k: v * slower for k, v in measured["decode_s"].items()}
    if "seal" in measured:
        seal = measured["seal"]
        out["seal"] = {"seal_s": {label: c * slower for label, c in seal["seal_s"].items()},
                       "pseudo_gradient_s": seal["pseudo_gradient_s"] * slower,
                       "root_s": {label: c * slower for label, c in seal["root_s"].items()},
                       "save_s": seal["save_s"] * disk, "snapshot_s": seal["snapshot_s"] * disk}
    return out


def sensitivity(up: int, down: int, t: Timing, measured: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The target configuration (100/10, top-k, overlap on, compressed download) with a slower or faster
    host: every time measured here multiplied by `slower`, for each overlap mode, the step taken ahead of
    the update as the host takes it, and not (the whole step after it, as with a dense download)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for key, overlap, speculated, forecast_step in (
        ("delayed_ahead", "delayed", True, 0), ("delayed_whole_step_after_update", "delayed", False, 0),
        ("eager_ahead", "eager", True, 0), ("eager_whole_step_after_update", "eager", False, 0),
        ("eager_forecast_step_ahead", "eager", True, t.steps // 4),  # the seal and forecast beside the steps
    ):
        rows[key] = []
        for slower in (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0):
            timing = dataclasses.replace(host_timing(t, scaled_host(measured, slower), overlap, speculated),
                                         forecast_step=forecast_step)
            rows[key].append({"slower": slower, "ahead_s": round(timing.ahead_s, 1),
                              "seal_s": round(timing.seal_s, 1), "keep_s": round(timing.keep_s, 1),
                              "snapshot_s": round(timing.save_s, 1),
                              "apply_s": round(timing.apply_s, 1), "forecast_s": round(timing.forecast_s, 1),
                              "utilisation": simulate("100/10", up, down, overlap, timing)["utilisation"]})
    return rows


def run(t: Timing, apply_measured: bool = False) -> dict[str, Any]:
    """`apply_measured`: the host's work (outer step, sha256, eager forecast) is this machine's, measured
    and scaled to the model, placed as the host places it; else `t`'s figures."""
    spec = llama_1b_spec()
    params = sum(int(torch.Size(s).numel()) for s in spec.values())
    measured = measure_apply(spec) | {"seal": measure_seal(spec)}
    dense = get_codec("fp32").encoded_size(spec)
    runs = []
    for codec_label, codec_name in CODECS.items():
        size = checked_size(get_codec(codec_name), spec)
        for link in LINKS:
            for overlap, merge_step, forecast_step in MODES:
                for broadcast, down in (("dense", dense), ("codec", size)):
                    speculated = speculates(overlap, broadcast, codec_name)
                    timing = host_timing(t, measured if apply_measured else None, overlap, speculated, codec_label,
                                         broadcast)
                    timing = dataclasses.replace(timing, merge_step=merge_step(t.steps),
                                                 forecast_step=forecast_step(t.steps))
                    result = simulate(link, size, down, overlap, timing)
                    runs.append({"params": params, "link": link, "codec": codec_label, "codec_spec": codec_name,
                                 "overlap": "on" if overlap != "off" else "off", "overlap_mode": overlap,
                                 "merge_step": timing.merge_step, "forecast_step": timing.forecast_step,
                                 "broadcast": broadcast, "upload_bytes": size, "download_bytes": down,
                                 "step_ahead": speculated, "ahead_s": round(timing.ahead_s, 1),
                                 "apply_s": round(timing.apply_s, 1), "forecast_s": round(timing.forecast_s, 1),
                                 **result})
    topk = checked_size(get_codec(CODECS["top-k"]), spec)
    return {
        "model": "Llama-3.2-1B shapes (preset 1b, vocab 128256, tied embeddings)",
        "params": params,
        "apply_measured": measured,
        "apply_s_source": ("measured (apply_measured), placed as the host places it (host_timing): with a "
                           "sparse broadcast ahead_s before the update, finish_s (eager: finish_after_forecast_s) "
                           "+ sha256_s after it, an eager forecast forecast_s on the training path (round 2: "
                           "step_s + decode_s); else decode_s (a codec's broadcast) + step_s + sha256_s after "
                           "the update, an eager forecast step_s + decode_s; every mode: the round's seal "
                           "(apply_measured.seal.seal_s for the codec) after its training, before its upload and "
                           "the next round; its save (seal.save_s) before its upload, on the training path "
                           "without overlap, else on the host's writer; the snapshot (seal.snapshot_s) on the "
                           "writer"
                           if apply_measured else "--apply-s, --ahead-s, --forecast-s"),
        "target": {"link": "100/10", "codec": "top-k", "overlap": "on (eager: the mode that meets the loss "
                   "target; delayed reported beside it)", "broadcast": "codec", "steps": t.steps,
                   "utilisation_goal": 0.98},
        "sensitivity_to_host_speed": sensitivity(topk, topk, t, measured),
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

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), sharey=True)
    for ax, codec in zip(axes, CODECS, strict=True):
        rows = [r for r in report["runs"] if r["codec"] == codec]
        h = report["timing"]["steps"]
        modes = [(o, merge(h), forecast(h)) for o, merge, forecast in MODES]
        labels = [(o, m, f, b) for o, m, f in modes for b in ("dense", "codec")]
        width = 0.8 / len(labels)
        for i, (o, m, f, b) in enumerate(labels):
            values = [next(r["utilisation"] for r in rows if r["link"] == link and r["overlap_mode"] == o
                           and r["merge_step"] == m and r["forecast_step"] == f and r["broadcast"] == b)
                      for link in LINKS]
            name = f"{o}, merge at step {m}" if m else f"{o}, forecast at step {f}" if f else o
            ax.bar([x + i * width for x in range(len(LINKS))], values, width, label=f"overlap {name}, download {b}")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(LINKS))], [f"{link} Mbit/s" for link in LINKS])
        ax.axhline(0.98, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{codec}: upload {rows[0]['upload_bytes'] / 1e6:,.0f} MB per round")
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(f"utilisation (H = {report['timing']['steps']})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
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
    p.add_argument("--ahead-s", type=float, default=0.0,
                   help="overlap on, top-k broadcast: the part of the step the host takes before the update (default 0)")
    p.add_argument("--forecast-s", type=float, default=0.0,
                   help="eager: the forecast of each round's base, on the training path (default 0)")
    p.add_argument("--apply-measured", action="store_true",
                   help="use this machine's measured outer step + sha256 (scaled to the model), split where the "
                        "host steps ahead, instead of --apply-s and --ahead-s")
    p.add_argument("--save-s", type=float, default=0.0,
                   help="the host's per-round snapshot write, on the training path (default 0: not modelled)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--latency-ms", type=float, default=20.0, help="before each transfer's first byte")
    args = p.parse_args()
    timing = Timing(args.steps, args.step_s, args.close_s, args.apply_s, args.save_s, args.rounds, args.latency_ms,
                    args.ahead_s, args.forecast_s)
    report = run(timing, args.apply_measured)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in report["runs"]:
        mode = r["overlap_mode"] + (f"+merge@{r['merge_step']}" if r["merge_step"] else "") + (
            f"+forecast@{r['forecast_step']}" if r["forecast_step"] else "")
        print(f"{r['link']:>9} {r['codec']:>5} overlap {mode:>17} download {r['broadcast']:>5}: "
              f"up {r['upload_bytes'] / 1e6:8,.1f} MB down {r['download_bytes'] / 1e6:8,.1f} MB "
              f"utilisation {r['utilisation']:.3f} (round {r['round_wall_s']:.0f} s)")
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
