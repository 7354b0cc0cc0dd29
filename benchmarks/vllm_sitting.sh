#!/usr/bin/env bash
# One GPU sitting for the vLLM loop (two H200s; docs/rl.md, docs/skills/transport.md), in two parts that
# each fit a 10-minute command, writing small result files under $OUT:
#   PART=1: tests/gpu/test_vllm_gpu.py (qwen3 and qwen3_5, IPC; NCCL to the second GPU) and
#           benchmarks/weight_sync_bench.py (the 4-layer Qwen3.5-35B-A3B width: IPC, NCCL, the folder).
#   PART=2: the live loop with vLLM generating (benchmarks/rl_loop_vllm.sh: learn, lr=0, routing replay on
#           GPU 0; the tiny Qwen3.5 MoE with and without replay, then a LoRA run, on GPU 1), and `apiary
#           logprobs` against the engine's own log-probs on the first shard of the learn run (version 0).
#   PART=3: training tok/s at the 4-layer width with an in-memory update every step (GPU 0, the engine
#           beside it) against none (GPU 1, at the same time), on static synthetic rollouts (the engine,
#           --serve, only takes the updates); then the Qwen3.5 and LoRA cases of tests/gpu/test_vllm_gpu.py.
# A device call brings back at most 8 files: each part writes fewer.
# On one H200 (kind nvidia-h200), three parts of the same ground, each under 10 minutes (a cold Qwen3.5 engine
# took over 90 s to start on a fresh machine):
#   PART=4: `apiary warmup` of the tiny Qwen3.5 MoE loop's recipe (its kernel cache) beside a LoRA loop (the
#           adapters' load times: lora_engine_updates.jsonl);
#   PART=7: the tiny Qwen3.5 MoE loop, learning, then with routing replay.
#   PART=6: the Qwen3.5 and LoRA cases of tests/gpu/test_vllm_gpu.py, one after the other (TTEST s each).
#   PART=5: training tok/s at the 4-layer width with no publication, then with an in-memory update every step
#           into an engine beside it (publish.bucket_mb=${BUCKET_MB:-4096}), one rollout of SEQ tokens per step
#           (default 4096); the update times of that run are the 4-layer width's IPC hand-off at that bucket size.
#           EVERY_OV="publish.when_busy=skip" adds overrides to the run with updates (and "publish.interval=4" an
#           update every 4 steps).
#   PART=8: the qwen3 IPC case of tests/gpu/test_vllm_gpu.py beside the tiny Qwen3.5 MoE loop, learning (its logs' tails back).
#   PART=9: the Qwen3.5 case of tests/gpu/test_vllm_gpu.py (TTEST s) beside the tiny Qwen3.5 MoE loop with routing
#           replay (the logs' tails of both back).
#   PART=10: every file of tests/gpu but test_vllm_gpu.py (the engine's cases: PART=6/8/9), one pytest each, a
#           summary line per file in gpu_tests.txt (the suite's GPU half after a change to the training path).
#   PART=11: PART=10's files all at once (one pytest each), the qwen3 IPC and LoRA cases of test_vllm_gpu.py, and
#           the tiny Qwen3.5 MoE loop at lr 0 (the control; KC=/tmp/kc35, PART=9's kernel cache on the same
#           machine), then `apiary logprobs` on that run's first shard against the engine's own log-probs.
#   PART=5 with NONE=0 skips the run without publication (its tok/s from an earlier sitting of the same shape);
#           BASE_OV="training.global_batch=4" adds overrides to both runs (4 sequences per optimizer step, one update
#           per optimizer step), TNONE the run without publication's limit (default 150 s).
#   PART=12: the LoRA case of tests/gpu/test_vllm_gpu.py alone, then the tiny Qwen3.5 MoE loop until the engine has
#           written its first shard (version 0), and `apiary logprobs` on that shard against the engine's log-probs
#           (LORA=0 skips the LoRA case; on a fresh machine each half needs most of a call: a cold engine).
# The stack: PYTHONPATH=/tmp/gpu-site (docs/install.md) plus nvidia-cutlass-dsl's module folder (its .pth
# is not read from a PYTHONPATH folder; vLLM's Qwen3.5 path needs it).
#   OUT=/some/dir PART=1 bash benchmarks/vllm_sitting.sh
set -uo pipefail
OUT=${OUT:-bench_out/vllm}; mkdir -p "$OUT"; PART=${PART:-1}
export PYTHONPATH=/tmp/gpu-site:/tmp/gpu-site/nvidia_cutlass_dsl/dsl_packages:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
errors() { for f in "$@"; do [ -f "$f" ] && { echo "== $f"; grep -E "Error|Traceback" "$f" | tail -6; }; done; }
# the runs' tok/s (median of steps >= 4) and publication times, from /tmp/tp/{none,every}/metrics.jsonl
throughput_table() {
  $PY - /tmp/tp <<'PY'
import json, statistics, sys
from pathlib import Path
for name in ("none", "every"):
    f = Path(sys.argv[1]) / name / "metrics.jsonl"
    recs = [json.loads(l) for l in f.read_text().splitlines()] if f.is_file() else []
    steady = [r for r in recs if r["step"] >= 4]
    tps = statistics.median(r["tokens_per_s"] for r in steady) if steady else float("nan")
    med = lambda k: statistics.median(v) if (v := [r[k] for r in steady if k in r]) else float("nan")
    sent, deferred = (sum(k in r for r in recs) for k in ("publish/transfer_s", "publish/deferred"))
    print(f"{name:6s} tok/s {tps:10.0f}  steps {len(recs)}  blocked {med('publish/blocked_s'):.3f} s  "
          f"transfer {med('publish/transfer_s'):.3f} s  engine paused {med('publish/engine_s'):.3f} s (medians, steps >= 4)  "
          f"versions sent {sent}, deferred {deferred}")
PY
}
# apiary logprobs' ref_logprobs against the engine's old_logprobs on the scored tokens of one shard
logprob_diff() {
  $PY - "$1" <<'PY'
import json, sys
d = []
for line in open(sys.argv[1]):
    r = json.loads(line)
    d += [abs(a - b) for a, b, m in zip(r["ref_logprobs"], r["old_logprobs"], r["loss_mask"]) if m]
print(f"apiary logprobs vs the engine's, {len(d)} tokens: mean |diff| {sum(d) / len(d):.3g}, max {max(d):.3g}")
PY
}
case "$PART" in
1)
  timeout 330 $PY -m pytest -q -s -p no:cacheprovider --basetemp=/tmp/pt tests/gpu/test_vllm_gpu.py 2>&1 \
    | grep -v INFO | tee "$OUT/gpu_test.log" | grep -E "passed|failed|logprob diff" | tail -6
  errors /tmp/pt/*/engine_*.log > "$OUT/engine_errors.log"
  timeout 240 $PY benchmarks/weight_sync_bench.py --out /tmp/ws --updates 4 2>&1 | grep -v INFO | tee "$OUT/ws.log" | tail -8
  cp /tmp/ws/weight_sync.json "$OUT/" 2>/dev/null
  ;;
2)
  # the two GPUs at once: qwen3 (learn, lr=0, routing replay) on GPU 0; the Qwen3.5 MoE (learn, replay), then
  # a LoRA run (adapters published as PEFT folders, loaded by vLLM as LoRA adapters) on GPU 1
  CUDA_VISIBLE_DEVICES=1 $PY - <<'PY' > "$OUT/lora_base.log" 2>&1
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import weight_sync_bench as w
m, wr = w.build("debug_grpo_vllm", [])
w.write_folder(m, wr, Path("/tmp/lbase"), 0)
PY
  sed 's/recipe=debug_grpo_vllm/recipe=qwen35_debug_grpo_vllm/' benchmarks/rl_loop_vllm.sh > /tmp/rl35.sh
  (CUDA_VISIBLE_DEVICES=0 OUT=/tmp/rl STEPS=${STEPS:-12} TLIMIT=${TLIMIT:-170} PY=$PY bash benchmarks/rl_loop_vllm.sh \
    "learn=" "flat=optimizer.lr=0,moe.load_balance_coeff=null" "replay=moe.routing_replay=true:--routing" > "$OUT/rl_qwen3.log" 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 OUT=/tmp/rl35 STEPS=${STEPS:-12} TLIMIT=${TLIMIT:-170} PY=$PY bash /tmp/rl35.sh \
    "learn=" "replay=moe.routing_replay=true:--routing" > "$OUT/rl_qwen35.log" 2>&1
   CUDA_VISIBLE_DEVICES=1 OUT=/tmp/rll STEPS=${STEPS:-12} TLIMIT=${TLIMIT:-170} PY=$PY bash benchmarks/rl_loop_vllm.sh \
    "lora=adapter=lora,model.hf_checkpoint=/tmp/lbase/step-0,publish.transport=hf_folder,optimizer.lr=2e-2" \
    > "$OUT/rl_lora.log" 2>&1) &
  wait
  tail -5 "$OUT/rl_qwen3.log" "$OUT/rl_qwen35.log"; tail -2 "$OUT/rl_lora.log"
  # apiary logprobs on the engine's first shard, with the weights that sampled it (version 0)
  CUDA_VISIBLE_DEVICES=0 $PY -m toolkit.cli logprobs /tmp/rl/learn/weights/step-0 /tmp/rl/learn/rollouts/000000.jsonl \
    --out /tmp/lp > "$OUT/logprobs.log" 2>&1
  logprob_diff /tmp/lp/000000.jsonl >> "$OUT/logprobs.log" 2>&1
  tail -1 "$OUT/logprobs.log"
  for n in learn flat replay; do cp /tmp/rl/$n/run/metrics.jsonl "$OUT/metrics_$n.jsonl" 2>/dev/null; done
  errors /tmp/rl*/*/generator.log /tmp/rl*/*/train.log > "$OUT/rl_errors.log"
  ;;
3)
  $PY benchmarks/synthetic_rollouts.py --count 64 --tokens 4096 --out /tmp/syn.jsonl > /dev/null 2>&1
  BASE=(recipe=qwen35_35b_4l_grpo_vllm data.path=/tmp/syn.jsonl data.follow=false rl.max_lag=null training.steps=12 logging.color=false checkpoint.enable=false)
  # no publication on GPU 1 while GPU 0 trains with an update every step into an engine beside it (IPC)
  CUDA_VISIBLE_DEVICES=1 timeout 260 $PY -m framework.cli train "${BASE[@]}" output_dir=/tmp/tp/none publish.interval=0 \
    > /tmp/tp_none.log 2>&1 &
  tn=$!
  CUDA_VISIBLE_DEVICES=0 timeout 260 $PY -m framework.cli train "${BASE[@]}" output_dir=/tmp/tp/every publish.dir=/tmp/tp/w \
    > /tmp/tp_every.log 2>&1 &
  tp=$!
  CUDA_VISIBLE_DEVICES=0 timeout 260 $PY examples/rl_loop/vllm_generator.py --weights /tmp/tp/w --serve --memory 0.2 \
    --log "$OUT/tp_engine_updates.jsonl" > /tmp/tp_gen.log 2>&1
  wait $tp $tn
  throughput_table > "$OUT/throughput.table"
  cat "$OUT/throughput.table"
  errors /tmp/tp_none.log /tmp/tp_every.log /tmp/tp_gen.log > "$OUT/tp_errors.log"
  # the Qwen3.5 engine case and the LoRA adapters case of tests/gpu/test_vllm_gpu.py
  timeout ${TTEST:-240} $PY -m pytest -q -s -p no:cacheprovider --basetemp=/tmp/pt3 tests/gpu/test_vllm_gpu.py \
    -k "qwen35 or lora" 2>&1 | grep -v INFO | tee "$OUT/gpu_test3.log" | grep -E "passed|failed|logprob diff" | tail -6
  errors /tmp/pt3/*/engine_*.log /tmp/pt3/*/train.log > "$OUT/engine_errors3.log"
  ;;
4)
  # the kernel cache for the Qwen3.5 loop's shapes (apiary warmup: packaged rollouts, no engine; a fresh machine's
  # first step otherwise autotunes fla's kernels for minutes while the engine waits), beside the LoRA loop
  (timeout 400 $PY -m toolkit.cli warmup recipe=qwen35_debug_grpo_vllm > "$OUT/warmup_qwen35.log" 2>&1) &
  w=$!
  CUDA_VISIBLE_DEVICES=0 $PY - <<'PY' > "$OUT/lora_base.log" 2>&1
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import weight_sync_bench as w
m, wr = w.build("debug_grpo_vllm", [])
w.write_folder(m, wr, Path("/tmp/lbase"), 0)
PY
  OUT=/tmp/rll STEPS=${STEPS:-10} TLIMIT=${TLIMIT:-240} PY=$PY bash benchmarks/rl_loop_vllm.sh \
    "lora=adapter=lora,model.hf_checkpoint=/tmp/lbase/step-0,publish.transport=hf_folder,optimizer.lr=2e-2" \
    > "$OUT/rl_lora.log" 2>&1
  cp /tmp/rll/lora/engine_updates.jsonl "$OUT/lora_engine_updates.jsonl" 2>/dev/null
  cp /tmp/rll/lora/run/metrics.jsonl "$OUT/metrics_lora.jsonl" 2>/dev/null
  tail -3 "$OUT/rl_lora.log"
  wait $w; tail -4 "$OUT/warmup_qwen35.log"
  errors /tmp/rll/*/*.log > "$OUT/rl_errors.log"
  ;;
