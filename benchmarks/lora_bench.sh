#!/usr/bin/env bash
# LoRA against full training on one GPU (H200): the 4-layer Qwen3.5-35B-A3B at full width, one
# sequence of SEQ tokens per step, the same seed, data, kernel cache and layout (EP 1, CP 1, FSDP 1);
# only adapter= changes. Prints, per run, median tok/s and s/step over steps >= SKIP, the measured
# peak (torch max reserved) and the planner's estimate of it for the same settings (docs/skills/lora.md).
#   OUT=/some/dir bash benchmarks/lora_bench.sh            # full, lora (the recipe's targets), lora_attn
#   OUT=/some/dir SEQ=32768 STEPS=12 bash benchmarks/lora_bench.sh NAME=OVERRIDES ...
# RUN is NAME=OVERRIDES (overrides joined by ','). Each run: `timeout` LIMIT seconds (default 300). The
# base is the seeded initialisation (no weights to download); throughput and memory do not depend on it.
# Results: $OUT/lora_<name>/metrics.jsonl, $OUT/lora_<name>.log, $OUT/plan_<name>.json and $OUT/lora_bench.txt.
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
SEQ=${SEQ:-32768}; STEPS=${STEPS:-12}; SKIP=${SKIP:-4}; LIMIT=${LIMIT:-300}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
KC=${KC:-$OUT/kc}   # one kernel cache for every run: only the first pays compile + autotune
export PYTHONUNBUFFERED=1
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  RUNS=("full=adapter=none,~adapter.rank,~adapter.alpha,~adapter.targets"
        "lora=adapter=lora"
        "lora_attn=adapter=lora,adapter.targets=[q;k;v;o]")
fi
# the LoRA recipe's model and settings; `full` switches its adapter off (unsetting the adapter's keys)
BASE=(recipe="${RECIPE:-qwen35_35b_lora_128k}" recompute="${RECOMPUTE:-full}" model.n_layers="${LAYERS:-4}" training.seq_len="$SEQ"
      training.local_batch=1 parallel.cp=1 parallel.ep=1 parallel.dp_shard=1 data.name=packaged data.tokenizer=byte
      checkpoint.enable=false training.steps="$STEPS" training.kernel_cache="$KC" logging.tensorboard=false
      logging.color=false preflight.memory=warn ${EXTRA:-})
for spec in "${RUNS[@]}"; do
  name=${spec%%=*}; IFS=',' read -r -a ov <<< "${spec#*=}"
  ov=("${ov[@]//;/,}")  # a list value's commas are written ';' in RUN
  rm -rf "$OUT/lora_$name"
  "$PY" -m toolkit.cli plan "${BASE[@]}" "${ov[@]}" gpus=1 gpu=H200 --json > "$OUT/plan_$name.json" 2> "$OUT/plan_$name.err"
  t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$LIMIT" "$PY" -m framework.cli train "${BASE[@]}" "${ov[@]}" nproc=1 \
    output_dir="$OUT/lora_$name" > "$OUT/lora_$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s; log $OUT/lora_$name.log"
done
"$PY" - "$OUT" "$SKIP" "${RUNS[@]}" <<'PY' | tee "$OUT/lora_bench.txt"
import json, statistics, sys
from pathlib import Path
out, skip, runs = Path(sys.argv[1]), int(sys.argv[2]), [r.split("=", 1)[0] for r in sys.argv[3:]]
print(f"\n{'run':12s} {'tok/s':>9s} {'s/step':>8s} {'peak GiB':>9s} {'plan GiB':>9s} {'plan err':>9s} {'last loss':>10s} {'steps':>6s}")
for name in runs:
    plan = None
    pf = out / f"plan_{name}.json"
    try:
        plan = json.loads(pf.read_text())["torch_reserved_bytes"] / 2**30
    except (OSError, ValueError, KeyError):
        pass
    plan_s = f"{plan:9.2f}" if plan is not None else f"{'?':>9s}"
    f = out / f"lora_{name}" / "metrics.jsonl"
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.is_file() else []
    if not recs:
        log = out / f"lora_{name}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        why = "out of memory" if "OutOfMemoryError" in text or "out of memory" in text else "no metrics (see log)"
        print(f"{name:12s} {why:>27s} {plan_s}")
        continue
    steady = [r for r in recs if r.get("step", 0) >= skip] or recs
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    st = statistics.median(r["step_time_s"] for r in steady)
    peak = max(r.get("peak_mem_bytes", 0) for r in recs) / 2**30
    err = f"{(plan - peak) / peak:+9.1%}" if plan is not None and peak else f"{'?':>9s}"
    print(f"{name:12s} {tps:9.0f} {st:8.3f} {peak:9.2f} {plan_s} {err} {recs[-1].get('loss', float('nan')):10.4f} {len(recs):6d}")
PY
