#!/usr/bin/env bash
# The first step of Qwen3-30B-A3B (4 layers, 16K tokens, one GPU) under several precisions,
# module by module (benchmarks/precision_probe.py). Into $OUT: probe_compare.txt (the tables against
# bf16), probe_logs.txt (each variant's log tail), probe_pt.tgz (the recorded variants).
#   OUT=DIR bash benchmarks/precision_probe.sh VARIANT...
# variants: bf16 te te_nofp8 te_reseed bf16_teimport ao ao_rowwise bf16_c ao_c ao_c_dense
# (bf16, te and te_reseed log the RNG states of the build: PROBE_RNG)
set -uo pipefail
OUT=${OUT:-bench_out}; WORK=${WORK:-/tmp/precision_probe}; mkdir -p "$OUT" "$WORK/probe"
export PYTHONUNBUFFERED=1
QWEN3=(recipe=qwen3_30b_a3b_64k model.n_layers=4 training.seq_len=16384 parallel.cp=1 data.name=packaged
       data.tokenizer=byte training.steps=1 logging.tensorboard=false lr.warmup_steps=2 model.flex_autotune=false
       checkpoint.enable=false)
TE=(precision=fp8 precision.backend=te precision.experts=false)
for v in "$@"; do
  case $v in
    bf16) env=(PROBE_RNG=1); args=() ;;
    te) env=(PROBE_RNG=1); args=("${TE[@]}") ;;
    te_reseed) env=(PROBE_RNG=1 PROBE_RESEED=1); args=("${TE[@]}") ;;
    te_nofp8) env=(PROBE_TE_NOFP8=1); args=("${TE[@]}") ;;
    bf16_teimport) env=(PROBE_IMPORT_TE=1); args=() ;;
    ao) env=(); args=(precision=fp8) ;;
    ao_rowwise) env=(); args=(precision=fp8 precision.scaling=rowwise) ;;
    bf16_c) env=(PROBE_HOOKS=blocks); args=(precision.compile=true) ;;
    ao_c) env=(PROBE_HOOKS=blocks); args=(precision=fp8 precision.compile=true) ;;
    ao_c_dense) env=(PROBE_HOOKS=blocks); args=(precision=fp8 precision.compile=true precision.experts=false) ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  start=$(date +%s)
  env "${env[@]}" timeout 300 python3 benchmarks/precision_probe.py "$WORK/probe" "$v" "${QWEN3[@]}" "${args[@]}" \
    > "$WORK/$v.log" 2>&1
  echo "$v: rc $? in $(( $(date +%s) - start )) s: $(grep -E "^$v: " "$WORK/$v.log" | tr '\n' ' ')"
  grep -q Traceback "$WORK/$v.log" && grep -A30 Traceback "$WORK/$v.log" | tail -n 12
  { echo "== $v"; tail -n 40 "$WORK/$v.log"; } >> "$OUT/probe_logs.txt"
done
have=(); for v in "$@"; do [ -f "$WORK/probe/$v.pt" ] && [ "$v" != bf16 ] && have+=("$v"); done
[ -f "$WORK/probe/bf16.pt" ] && [ ${#have[@]} -gt 0 ] && \
  python3 benchmarks/precision_probe.py --compare "$WORK/probe" bf16 "${have[@]}" >> "$OUT/probe_compare.txt" 2>&1
rm -rf "$WORK"/probe/*/  # run folders
tar -czf "$OUT/probe_pt.tgz" -C "$WORK/probe" .
exit 0
