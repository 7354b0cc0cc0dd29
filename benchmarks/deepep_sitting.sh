#!/usr/bin/env bash
# One GPU sitting for moe.comm=deepep (issue 44) on two H200s of one host, in parts that each fit a
# 10-minute command, writing small result files under $OUT. NOT YET RUN ON A GPU.
#
# Here, before the sitting (the fetched mirrors of deepseek-ai/DeepEP and fmtlib/fmt):
#   bash scripts/deepep_source.sh        # .deepep/src.tar.gz, .deepep/wheels, .deepep/include (gitignored)
# Then, on nvidia-h200-x2, each with carry [".deepep"], the apiary stack already in /tmp/gpu-site:
#   PART=build   bash benchmarks/deepep_sitting.sh   # scripts/build_deepep.sh -> /tmp/gpu-site/deep_ep
#   PART=parity  bash benchmarks/deepep_sitting.sh   # tests/gpu/test_deepep_gpu.py (EP 2, outputs + grads)
#   PART=layer   bash benchmarks/deepep_sitting.sh   # moe_layer_bench: alltoall vs deepep, 4K..64K tokens/rank
#   PART=train COMM=alltoall bash benchmarks/deepep_sitting.sh   # Qwen3.5-35B-A3B, 8 layers, 128K, CP 2 x EP 2
#   PART=train COMM=deepep   bash benchmarks/deepep_sitting.sh
#   PART=plan    bash benchmarks/deepep_sitting.sh   # the planner's estimate of both runs (CPU is enough)
# The build and the JIT kernel cache live in /tmp (kept while the machine stays warm; a fresh machine
# needs PART=build again). The deep_ep JIT compiles its kernels on first use (nvcc): the first
# deepep call of a part is slower than the rest.
set -uo pipefail
OUT=${OUT:-bench_out/deepep}; mkdir -p "$OUT"; PART=${PART:-build}
export PYTHONPATH=/tmp/gpu-site:$PWD
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
# DeepEP on one node without RDMA: NVLink only, its own NCCL communicator (components/moe/comm.py sets
# the same defaults in each rank for a training run); the JIT's cache in /tmp
export EP_DISABLE_GIN=${EP_DISABLE_GIN:-1} EP_REUSE_NCCL_COMM=${EP_REUSE_NCCL_COMM:-0} EP_JIT_CACHE_DIR=/tmp/deep_ep_jit
if [ -z "${CUDA_HOME:-}" ]; then  # deep_ep's JIT needs nvcc (as scripts/build_deepep.sh found it)
  if command -v nvcc >/dev/null; then export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); \
  else export CUDA_HOME=/usr/local/cuda; fi
fi
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
case "$PART" in
build)
  timeout 580 bash scripts/build_deepep.sh 2>&1 | tee "$OUT/build.log" | tail -25
  cp /tmp/deepep-build/build.log "$OUT/setup_py.log" 2>/dev/null
  ;;
parity)
  timeout 580 $PY -m pytest -q -s -rs -p no:cacheprovider tests/gpu/test_deepep_gpu.py 2>&1 | tee "$OUT/parity.log" \
    | grep -E "rank [01]:|passed|failed|skipped|Error" | tail -12
  ;;
layer)
  timeout 580 $PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/moe_layer_bench.py \
    --comms alltoall deepep --policies none --tokens 4096 8192 16384 32768 65536 --iters 10 \
    --out "$OUT/moe_layer_deepep_ep2.json" 2>&1 | tee "$OUT/layer.log" | grep -v INFO | tail -22
  ;;
train)
  COMM=${COMM:?COMM=alltoall or COMM=deepep}
  # moe.chunk=none for both: chunking is an alltoall schedule (deepep refuses it); steps 1-2 compile
  timeout 590 $PY -m framework.cli train recipe=qwen35_35b_128k nproc=2 model.n_layers=8 parallel.cp=2 parallel.ep=2 \
    moe.comm="$COMM" moe.chunk=none data.name=packaged data.tokenizer=byte checkpoint.enable=false \
    training.steps="${STEPS:-8}" lr.warmup_steps=2 model.flex_autotune=false logging.tensorboard=false \
    logging.color=false output_dir="/tmp/deepep_train/$COMM" > "$OUT/train_$COMM.log" 2>&1
  echo "rc=$?" >> "$OUT/train_$COMM.log"
  cp "/tmp/deepep_train/$COMM/metrics.jsonl" "$OUT/metrics_$COMM.jsonl" 2>/dev/null
  tail -4 "$OUT/train_$COMM.log"
  $PY - "$OUT/metrics_$COMM.jsonl" <<'PY'
import json, statistics, sys
from pathlib import Path
f = Path(sys.argv[1])
recs = [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []
steady = [r for r in recs if r.get("step", 0) >= 3]
def med(k):
    v = [r[k] for r in steady if k in r]
    return statistics.median(v) if v else float("nan")
print(f"{f.name}: {len(recs)} steps; steps >= 3: tok/s {med('tokens_per_s'):,.0f}, "
      f"peak {med('peak_mem_bytes') / 2**30:.2f} GiB ({steady[-1].get('peak_mem_kind') if steady else '?'}); "
      f"loss at last step {recs[-1].get('loss') if recs else 'n/a'}")
PY
  ;;
plan)
  for c in alltoall deepep; do
    $PY -m toolkit.cli plan recipe=qwen35_35b_128k gpus=2 gpu=H200 model.n_layers=8 parallel.cp=2 parallel.ep=2 \
      moe.comm=$c moe.chunk=none data.name=packaged data.tokenizer=byte > "$OUT/plan_$c.txt" 2>&1
    grep -E "deepep_buffer|verdict|torch max|TOTAL|total" "$OUT/plan_$c.txt" | head -4
  done
  ;;
*) echo "PART must be build, parity, layer, train (COMM=...) or plan" >&2; exit 2 ;;
esac
