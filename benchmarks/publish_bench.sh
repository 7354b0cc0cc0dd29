#!/usr/bin/env bash
# Weight publication's cost on a training run (docs/skills/publish.md): the 4-layer Qwen3.5-35B-A3B at
# full width on one GPU (benchmarks/loss_e2e_bench.sh's setup), SEQ tokens per step, publishing every
# INTERVAL steps in bfloat16, against the same run without publication.
#   OUT=/some/dir SEQ=32768 STEPS=10 INTERVAL=3 bash benchmarks/publish_bench.sh
# Runs: nopub | fg (publish.background=false: the write blocks) | auto (background above 1B params).
# INTERVAL2 (default 20) adds auto20: the same with publications far enough apart for the background
# write to land before the next one (then only the gather blocks).
# The table: median tok/s over steps >= SKIP and, per run, the publications' blocked and write
# seconds (median / max over the run's publications, the initial one included) next to the median
# step time. The weights folders are deleted after each run (disk).
set -uo pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
INTERVAL=${INTERVAL:-3}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
PUB="publish.interval=$INTERVAL,publish.dtype=bfloat16,publish.keep=1"
export EXTRA="${EXTRA:-} moe.load_balance_coeff=null"
for spec in "nopub=loss=linear_ce" "fg=loss=linear_ce,$PUB,publish.background=false" \
            "auto=loss=linear_ce,$PUB,publish.background=auto" \
            "auto20=loss=linear_ce,publish.interval=${INTERVAL2:-20},publish.dtype=bfloat16,publish.keep=1"; do
  bash benchmarks/loss_e2e_bench.sh "$spec" | grep -v '^$' | tail -n +1 > "$OUT/pub_${spec%%=*}.table"
  du -sh "$OUT/e2e_${spec%%=*}/weights" 2>/dev/null | sed 's/^/weights folder: /' >> "$OUT/pub_${spec%%=*}.table"
  rm -rf "$OUT/e2e_${spec%%=*}/weights"
done
"$PY" - "$OUT" "${SKIP:-4}" <<'PY'
import json, re, statistics, sys
from pathlib import Path
out, skip = Path(sys.argv[1]), int(sys.argv[2])
print(f"\n{'run':6s} {'tok/s':>9s} {'s/step':>8s} {'peak GiB':>9s} {'pubs':>5s} {'blocked med/max s':>18s} "
      f"{'waited med s':>13s} {'gather med s':>13s} {'write med/max s':>16s} {'blocked/step':>13s}")
for name in ("nopub", "fg", "auto", "auto20"):
    f = out / f"e2e_{name}" / "metrics.jsonl"
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.is_file() else []
    log = (out / f"e2e_{name}.log").read_text(errors="replace") if (out / f"e2e_{name}.log").is_file() else ""
    pubs = [tuple(map(float, m)) for m in re.findall(
        r"published weights step-\d+ .*?\(blocked ([\d.]+) s: waited ([\d.]+) s for the previous write, "
        r"gathered in ([\d.]+) s; written in ([\d.]+) s", log)]
    if not recs:
        print(f"{name:6s} no metrics (see {out}/e2e_{name}.log)")
        continue
    steady = [r for r in recs if r["step"] >= skip] or recs
    st = statistics.median(r["step_time_s"] for r in steady)
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    peak = max(r.get("peak_mem_bytes", 0) for r in recs) / 2**30
    if pubs:
        b, wa, g, w = ([p[i] for p in pubs] for i in range(4))
        cols = (f"{statistics.median(b):8.2f}/{max(b):<9.2f} {statistics.median(wa):13.2f} {statistics.median(g):13.2f} "
                f"{statistics.median(w):7.2f}/{max(w):<8.2f} {statistics.median(b) / st:12.1%}")
    else:
        cols = f"{'-':>18s} {'-':>13s} {'-':>13s} {'-':>16s} {'-':>13s}"
    print(f"{name:6s} {tps:9.0f} {st:8.3f} {peak:9.2f} {len(pubs):5d} {cols}")
PY
