"""The planner's step time against measured steps: every point below was measured on H200s (one GPU or
two), each with its source; the planner plans the same settings and the table prints planned against
measured. Exits 1 when a held point is off by more than ``--limit`` (20%).

    python benchmarks/step_time_check.py [--limit 0.2] [--json FILE]

CPU only (the planner, no GPU). A point's settings are the measured run's: the recipe, its overrides
(the benchmark scripts' base settings: one sequence per step, the packaged corpus with the byte
tokenizer) and the GPU count; the GPU is an H200 with the memory torch reported (139.8 GiB), so
recompute=auto chooses as the run did. A recompute=auto point also names the blocks the run kept (its
layout.json); a plan that chooses others is a failure (the settings would not be the measured ones).
Measured seconds: the median step of the run (the tables' ``s/step``; ``step_time_s`` of steps 2 on in
metrics.jsonl); a two-GPU step is ``seq / (2 x tok/s per GPU)``. ``recorded`` reads a point's number back
from its source file (tests/test_step_time_check.py holds the table to the files).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = "docs/bench_data"
H200_BYTES = 150_109_880_320  # what torch reports for one H200 (the runs' plan_gpu_memory_bytes)
LIMIT = 0.20
RECIPE = "qwen35_35b_128k"
# the benchmark scripts' base settings (benchmarks/loss_e2e_bench.sh): the 4-layer model at full width
ONE_GPU = ("model.n_layers=4", "training.local_batch=1", "parallel.cp=1", "parallel.ep=1", "parallel.dp_shard=1",
           "data.name=packaged", "data.tokenizer=byte")
TWO_GPU = ("training.local_batch=1", "parallel.cp=2", "parallel.ep=2", "parallel.dp_shard=1",
           "data.name=packaged", "data.tokenizer=byte")
TWO_GPU_SITTING = "two-H200 sitting of 2026-11-28 (train nproc=2; raw records not checked in)"


def seq(n: int) -> str:
    return f"training.seq_len={n}"


def blocks(attention: dict, linear_attention: dict) -> dict:
    return {"attention": attention, "linear_attention": linear_attention}


ALL_KEPT = blocks({"kept": 1}, {"kept": 3})


@dataclass(frozen=True)
class Point:
    name: str
    overrides: tuple[str, ...]
    measured_s: float
    source: str  # a docs/bench_data file (and the run's name in it), or the sitting
    run: str = ""  # the run's name in the source table (metrics.jsonl: none)
    gpus: int = 1
    recipe: str = RECIPE
    choice: dict | None = None  # recompute=auto's per-block choice the run made
    held: bool = True  # False: shown, not held to the limit (why: note)
    note: str = ""
    extra: dict = field(default_factory=dict)


def _one(*ov: str) -> tuple[str, ...]:
    return ONE_GPU + ov


POINTS = [
    # 2026-11-29, one H200: recompute at 128K (metrics.jsonl, layout.json)
    Point("128K full", _one(seq(131072), "recompute=full"), 2.252, f"{DATA}/h200_20261129/recompute_128k/full/metrics.jsonl"),
    Point("128K auto", _one(seq(131072), "recompute=auto"), 2.200, f"{DATA}/h200_20261129/recompute_128k/auto/metrics.jsonl",
          choice=blocks({"kept": 1}, {"recomputed": 3})),
    Point("128K selective", _one(seq(131072), "recompute=selective"), 2.209,
          f"{DATA}/h200_20261129/recompute_128k/selective/metrics.jsonl"),
    # 2026-11-28, one H200, machine E (the defaults' verification sitting)
    Point("32K full", _one(seq(32768), "recompute=full"), 0.642, f"{DATA}/h200_20261128/s5_32k.txt", "full"),
    Point("32K auto", _one(seq(32768), "recompute=auto"), 0.555, f"{DATA}/h200_20261128/s5_32k.txt", "auto", choice=ALL_KEPT),
    Point("32K selective", _one(seq(32768), "recompute=selective"), 0.642, f"{DATA}/h200_20261128/s5_32k.txt", "selective"),
    Point("32K none", _one(seq(32768), "recompute=none"), 0.551, f"{DATA}/h200_20261128/s5_32k.txt", "none"),
    Point("64K full", _one(seq(65536), "recompute=full"), 1.168, f"{DATA}/h200_20261128/s5_64k.txt", "full64"),
    Point("64K auto", _one(seq(65536), "recompute=auto"), 1.078, f"{DATA}/h200_20261128/s5_64k.txt", "auto64",
          choice=blocks({"kept": 1}, {"kept": 2, "recomputed": 1})),
    Point("128K full (E)", _one(seq(131072), "recompute=full"), 2.252, f"{DATA}/h200_20261128/s5_128k.txt", "full128"),
    Point("128K auto (E)", _one(seq(131072), "recompute=auto"), 2.162, f"{DATA}/h200_20261128/s5_128k.txt", "auto128",
          choice=blocks({"kept": 1}, {"recomputed": 3})),
    # 2026-11-28, one H200, machines C and D (defaults; candidates of auto's chain pinned by budget)
    Point("32K full (C)", _one(seq(32768), "recompute=full"), 0.643, f"{DATA}/h200_20261128/s3_lean_32k.txt", "full32"),
    Point("32K none (C)", _one(seq(32768), "recompute=none"), 0.553, f"{DATA}/h200_20261128/s3_lean_32k.txt", "none32"),
    Point("64K full (C)", _one(seq(65536), "recompute=full"), 1.173, f"{DATA}/h200_20261128/s3_lean_64k.txt", "full64"),
    Point("128K full (C)", _one(seq(131072), "recompute=full"), 2.260, f"{DATA}/h200_20261128/s3_lean_128k.txt", "auto128",
          note="auto chose every block full"),
    Point("64K full (D)", _one(seq(65536), "recompute=full"), 1.192, f"{DATA}/h200_20261128/s4_64k.txt", "full64"),
    # 2026-11-27, one H200 (torchtitan's fp32 MoE combine, fixed segments: the code of that day)
    Point("32K full (27d)", _one(seq(32768), "recompute=full"), 0.632, f"{DATA}/h200_20261127d/pa_32k.txt", "full"),
    Point("32K none (27d)", _one(seq(32768), "recompute=none"), 0.550, f"{DATA}/h200_20261127d/pa_32k.txt", "none"),
    Point("64K full (27d)", _one(seq(65536), "recompute=full"), 1.172, f"{DATA}/h200_20261127d/pa_64k.txt", "full64"),
    Point("64K full (27d, pd)", _one(seq(65536), "recompute=full"), 1.155, f"{DATA}/h200_20261127d/pd_64k.txt", "full64"),
    Point("128K full (27d)", _one(seq(131072), "recompute=full"), 2.490, f"{DATA}/h200_20261127d/pa_128k.txt", "auto128",
          note="auto chose every block full"),
    Point("128K full (27c)", _one(seq(131072), "recompute=full"), 2.446, f"{DATA}/h200_20261127c/pa_auto_64k_128k.txt",
          "auto128", note="auto chose every block full"),
    Point("16K full, 6 layers (27d)", ("model.n_layers=6",) + ONE_GPU[1:] + (seq(16384), "recompute=full"), 0.529,
          f"{DATA}/h200_20261127d/pf_6layers_16k.txt", "full6"),
    # two H200s, CP 2 + EP 2, 8 layers at full width (2026-11-28)
    Point("2 GPUs, 8 layers, 128K full", ("model.n_layers=8",) + TWO_GPU + (seq(131072), "recompute=full"),
          131072 / (2 * 27068), TWO_GPU_SITTING, gpus=2, note="27,068 tok/s/GPU"),
    Point("2 GPUs, 8 layers, 256K auto", ("model.n_layers=8",) + TWO_GPU + (seq(262144), "recompute=auto"),
          262144 / (2 * 26393), TWO_GPU_SITTING, gpus=2, note="26,393 tok/s/GPU"),
    Point("2 GPUs, 8 layers, 128K auto", ("model.n_layers=8",) + TWO_GPU + (seq(131072), "recompute=auto"),
          131072 / (2 * 24690), TWO_GPU_SITTING, gpus=2, held=False,
          note="24,690 tok/s/GPU; the allocator retried every step (slower than full recompute's 27,068)"),
    # LoRA (the adapter's time model is not refit: shown, not held)
    Point("32K full (LoRA recipe, adapter=none)",
          _one(seq(32768), "recompute=full", "moe.load_balance_coeff=null", "adapter=none", "~adapter.rank",
               "~adapter.alpha", "~adapter.targets"), 0.635,
          f"{DATA}/h200_20261126_lora/full_metrics.jsonl", recipe="qwen35_35b_lora_128k"),
    Point("32K LoRA rank 16, all targets", _one(seq(32768), "recompute=full", "moe.load_balance_coeff=null"), 0.558,
          "docs/benchmarks.md 'LoRA against full training' (2026-11-26)", recipe="qwen35_35b_lora_128k", held=False,
          note="LoRA's time (per-expert adapter loop, frozen base) is not refit"),
    Point("32K LoRA rank 16, q k v o", _one(seq(32768), "recompute=full", "moe.load_balance_coeff=null",
                                            "adapter.targets=[q,k,v,o]"), 0.292,
          "docs/benchmarks.md 'LoRA against full training' (2026-11-26)", recipe="qwen35_35b_lora_128k", held=False,
          note="LoRA's time is not refit"),
    Point("2 GPUs, 40 layers, LoRA 128K", TWO_GPU + (seq(131072),), 131072 / (2 * 6175), TWO_GPU_SITTING, gpus=2,
          recipe="qwen35_35b_lora_128k", held=False, note="6,175 tok/s/GPU; LoRA's time is not refit"),
]


def recorded(p: Point) -> float | None:
    """The point's measured step from its source file: the ``s/step`` of its run in a table, the median
    ``step_time_s`` of steps 2 on in a metrics.jsonl; None for a source that is not a file here."""
    path = ROOT / p.source
    if not p.source.startswith(DATA) or not path.is_file():
        return None
    if path.suffix == ".jsonl":
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return statistics.median(r["step_time_s"] for r in rows if r.get("step", 0) >= 2 and "step_time_s" in r)
    for line in path.read_text().splitlines():
        cols = line.split()
        if len(cols) >= 6 and cols[0] == p.run:  # run, tok/s, s/step, peak GiB, last loss, steps
            try:
                return float(cols[2])
            except ValueError:
                continue
    return None


def _nonzero(choice: dict | None) -> dict | None:
    if choice is None:
        return None
    return {m: {w: n for w, n in v.items() if n} for m, v in choice.items()}


def plan_point(p: Point):
    """The planner's plan for the point's settings (CPU; seconds)."""
    from framework.plan import planner  # reason: start-up time (the planner imports the registry)
    from framework.resolve.resolver import resolve  # reason: start-up time

    r = resolve(p.recipe, list(p.overrides), world_size=p.gpus, for_training=False)
    return planner.plan(r, gpu="H200", gpu_memory_bytes=H200_BYTES)


def check(points=POINTS, limit: float = LIMIT) -> list[dict]:
    rows = []
    for p in points:
        plan = plan_point(p)
        err = plan.step_time_s / p.measured_s - 1
        chosen = _nonzero(plan.choices.get("recompute_blocks"))
        same_choice = p.choice is None or chosen == _nonzero(p.choice)
        rows.append({"point": p.name, "gpus": p.gpus, "measured_s": p.measured_s, "planned_s": plan.step_time_s,
                     "error": err, "held": p.held, "same_choice": same_choice, "chosen": chosen,
                     "ok": (not p.held) or (abs(err) <= limit and same_choice), "source": p.source,
                     "note": p.note, "time_s": plan.time_s})
    return rows


def table(rows: list[dict], limit: float) -> None:
    from rich.console import Console  # reason: only to print
    from rich.table import Table  # reason: only to print

    t = Table(title=f"planned vs measured step time (H200; planner on CPU); held points within {limit:.0%}")
    for col in ("point", "GPUs", "measured s", "planned s", "error", "held", "source / note"):
        t.add_column(col, justify="right" if col in ("GPUs", "measured s", "planned s", "error") else "left")
    for r in rows:
        err = f"{r['error']:+.1%}" + ("" if r["same_choice"] else " (other choice)")
        mark = "yes" if r["held"] else "no"
        if r["held"] and not r["ok"]:
            err = f"[red]{err}[/red]"
        src = r["source"].replace(f"{DATA}/", "") + (f"; {r['note']}" if r["note"] else "")
        t.add_row(r["point"], str(r["gpus"]), f"{r['measured_s']:.3f}", f"{r['planned_s']:.3f}", err, mark, src)
    Console(width=200).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=float, default=LIMIT, help="largest |planned / measured - 1| of a held point")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ns = ap.parse_args(argv)
    rows = check(POINTS, limit=ns.limit)
    table(rows, ns.limit)
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["ok"]]
    held = [r for r in rows if r["held"]]
    if held:
        worst = max(held, key=lambda r: abs(r["error"]))
        print(f"{len(held)} held points: {min(r['error'] for r in held):+.1%} .. {max(r['error'] for r in held):+.1%} "
              f"(worst {worst['point']}); {len(rows) - len(held)} shown only")
    for r in bad:
        print(f"OFF: {r['point']}: planned {r['planned_s']:.3f} s against {r['measured_s']:.3f} s ({r['error']:+.1%})"
              + ("" if r["same_choice"] else f"; recompute=auto chose {r['chosen']}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
