#!/usr/bin/env bash
# One prepared run for a machine with NVIDIA GPUs: under 8 minutes, one JSON (docs/benchmarks.md, "Rigs").
#
#   1. inner: the inner loop at 1B against a bare PyTorch loop on one GPU, bf16 and compile on
#      (scripts/bench_inner.py: tokens/s, MFU);
#   2. fsdp: FSDP2 training steps of the 1B preset sharded over every GPU, bf16 compute, fp32 master
#      weights and reductions, compiled layers (scripts/gpu_check.py fsdp: tokens/s, MFU, peak memory
#      per GPU against training.plan);
#   3. rig (two or more GPUs): 2 rounds of a host's rig (RigRounds: torchrun, mailbox, FSDP2 on every
#      GPU, compiled) against a one-GPU rig: payloads and their bf16 difference, per-round waits.
#
# A step that fails or times out is recorded as such and the next one runs.
#
#   scripts/gpu_check.sh [--out FILE] [--dry-run]
#
# --dry-run: the same steps on the CPU (GPUs hidden, gloo, 2 processes, tiny presets), to check the
# script where no GPU is at hand.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=gpu_check.json
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    *) echo "usage: scripts/gpu_check.sh [--out FILE] [--dry-run]" >&2; exit 2 ;;
  esac
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STARTED=$(date +%s)

if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  GPUS=2
  INNER=(--preset tiny --device cpu --steps 2 --repeats 1 --warmup 1 --seq-len 32 --micro-batch 2 --peak-tflops 1)
  FSDP=(--preset tiny --micro-batch 2 --seq-len 32 --steps 2 --warmup 1)
  RIG=(--preset tiny --inner-steps 3 --micro-batch 2 --seq-len 32)
  nvidia-smi -L > "$WORK/gpus.txt" 2>/dev/null || echo "dry run: no GPUs used" > "$WORK/gpus.txt"
else
  if ! nvidia-smi -L > "$WORK/gpus.txt"; then echo "no NVIDIA GPU (nvidia-smi failed); try --dry-run" >&2; exit 1; fi
  GPUS=$(grep -c '^GPU ' "$WORK/gpus.txt")
  INNER=(--preset 1b --device cuda --micro-batch 8 --seq-len 2048 --compile --steps 5 --repeats 2 --warmup 3)
  FSDP=(--preset 1b --micro-batch 4 --steps 8 --warmup 3 --compile)
  RIG=(--preset 12m --compile)
fi

step() {  # step NAME TIMEOUT_S COMMAND...: run it, record "ok" / "failed (exit N)" / "timed out"
  local name=$1 limit=$2; shift 2
  echo "== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) echo ok > "$WORK/$name.status" ;;
    124|137) echo "timed out after ${limit} s" > "$WORK/$name.status" ;;
    *) echo "failed (exit $rc)" > "$WORK/$name.status" ;;
  esac
  echo "   $(cat "$WORK/$name.status")"
  tail -n 3 "$WORK/$name.log"
}

step inner 180 "$PY" scripts/bench_inner.py "${INNER[@]}" --out "$WORK/inner.json"
step fsdp 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$GPUS" scripts/gpu_check.py fsdp \
  "${FSDP[@]}" --out "$WORK/fsdp.json"
if [ "$GPUS" -ge 2 ]; then
  step rig 140 "$PY" scripts/gpu_check.py rig --procs "$GPUS" "${RIG[@]}" --out "$WORK/rig.json"
else
  echo "skipped: one GPU" > "$WORK/rig.status"
fi

"$PY" - "$WORK" "$OUT" "$DRY" "$(( $(date +%s) - STARTED ))" <<'PYEOF'
import json, sys
from pathlib import Path

import torch

work, out, dry, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
report = {"dry_run": dry, "seconds": seconds, "torch": torch.__version__,
          "gpus": (work / "gpus.txt").read_text().strip().splitlines()}
for name in ("inner", "fsdp", "rig"):
    status = (work / f"{name}.status").read_text().strip()
    result = json.loads((work / f"{name}.json").read_text()) if (work / f"{name}.json").exists() else None
    log = (work / f"{name}.log").read_text(errors="replace")[-2000:] if (work / f"{name}.log").exists() else ""
    report[name] = {"status": status, "result": result, **({"log_tail": log} if status != "ok" else {})}
out.write_text(json.dumps(report, indent=1) + "\n")
print(f"wrote {out} ({seconds} s): " + ", ".join(f"{n} {report[n]['status']}" for n in ("inner", "fsdp", "rig")))
PYEOF