7)
  # the tiny Qwen3.5 MoE loop, learning then with routing replay (after PART=4's warmup on the same machine)
  sed 's/recipe=debug_grpo_vllm/recipe=qwen35_debug_grpo_vllm/' benchmarks/rl_loop_vllm.sh > /tmp/rl35.sh
  OUT=/tmp/rl35 STEPS=${STEPS:-10} TLIMIT=${TLIMIT:-250} PY=$PY bash /tmp/rl35.sh "learn=" "replay=moe.routing_replay=true:--routing" \
    > "$OUT/rl_qwen35.log" 2>&1
  tail -5 "$OUT/rl_qwen35.log"
  for n in learn replay; do
    cp /tmp/rl35/$n/run/metrics.jsonl "$OUT/metrics_$n.jsonl" 2>/dev/null
    grep -vE "^W[0-9]{4} |FutureWarning|_set_allocator" /tmp/rl35/$n/train.log 2>/dev/null | tail -c 6000 > "$OUT/train_$n.log"
    grep -E "vllm_generator|Error" /tmp/rl35/$n/generator.log 2>/dev/null | tail -c 4000 > "$OUT/generator_$n.log"
  done
  errors /tmp/rl35/*/generator.log /tmp/rl35/*/train.log > "$OUT/rl_errors.log"
  ;;
