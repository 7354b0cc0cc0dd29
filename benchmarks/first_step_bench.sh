#!/usr/bin/env bash
# Time to first step on one H200 (issue 17): step 1 on a cold kernel cache, then a relaunch on the
# same machine with the same cache directory, each with its breakdown (metrics.jsonl's first
# record: build, compile, autotuning, other; framework/train/first_step.py) and the steady step.
#   OUT=/some/dir bash benchmarks/first_step_bench.sh
# SEQ (default 32768) and FLEX_AUTOTUNE (default false, the recipe default; true: flex attention compiled with max-autotune)
# pick the pair measured; TAG names the runs (default: s$SEQ-at$FLEX_AUTOTUNE-$AUTOTUNE_CONFIGS); KEEP_CACHE=1 starts
# from whatever OUT/kc holds instead of an empty cache (e.g. the other FLEX_AUTOTUNE setting's run:
# then step 1 is the compile that setting adds).
# AUTOTUNE_CONFIGS (default recorded) is training.autotune_configs: `all` tunes every Triton config,
# as before recorded tables existed (framework/train/autotune_table.py). RELAUNCH=0 skips the relaunch.
# Bounded to 9 minutes in all: cold 390 s, relaunch 140 s (`timeout`); a run cut off prints so.
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
export TRITON_PRINT_AUTOTUNING=1   # Triton names each kernel it tunes (not those read from the cache)
KC="$OUT/kc"
SEQ=${SEQ:-32768}; FLEX_AUTOTUNE=${FLEX_AUTOTUNE:-false}; AUTOTUNE_CONFIGS=${AUTOTUNE_CONFIGS:-recorded}; TAG=${TAG:-s$SEQ-at$FLEX_AUTOTUNE-$AUTOTUNE_CONFIGS}
[ "${KEEP_CACHE:-0}" = 1 ] || rm -rf "$KC"   # cold: an empty cache directory
rm -rf "$OUT/first_step_${TAG}_cold" "$OUT/first_step_${TAG}_relaunch"
ARGS=(recipe=qwen35_35b_128k recompute=full model.n_layers=4 training.seq_len="$SEQ" model.flex_autotune="$FLEX_AUTOTUNE" parallel.cp=1 parallel.ep=1
      parallel.dp_shard=1 data.name=packaged data.tokenizer=byte checkpoint.enable=false nproc=1
      training.steps="${STEPS:-6}" training.kernel_cache="$KC" training.autotune_configs="$AUTOTUNE_CONFIGS"
      logging.tensorboard=false)
run() {  # name, time limit in seconds
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$2" "$PY" -m framework.cli train "${ARGS[@]}" output_dir="$OUT/first_step_${TAG}_$1" \
    > "$OUT/first_step_${TAG}_$1.log" 2>&1
  echo "${TAG}_$1: exit $? after $((SECONDS - t0)) s (limit $2 s); log $OUT/first_step_${TAG}_$1.log"
}
run cold "${COLD_LIMIT:-390}"
[ "${RELAUNCH:-1}" = 1 ] && run relaunch "${RELAUNCH_LIMIT:-140}"
"$PY" - "$OUT" "$TAG" <<'PY'
import json, sys
from pathlib import Path
out, tag = Path(sys.argv[1]), sys.argv[2]
print(f"\n{'launch':9s} {'step1 s':>8s} {'build s':>8s} {'compile s':>9s} {'autotune s':>10s} {'tuned':>5s} "
      f"{'hits':>5s} {'table':>5s} {'other s':>8s} {'steady s':>8s} {'tok/s':>8s}")
for name in ("cold", "relaunch"):
    f = out / f"first_step_{tag}_{name}" / "metrics.jsonl"
    recs = [json.loads(l) for l in f.read_text().splitlines()] if f.is_file() else []
    if not recs or "first_step_wall_s" not in recs[0]:
        print(f"{name:9s} no first-step record (cut off before step 1 ended?)")
        continue
    r, last = recs[0], recs[-1]
    tail = sorted(recs[3:] or recs[1:], key=lambda x: x["step_time_s"])  # steady: median of steps >= 4
    mid = tail[len(tail) // 2] if tail else None
    steady = f"{mid['step_time_s']:8.2f} {mid['tokens_per_s']:8.0f}" if mid else f"{'-':>8s} {'-':>8s}"
    print(f"{name:9s} {r['first_step_wall_s']:8.1f} {r['first_step_build_s']:8.1f} {r['first_step_compile_s']:9.1f} "
          f"{r['first_step_autotune_s']:10.1f} {r['first_step_autotuned_kernels']:5d} {r['autotune_cache_hits']:5d} "
          f"{r.get('first_step_autotune_from_table', 0):5d} {r['first_step_other_s']:8.1f} {steady}")
    if r.get("first_step_autotune_slowest"):
        print(f"{'':9s} longest tunings: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["first_step_autotune_slowest"].items()))
for name in ("cold", "relaunch"):
    log = out / f"first_step_{tag}_{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    tuned = [(l.split("function ", 1)[1].rstrip(","), lines[i + 1].strip()) for i, l in enumerate(lines[:-1])
             if l.startswith("Triton autotuning for function ")]
    print(f"{name}: Triton tuned {len(tuned)} kernel/key pairs" + (":" if tuned and name == "relaunch" else ""))
    if name == "relaunch":
        for fn, key in tuned:
            print(f"  {fn} {key}")
kc = out / "kc"
for d in ("triton", "inductor"):
    files = [p for p in (kc / d).rglob("*") if p.is_file()] if (kc / d).is_dir() else []
    print(f"cache {d}: {len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB, "
          f"{sum(p.name.endswith('.autotune.json') for p in files)} autotuning results")
PY
