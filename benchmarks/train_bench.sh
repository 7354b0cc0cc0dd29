#!/usr/bin/env bash
# End-to-end training measurements on one GPU node; results land in $OUT (default ./bench_out).
#   bash benchmarks/train_bench.sh [smoke|qwen3_trunc]...
# smoke        the default recipe on the GPU (5 steps)
# qwen3_trunc  Qwen3-30B-A3B at full width, 4 layers, 16K tokens per GPU, chunked CE, full
#              recompute, FSDP2; 10 steps; the planner's estimate is recorded next to the peak.
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
export PYTHONUNBUFFERED=1
for what in "${@:-smoke qwen3_trunc}"; do
  case $what in
    smoke)
      python3 -m framework.cli train training.steps=5 logging.tensorboard=false \
        output_dir="$OUT/smoke" 2>&1 | tail -n 12 ;;
    qwen3_trunc)
      python3 -m framework.cli train recipe=qwen3_30b_a3b_64k nproc="$NGPU" model.n_layers=4 \
        training.seq_len=$((16384 * NGPU)) parallel.cp="$NGPU" data.name=packaged data.tokenizer=byte \
        training.steps=10 checkpoint.enable=false logging.tensorboard=false lr.warmup_steps=2 \
        output_dir="$OUT/qwen3_trunc_${NGPU}gpu" 2>&1 | tail -n 16 ;;
  esac
done
