#!/usr/bin/env bash
# Optimizer offload on one GPU (issue 33, item 3): the 4-layer Qwen3.5-35B-A3B at full width, one
# sequence of SEQ tokens per step (benchmarks/loss_e2e_bench.sh's setup: same seed, data and kernel
# cache), with the optimizer on the GPU, offloaded, and offloaded with the transfers overlapped.
#   OUT=/some/dir SEQ=32768 STEPS=12 bash benchmarks/offload_bench.sh [RUN ...]
# RUN is NAME=OVERRIDES (overrides joined by ','), default:
#   gpu (state.offload=none)   offload (state.offload=optimizer)
#   overlap (state.offload=optimizer, state.offload_overlap=true)
# Prints loss_e2e_bench.sh's table: median tok/s and s/step over steps >= SKIP, peak memory (torch
# max reserved), the last logged loss. The offloaded runs' host update uses state.offload_threads=0
# (this process's CPUs). EXTRA adds overrides to every run, e.g. EXTRA="training.global_batch=2" for
# gradient accumulation 2 (the overlap copies each gradient after the step's last micro-batch).
# Expected from the non-overlapped measurement (one H200, 32K): gpu ~0.65 s/step, offload ~2.54 s.
# Not yet run for the overlap.
set -uo pipefail
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  RUNS=("gpu=state.offload=none" "offload=state.offload=optimizer"
        "overlap=state.offload=optimizer,state.offload_overlap=true")
fi
OUT=${OUT:-bench_out/offload} LIMIT=${LIMIT:-600} exec bash "$(dirname "$0")/loss_e2e_bench.sh" "${RUNS[@]}"
