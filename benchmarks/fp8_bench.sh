#!/usr/bin/env bash
# precision=bf16 vs fp8 on one GPU node; results land in $OUT (default ./bench_out).
#   bash benchmarks/fp8_bench.sh [qwen3_trunc|qwen3_trunc_te|qwen35_trunc]...
# qwen3_trunc     Qwen3-30B-A3B at full width, 4 layers, 16K tokens per GPU (the train_bench.sh
#                 qwen3_trunc setting), 50 steps from one seed checkpoint: `apiary compare
#                 precision=bf16,fp8 --check` (torchao tensorwise linears + rowwise expert GEMMs):
#                 tok/s, peak, loss curves side by side, held to the fp8 tolerance.
# qwen3_trunc_te  one fp8 run with precision.backend=te (dense linears only; needs transformer_engine), `train` only
# qwen35_trunc    Qwen3.5-35B-A3B, 4 layers, 32K tokens, bf16 vs fp8 torchao (docs/benchmarks.md's run)
# qwen3_rowwise   one fp8 run (torchao rowwise linears) of the qwen3_trunc setting, `train` only
# smoke           the debug MoE recipe in fp8 for 5 steps (whole path: conversion, FSDP2, dispatcher)
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
STEPS=${STEPS:-50}
export PYTHONUNBUFFERED=1
QWEN3=(recipe=qwen3_30b_a3b_64k model.n_layers=4 training.seq_len=16384 parallel.cp=1 data.name=packaged
       data.tokenizer=byte training.steps=$STEPS logging.tensorboard=false lr.warmup_steps=2 model.flex_autotune=false)
for what in "${@:-qwen3_trunc}"; do
  case $what in
    qwen3_trunc)
      python3 -m framework.cli compare "${QWEN3[@]}" precision=bf16,fp8 --check --timeout=900 \
        output_dir="$OUT/fp8_qwen3_trunc" 2>&1 | tail -n 60 ;;
    qwen3_trunc_te)
      python3 -m framework.cli train "${QWEN3[@]}" precision=fp8 precision.backend=te precision.experts=false \
        checkpoint.enable=false output_dir="$OUT/fp8_qwen3_trunc_te" 2>&1 | tail -n 20 ;;
    qwen3_rowwise)
      python3 -m framework.cli train "${QWEN3[@]}" precision=fp8 precision.scaling=rowwise checkpoint.enable=false \
        output_dir="$OUT/fp8_qwen3_rowwise" 2>&1 | tail -n 20 ;;
    smoke)
      python3 -m framework.cli train recipe=debug_moe precision=fp8 training.steps=5 logging.tensorboard=false \
        checkpoint.enable=false output_dir="$OUT/fp8_smoke" 2>&1 | tail -n 12 ;;
    qwen35_trunc)
      python3 -m framework.cli compare recipe=qwen35_35b_128k model.n_layers=4 training.seq_len=32768 \
        parallel.cp=1 data.name=packaged data.tokenizer=byte training.steps=$STEPS logging.tensorboard=false \
        lr.warmup_steps=2 model.flex_autotune=false precision=bf16,fp8 --check --timeout=1200 \
        output_dir="$OUT/fp8_qwen35_trunc" 2>&1 | tail -n 60 ;;
  esac
done