6)
  # one pytest per case, each with its own limit, so a case cut by its limit leaves the other's summary; the
  # tails of every log the cases wrote come back (a failure's cause is in them)
  for k in qwen35 lora; do
    timeout ${TTEST:-300} $PY -m pytest -q -s -rfE --tb=short -p no:cacheprovider --basetemp=/tmp/pt3_$k \
      tests/gpu/test_vllm_gpu.py -k $k 2>&1 | grep -v INFO | tee "$OUT/gpu_test_$k.log" \
      | grep -E "passed|failed|logprob diff|Error" | tail -6
    mkdir -p "$OUT/logs_$k"
    for f in /tmp/pt3_$k/*/*.log; do [ -f "$f" ] && tail -c 4000 "$f" > "$OUT/logs_$k/$(basename "$(dirname "$f")")_$(basename "$f")"; done
  done
  ;;
5)
  SEQ=${SEQ:-4096}
  $PY benchmarks/synthetic_rollouts.py --count 64 --tokens $SEQ --out /tmp/syn.jsonl > /dev/null 2>&1
  BASE=(recipe=qwen35_35b_4l_grpo_vllm data.path=/tmp/syn.jsonl data.follow=false rl.max_lag=null training.steps=12 logging.color=false
        checkpoint.enable=false training.seq_len=$SEQ training.kernel_cache=/tmp/kc5 ${BASE_OV:-})
  [ "${NONE:-1}" = 0 ] || timeout ${TNONE:-150} $PY -m framework.cli train "${BASE[@]}" output_dir=/tmp/tp/none publish.interval=0 > /tmp/tp_none.log 2>&1
  cp /tmp/tp/none/metrics.jsonl "$OUT/metrics_none.jsonl" 2>/dev/null
  timeout ${TEVERY:-230} $PY -m framework.cli train "${BASE[@]}" output_dir=/tmp/tp/every publish.dir=/tmp/tp/w \
    publish.bucket_mb=${BUCKET_MB:-4096} ${EVERY_OV:-} > /tmp/tp_every.log 2>&1 &
  tp=$!
  timeout ${TEVERY:-230} $PY examples/rl_loop/vllm_generator.py --weights /tmp/tp/w --serve --memory 0.2 \
    --log "$OUT/tp_engine_updates.jsonl" > /tmp/tp_gen.log 2>&1
  wait $tp
  cp /tmp/tp/every/metrics.jsonl "$OUT/metrics_every.jsonl" 2>/dev/null
  throughput_table > "$OUT/throughput.table"
  cat "$OUT/throughput.table"
  errors /tmp/tp_none.log /tmp/tp_every.log /tmp/tp_gen.log > "$OUT/tp_errors.log"
  tail -3 /tmp/tp_every.log /tmp/tp_gen.log
  ;;
10)
  for f in tests/gpu/test_*.py; do
    [ "$f" = tests/gpu/test_vllm_gpu.py ] && continue
    echo "== $f: $(timeout ${TTEST:-240} $PY -m pytest -q -rfE --tb=line -p no:cacheprovider "$f" 2>&1 | grep -E "passed|failed|skipped|error" | tail -3 | tr '\n' ' ')"
  done | tee "$OUT/gpu_tests.txt"
  ;;
11)
  sed 's/recipe=debug_grpo_vllm/recipe=qwen35_debug_grpo_vllm/' benchmarks/rl_loop_vllm.sh > /tmp/rl35.sh
  (OUT=/tmp/rl35 KC=/tmp/kc35 STEPS=${STEPS:-6} TLIMIT=${TLIMIT:-450} PY=$PY bash /tmp/rl35.sh \
    "flat=optimizer.lr=0,moe.load_balance_coeff=null" > "$OUT/rl_qwen35_flat.log" 2>&1) &
  w=$!
  pids=()
  for f in tests/gpu/test_*.py; do
    [ "$f" = tests/gpu/test_vllm_gpu.py ] && continue
    (timeout ${TTEST:-480} $PY -m pytest -q -rfE --tb=short -p no:cacheprovider "$f" > "/tmp/gt_$(basename "$f" .py).log" 2>&1) &
    pids+=($!)
  done
  timeout ${TTEST:-480} $PY -m pytest -q -s -rfE --tb=short -p no:cacheprovider --basetemp=/tmp/pt11 tests/gpu/test_vllm_gpu.py \
    -k "(debug_grpo_vllm and ipc and not qwen35) or lora" 2>&1 | grep -v INFO > /tmp/gt_test_vllm_gpu.log
  wait "${pids[@]}"
  for f in /tmp/gt_*.log; do
    echo "== $f: $(grep -E "passed|failed|skipped|error" "$f" | tail -1)"
    grep -qE "failed|error" "$f" && tail -c 3000 "$f"
  done > "$OUT/gpu_tests.txt"
  for f in /tmp/pt11/*/*.log; do [ -f "$f" ] && { echo "== $f"; tail -c 2000 "$f"; }; done > "$OUT/logs_vllm_tests.txt"
  cat "$OUT/gpu_tests.txt" | grep "^=="
  wait $w; tail -4 "$OUT/rl_qwen35_flat.log"
  cp /tmp/rl35/flat/run/metrics.jsonl "$OUT/metrics_flat.jsonl" 2>/dev/null
  grep -vE "^W[0-9]{4} |FutureWarning|_set_allocator" /tmp/rl35/flat/train.log 2>/dev/null | tail -c 6000 > "$OUT/train_flat.log"
  $PY -m toolkit.cli logprobs /tmp/rl35/flat/weights/step-0 /tmp/rl35/flat/rollouts/000000.jsonl --out /tmp/lp35 \
    > "$OUT/logprobs.log" 2>&1
  logprob_diff /tmp/lp35/000000.jsonl >> "$OUT/logprobs.log" 2>&1
  tail -2 "$OUT/logprobs.log"
  ;;
