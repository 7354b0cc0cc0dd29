#!/usr/bin/env bash
# precision=bf16 vs fp8 on one GPU node; results land in $OUT (default ./bench_out).
#   bash benchmarks/fp8_bench.sh [qwen3_trunc|qwen3_trunc_te|qwen35_trunc]...
# qwen3_trunc     Qwen3-30B-A3B at full width, 4 layers, 16K tokens per GPU (the train_bench.sh
#                 qwen3_trunc setting), 50 steps from one seed checkpoint: `apiary compare
#                 precision=bf16,fp8 --check` (torchao tensorwise linears + rowwise expert GEMMs):
#                 tok/s, peak, loss curves side by side, held to the fp8 tolerance.
# qwen3_trunc_te  one fp8 run with precision.backend=te (dense linears only; needs transformer_engine), `train` only
# qwen35_trunc    Qwen3.5-35B-A3B, 4 layers, 32K tokens, one GPU, bf16 vs fp8 torchao through compare
# qwen35_bf16, qwen35_fp8  the same pair as two plain `train` runs
# qwen35_te       the qwen35 setting in fp8 with precision.backend=te (dense linears), `train` only
# qwen3_bf16, qwen3_fp8  the qwen3_trunc pair as two plain `train` runs (no seed checkpoint, no probe)
# qwen3_bf16_compile, qwen3_fp8_compile    the qwen3 pair with precision.compile=true (torchtitan's
#                 per-block compile; fp8: torchao, the fused QKV projection stays bf16)
# qwen35_bf16_compile, qwen35_fp8_compile  the same for the qwen35 setting
# qwen3_rowwise   one fp8 run (torchao rowwise linears) of the qwen3_trunc setting, `train` only
# smoke           the debug MoE recipe in fp8 for 5 steps (whole path: conversion, FSDP2, dispatcher)
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
STEPS=${STEPS:-50}
export PYTHONUNBUFFERED=1
QWEN3=(recipe=qwen3_30b_a3b_64k recompute=full model.n_layers=4 training.seq_len=16384 parallel.cp=1 data.name=packaged
       data.tokenizer=byte training.steps=$STEPS logging.tensorboard=false lr.warmup_steps=2 model.flex_autotune=false)
QWEN35=(recipe=qwen35_35b_128k recompute=full model.n_layers=4 training.seq_len=32768 training.local_batch=1 parallel.cp=1
        parallel.ep=1 parallel.dp_shard=1 data.name=packaged data.tokenizer=byte training.steps=$STEPS
        logging.tensorboard=false lr.warmup_steps=2 model.flex_autotune=false)
show_compare() {  # the report and any variant's traceback, on stdout (the folder may not come back)
  cat "$1/compare.md" 2>/dev/null | head -n 80
  for log in "$1"/*/worker.log; do
    [ -f "$log" ] && grep -q Traceback "$log" && { echo "== $log"; grep -A60 Traceback "$log" | tail -n 60; }
  done
  df -h "$OUT" | tail -n 1
}
for what in "${@:-qwen3_trunc}"; do
  case $what in
    qwen3_trunc)
      python3 -m toolkit.cli compare "${QWEN3[@]}" precision=bf16,fp8 checkpoint.model_only_last=true --check --timeout=400 \
        output_dir="$OUT/fp8_qwen3_trunc" 2>&1 | tail -n 60
      show_compare "$OUT/fp8_qwen3_trunc" ;;
    qwen3_trunc_te)
      python3 -m framework.cli train "${QWEN3[@]}" precision=fp8 precision.backend=te precision.experts=false \
        checkpoint.enable=false output_dir="$OUT/fp8_qwen3_trunc_te" 2>&1 | tail -n 30 ;;
    qwen3_bf16|qwen3_fp8)  # the pair as two plain runs (same seed, same init), no seed checkpoint or probe
      python3 -m framework.cli train "${QWEN3[@]}" precision=${what#qwen3_} checkpoint.enable=false \
        output_dir="$OUT/$what" 2>&1 | tail -n 30 ;;
    qwen3_bf16_compile|qwen3_fp8_compile)
      p=${what#qwen3_}; p=${p%_compile}
      timeout ${RUN_TIMEOUT:-500} python3 -m framework.cli train "${QWEN3[@]}" precision=$p precision.compile=true \
        checkpoint.enable=false output_dir="$OUT/$what" 2>&1 | tail -n 12 ;;
    qwen35_bf16_compile|qwen35_fp8_compile)
      p=${what#qwen35_}; p=${p%_compile}
      timeout ${RUN_TIMEOUT:-500} python3 -m framework.cli train "${QWEN35[@]}" precision=$p precision.compile=true \
        checkpoint.enable=false output_dir="$OUT/$what" 2>&1 | tail -n 12 ;;
    qwen3_rowwise)
      python3 -m framework.cli train "${QWEN3[@]}" precision=fp8 precision.scaling=rowwise checkpoint.enable=false \
        output_dir="$OUT/fp8_qwen3_rowwise" 2>&1 | tail -n 30 ;;
    smoke)
      python3 -m framework.cli train recipe=debug_moe precision=fp8 training.steps=5 logging.tensorboard=false \
        checkpoint.enable=false output_dir="$OUT/fp8_smoke" 2>&1 | tail -n 30 ;;
    qwen35_trunc)
      python3 -m toolkit.cli compare "${QWEN35[@]}" checkpoint.model_only_last=true precision=bf16,fp8 --check \
        --timeout=600 output_dir="$OUT/fp8_qwen35_trunc" 2>&1 | tail -n 60
      show_compare "$OUT/fp8_qwen35_trunc" ;;
    qwen35_te)
      python3 -m framework.cli train "${QWEN35[@]}" precision=fp8 precision.backend=te precision.experts=false \
        checkpoint.enable=false output_dir="$OUT/fp8_qwen35_te" 2>&1 | tail -n 30 ;;
    qwen35_bf16|qwen35_fp8)
      python3 -m framework.cli train "${QWEN35[@]}" precision=${what#qwen35_} checkpoint.enable=false \
        output_dir="$OUT/$what" 2>&1 | tail -n 30 ;;
  esac
done
# summary of every run under $OUT that has a metrics.jsonl: median tok/s and step time of steps
# 4.., peak memory, loss at the first and last step (compare's table says the same for its runs)
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
for m in sorted(Path(sys.argv[1]).rglob("metrics.jsonl")):
    recs = [json.loads(l) for l in m.read_text().splitlines() if l.strip().startswith("{")]
    steps = [r for r in recs if "tokens_per_s" in r]
    if not steps:
        continue
    steady = [r for r in steps if r["step"] >= 4] or steps
    print(f"{m.parent.relative_to(sys.argv[1])}: steps {steps[-1]['step']}, "
          f"tok/s {statistics.median(r['tokens_per_s'] for r in steady):,.0f}, "
          f"step {statistics.median(r['step_time_s'] for r in steady):.3f} s, "
          f"peak {max(r.get('peak_mem_bytes', 0) for r in steps) / 2**30:.2f} GiB ({steps[-1].get('peak_mem_kind')}), "
          f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}")
PY
