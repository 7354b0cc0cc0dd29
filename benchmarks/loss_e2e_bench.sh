#!/usr/bin/env bash
# Paired end-to-end loss comparison on one GPU (issue 16): the 4-layer Qwen3.5-35B-A3B at full
# width, one sequence of SEQ tokens per step, the same seed, data and kernel cache; only the loss
# (and for RL the loss backend) changes between runs.
#   OUT=/some/dir SEQ=32768 STEPS=12 bash benchmarks/loss_e2e_bench.sh [RUN ...]
# RUN is NAME=OVERRIDES (overrides joined by ','), default:
#   linear_ce (auto: fwdgrad on CUDA)   linear_ce_recompute (backend=mixed, the paired baseline)
#   chunked (x8)   ce (materialised logits; may not fit: an OOM is reported as such)
#   grpo_fused (backend=fwdgrad on the packaged rollouts)   grpo_unfused (backend=mixed: token_logprobs + rl.grpo)
# Every run starts from recompute=RECOMPUTE (default full, as every recorded number; the recipe itself
# defaults to auto), which a run's own recompute=... replaces.
# Each run: `timeout` LIMIT seconds (default 240). The table: median tok/s and s/step over steps
# >= SKIP (default 4), peak memory (torch max reserved), the last logged loss.
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
SEQ=${SEQ:-32768}; STEPS=${STEPS:-12}; SKIP=${SKIP:-4}; LIMIT=${LIMIT:-240}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
KC=${KC:-$OUT/kc}   # one kernel cache for every run: only the first pays compile + autotune
export PYTHONUNBUFFERED=1
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  RUNS=("linear_ce=loss=linear_ce" "linear_ce_recompute=loss=linear_ce,loss.backend=mixed"
        "chunked=loss=chunked" "ce=loss=ce"
        "grpo_fused=loss=grpo,data.format=rollouts,loss.backend=fwdgrad"
        "grpo_unfused=loss=grpo,data.format=rollouts,loss.backend=mixed")
fi
BASE=(recipe="${RECIPE:-qwen35_35b_128k}" recompute="${RECOMPUTE:-full}" model.n_layers="${LAYERS:-4}" training.seq_len="$SEQ" training.local_batch=1 parallel.cp=1
      parallel.ep=1 parallel.dp_shard=1 data.name=packaged data.tokenizer=byte checkpoint.enable=false nproc=1
      training.steps="$STEPS" training.kernel_cache="$KC" logging.tensorboard=false logging.color=false
      preflight.memory=warn ${EXTRA:-})
for spec in "${RUNS[@]}"; do
  name=${spec%%=*}; IFS=',' read -r -a ov <<< "${spec#*=}"
  rm -rf "$OUT/e2e_$name"
  t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$LIMIT" "$PY" -m framework.cli train "${BASE[@]}" "${ov[@]}" \
    output_dir="$OUT/e2e_$name" > "$OUT/e2e_$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s; log $OUT/e2e_$name.log"
done
"$PY" - "$OUT" "$SKIP" "${RUNS[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, skip, runs = Path(sys.argv[1]), int(sys.argv[2]), [r.split("=", 1)[0] for r in sys.argv[3:]]
print(f"\n{'run':22s} {'tok/s':>9s} {'s/step':>8s} {'peak GiB':>9s} {'last loss':>10s} {'steps':>6s}")
for name in runs:
    f = out / f"e2e_{name}" / "metrics.jsonl"
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.is_file() else []
    if not recs:
        log = out / f"e2e_{name}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        why = "out of memory" if "OutOfMemoryError" in text or "out of memory" in text else "no metrics (see log)"
        print(f"{name:22s} {why}")
        continue
    steady = [r for r in recs if r.get("step", 0) >= skip] or recs
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    st = statistics.median(r["step_time_s"] for r in steady)
    peak = max(r.get("peak_mem_bytes", 0) for r in recs) / 2**30
    print(f"{name:22s} {tps:9.0f} {st:8.3f} {peak:9.2f} {recs[-1].get('loss', float('nan')):10.4f} {len(recs):6d}")
PY
