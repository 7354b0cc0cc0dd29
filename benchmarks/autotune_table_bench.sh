#!/usr/bin/env bash
# Record this GPU's autotuning table, then measure what it does to the first step (issue 17), on
# one GPU, in one go (about 6 minutes on an H200):
#   1. a cold run with training.autotune_configs=all: Triton tunes every config (OUT/all/kc);
#   2. `apiary autotune-table OUT/all/kc --out OUT/ARCH.json`, copied to framework/train/autotune_tables/
#      (commit it to ship it: framework/train/autotune_table.py);
#   3. a cold run and a relaunch with training.autotune_configs=recorded on a fresh cache.
#   OUT=/some/dir bash benchmarks/autotune_table_bench.sh        (SEQ, FLEX_AUTOTUNE as first_step_bench.sh)
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT="$OUT/all" AUTOTUNE_CONFIGS=all RELAUNCH=0 STEPS=${ALL_STEPS:-4} bash benchmarks/first_step_bench.sh
ARCH=$("$PY" -c "from framework.train import autotune_table; print(autotune_table.arch())")
"$PY" -m toolkit.cli autotune-table "$OUT/all/kc" --out "$OUT/$ARCH.json" || exit 1
cp "$OUT/$ARCH.json" "framework/train/autotune_tables/$ARCH.json"
OUT="$OUT/recorded" AUTOTUNE_CONFIGS=recorded STEPS=${STEPS:-12} bash benchmarks/first_step_bench.sh