12)
  [ "${LORA:-1}" = 0 ] || timeout ${TTEST:-330} $PY -m pytest -q -s -rfE --tb=short -p no:cacheprovider --basetemp=/tmp/pt12 tests/gpu/test_vllm_gpu.py \
    -k lora 2>&1 | grep -v INFO | tail -c 4000 > "$OUT/gpu_test_lora.log"
  tail -3 "$OUT/gpu_test_lora.log"
  d=/tmp/lp12; rm -rf $d; mkdir -p $d
  timeout ${TLIMIT:-450} $PY -m framework.cli train recipe=qwen35_debug_grpo_vllm output_dir=$d/run data.path=$d/rollouts \
    publish.dir=$d/weights training.steps=2 logging.color=false > $d/train.log 2>&1 &
  tp=$!
  timeout ${TLIMIT:-450} $PY examples/rl_loop/vllm_generator.py --weights $d/weights --out $d/rollouts --memory 0.3 --shards 1 \
    > $d/generator.log 2>&1
  echo "generator exit $?; $(grep -c . $d/rollouts/000000.jsonl 2>/dev/null) records in the first shard"
  kill $tp 2>/dev/null; wait $tp 2>/dev/null
  grep -E "vllm_generator|Error" $d/generator.log | tail -c 2000 > "$OUT/generator_lp.log"
  $PY -m toolkit.cli logprobs $d/weights/step-0 $d/rollouts/000000.jsonl --out /tmp/lp35 > "$OUT/logprobs.log" 2>&1
  logprob_diff /tmp/lp35/000000.jsonl >> "$OUT/logprobs.log" 2>&1
  tail -2 "$OUT/logprobs.log"
  ;;
