#!/usr/bin/env bash
# Where a step of many short rollouts per row spends its time and memory, next to the SFT step at the
# same tokens (issue 33 item 4): benchmarks/step_profile.py on the 4-layer Qwen3.5-35B-A3B at full width,
# one row of SEQ tokens per step, one GPU, a shared kernel cache.
#   OUT=/some/dir SEQ=32768 bash benchmarks/short_rollouts_profile.sh [NAME=OVERRIDES ...]
# default runs: sft (the recipe's loss on text) and grpo_short (loss=grpo on the packaged rollouts).
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
SEQ=${SEQ:-32768}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=("sft=data.format=text" "grpo_short=loss=grpo,data.format=rollouts")
BASE=(recompute="${RECOMPUTE:-full}" model.n_layers="${LAYERS:-4}" training.seq_len="$SEQ" training.local_batch=1 parallel.cp=1 parallel.ep=1
      parallel.dp_shard=1 data.name=packaged data.tokenizer=byte checkpoint.enable=false launcher.nproc=1
      training.kernel_cache="$OUT/kc" logging.color=false ${EXTRA:-})
for spec in "${RUNS[@]}"; do
  name=${spec%%=*}; IFS=',' read -r -a ov <<< "${spec#*=}"
  t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "${LIMIT:-300}" "$PY" benchmarks/step_profile.py --out "$OUT/$name" \
    ${PROFILE_ARGS:-} "${RECIPE:-qwen35_35b_128k}" "${BASE[@]}" "${ov[@]}" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s"
  head -45 "$OUT/$name/profile.txt" 2>/dev/null || tail -20 "$OUT/$name.log"
done
