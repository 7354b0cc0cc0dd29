#!/usr/bin/env bash
# The planner against measured peaks on one GPU: a matrix of settings (recompute, optimizer offload,
# many short RL rollouts per row) on the 4-layer Qwen3.5-35B-A3B at full width, one sequence of SEQ
# tokens per step, run by benchmarks/loss_e2e_bench.sh (one kernel cache). For each run: the
# planner's torch-reserved estimate the run recorded (metrics.jsonl `plan_torch_reserved_bytes`,
# planned for this machine's GPU), the measured peak (torch max reserved), the error, tok/s, and for
# recompute=auto the choice it made (layout.json).
#   OUT=/some/dir SEQ=32768 STEPS=10 bash benchmarks/planner_accuracy.sh [RUN ...]
# RUN is NAME=OVERRIDES as for loss_e2e_bench.sh; the default matrix is below.
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  RUNS=("full=recompute=full" "selective=recompute=selective" "none=recompute=none" "auto=recompute=auto"
        "offload=state.offload=optimizer" "offload_dev=state.offload=optimizer,state.offload_update=device"
        "grpo_short=loss=grpo,data.format=rollouts")
fi
OUT="$OUT" PY="$PY" bash "$(dirname "$0")/loss_e2e_bench.sh" "${RUNS[@]}" > "$OUT/loss_e2e_table.txt"
cat "$OUT/loss_e2e_table.txt"
"$PY" - "$OUT" "${RUNS[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), [r.split("=", 1)[0] for r in sys.argv[2:]]
G = 2**30
print(f"\n{'run':14s} {'planned GiB':>11s} {'peak GiB':>9s} {'error':>7s} {'alloc GiB':>9s} {'retries':>7s} {'tok/s':>8s}  choice")
for name in runs:
    d = out / f"e2e_{name}"
    f = d / "metrics.jsonl"
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
    steps = [r for r in recs if "tokens_per_s" in r]
    if not steps:
        print(f"{name:14s} no metrics (see {out}/e2e_{name}.log)")
        continue
    planned = next((r["plan_torch_reserved_bytes"] for r in reversed(recs) if "plan_torch_reserved_bytes" in r), 0)
    peak = max(r.get("peak_mem_bytes", 0) for r in recs)
    tps = statistics.median(r["tokens_per_s"] for r in steps[len(steps) // 3:])
    lay = d / "layout.json"
    derived = json.loads(lay.read_text()).get("derived", {}) if lay.is_file() else {}
    blocks = (derived.get("recompute") or {}).get("blocks") or {}
    choice = "; ".join(f"{m}: " + ", ".join(f"{n} {k}" for k, n in v.items() if n) for m, v in blocks.items())
    err = (planned - peak) / peak if peak else float("nan")
    alloc = max(r.get("peak_alloc_bytes", 0) for r in recs)  # live tensors' peak (CUDA); reserved - alloc: fragmentation
    retries = recs[-1].get("alloc_retries", "-")
    print(f"{name:14s} {planned / G:11.1f} {peak / G:9.1f} {err:+7.1%} {alloc / G:9.1f} {retries!s:>7s} {tps:8.0f}  {choice}")
PY