8|9)
  # the tiny Qwen3.5 MoE loop (learning for 8, routing replay for 9) beside a GPU test
  sed 's/recipe=debug_grpo_vllm/recipe=qwen35_debug_grpo_vllm/' benchmarks/rl_loop_vllm.sh > /tmp/rl35.sh
  spec="learn="; [ "$PART" = 9 ] && spec="replay=moe.routing_replay=true:--routing"
  (OUT=/tmp/rl35 KC=/tmp/kc35 STEPS=${STEPS:-10} TLIMIT=${TLIMIT:-400} PY=$PY bash /tmp/rl35.sh "$spec" > "$OUT/rl_qwen35.log" 2>&1) &
  w=$!
  if [ "$PART" = 8 ]; then
    timeout ${TTEST:-240} $PY -m pytest -q -s -rfE --tb=short -p no:cacheprovider --basetemp=/tmp/pt8 \
      tests/gpu/test_vllm_gpu.py -k "debug_grpo_vllm and ipc" 2>&1 | grep -v INFO | tail -c 5000 > "$OUT/gpu_test_qwen3_ipc.log"
  else
    timeout ${TTEST:-330} $PY -m pytest -q -s -rfE --tb=short -p no:cacheprovider --basetemp=/tmp/pt9 \
      tests/gpu/test_vllm_gpu.py -k qwen35 2>&1 | grep -v INFO | tail -c 6000 > "$OUT/gpu_test_qwen35.log"
    for f in /tmp/pt9/*/*.log; do [ -f "$f" ] && { echo "== $f"; tail -c 4000 "$f"; }; done > "$OUT/logs_qwen35.txt"
  fi
  tail -3 "$OUT"/gpu_test_*.log
  wait $w; tail -4 "$OUT/rl_qwen35.log"
  n=${spec%%=*}
  cp /tmp/rl35/$n/run/metrics.jsonl "$OUT/metrics_$n.jsonl" 2>/dev/null
  cp /tmp/rl35/$n/engine_updates.jsonl "$OUT/engine_updates_$n.jsonl" 2>/dev/null
  grep -vE "^W[0-9]{4} |FutureWarning|_set_allocator" /tmp/rl35/$n/train.log 2>/dev/null | tail -c 6000 > "$OUT/train_$n.log"
  grep -E "vllm_generator|Error|rror:" /tmp/rl35/$n/generator.log 2>/dev/null | tail -c 4000 > "$OUT/generator_$n.log"
  ;;
esac
