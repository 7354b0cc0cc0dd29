#!/usr/bin/env bash
# The live GRPO loop with vLLM generating and weights handed over in memory, on one GPU (docs/rl.md):
# train recipe=debug_grpo_vllm beside examples/rl_loop/vllm_generator.py, as docs/rl.md writes them.
#   OUT=/some/dir STEPS=20 [KC=/some/kernel_cache] bash benchmarks/rl_loop_vllm.sh [RUN ...]
# KC: training.kernel_cache for every run (runs after the first read its autotuning results).
# RUN: NAME=TRAIN_OVERRIDES[:GENERATOR_FLAGS], default: learn (lr 1e-2), flat (optimizer.lr=0 and no routing-bias
# updates: moe.load_balance_coeff=null, which otherwise still moves the policy at lr 0),
# replay (moe.routing_replay=true with --routing). The table per run: mean reward of the first
# and last shards, the trainer's policy/mismatch_abs_mean and _max at lag 0 (median over steps), and the
# engine's update times (blocked, engine paused).
set -uo pipefail
OUT=${OUT:-bench_out/rl_vllm}; mkdir -p "$OUT"; STEPS=${STEPS:-20}
PY=${PY:-python3}
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=("learn=" "flat=optimizer.lr=0,moe.load_balance_coeff=null" "replay=moe.routing_replay=true:--routing")
for spec in "${RUNS[@]}"; do
  name=${spec%%=*}; rest=${spec#*=}; ov=${rest%%:*}; gflags=""; [[ "$rest" == *:* ]] && gflags=${rest#*:}
  d="$OUT/$name"; rm -rf "$d"; mkdir -p "$d"
  IFS=',' read -r -a ova <<< "$ov"
  timeout ${TLIMIT:-400} $PY -m framework.cli train recipe=debug_grpo_vllm output_dir="$d/run" data.path="$d/rollouts" \
    publish.dir="$d/weights" training.steps="$STEPS" logging.color=false ${KC:+training.kernel_cache=$KC} "${ova[@]}" \
    > "$d/train.log" 2>&1 &
  tp=$!
  timeout ${TLIMIT:-400} $PY examples/rl_loop/vllm_generator.py --weights "$d/weights" --out "$d/rollouts" --memory 0.3 \
    --log "$d/engine_updates.jsonl" $gflags > "$d/generator.log" 2>&1 &
  gp=$!
  wait $tp; echo "$name: trainer exit $?"
  # an engine linked to the trainer stops when the trainer closes the link; a LoRA run's engine (no link) is
  # stopped here once the trainer is done
  for _ in $(seq 60); do kill -0 $gp 2>/dev/null || break; sleep 1; done; kill $gp 2>/dev/null
  wait $gp; echo "$name: generator exit $?"
done
$PY - "$OUT" "${RUNS[@]}" <<'PY'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"\n{'run':8s} {'shards':>6s} {'reward first':>12s} {'reward last':>11s} {'mismatch mean':>14s} {'mismatch max':>13s} "
      f"{'blocked s':>10s} {'engine s':>9s} {'updates':>8s}")
for spec in sys.argv[2:]:
    name = spec.split("=", 1)[0]; d = out / name
    gen = (d / "generator.log").read_text(errors="replace") if (d / "generator.log").is_file() else ""
    rewards = [float(x) for x in re.findall(r"mean reward ([\d.]+)", gen)]
    m = d / "run" / "metrics.jsonl"
    recs = [json.loads(l) for l in m.read_text().splitlines() if l.strip()] if m.is_file() else []
    mm = [r["policy/mismatch_abs_mean"] for r in recs if "policy/mismatch_abs_mean" in r]
    mx = [r["policy/mismatch_abs_max"] for r in recs if "policy/mismatch_abs_max" in r]
    bl = [r["publish/blocked_s"] for r in recs if "publish/blocked_s" in r]
    en = [r["publish/engine_s"] for r in recs if "publish/engine_s" in r]
    up = d / "engine_updates.jsonl"  # the generator's own log: a LoRA run's adapter loads (no link, no publish/engine_s)
    if not en and up.is_file():
        en = [u["paused_s"] for u in map(json.loads, up.read_text().splitlines()) if u.get("version", 0) > 0]
    med = lambda v: f"{statistics.median(v):.3g}" if v else "-"
    first = f"{statistics.mean(rewards[:3]):.3f}" if rewards else "-"
    last = f"{statistics.mean(rewards[-3:]):.3f}" if rewards else "-"
    print(f"{name:8s} {len(rewards):6d} {first:>12s} {last:>11s} {med(mm):>14s} {med(mx):>13s} {med(bl):>10s} "
          f"{med(en):>9s} {len(en):8d}")
PY
