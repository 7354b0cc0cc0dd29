"""Start-up time of the command-line tools, each command in fresh processes.

    python benchmarks/startup_bench.py [--runs 5] [--only NAME ...] [--json FILE]
    python benchmarks/startup_bench.py --vs OTHER_CHECKOUT [--vs-python PYTHON]   # paired A/B

Each command runs once to warm the file cache, then ``--runs`` times; the table has the median and
the minimum wall time (process start to exit, output discarded), the target and whether the median
meets it. Commands run as ``python -m toolkit.cli ...`` / ``python -m framework.cli ...`` from the
checkout's root with PYTHONPATH pointing at it, so ``--vs DIR`` measures another checkout of the
repository (e.g. a ``git worktree add /tmp/base HEAD``) with the same interpreter (or
``--vs-python``): the two variants alternate run by run (A, B, A, B, ...), so a change of load on the
machine hits both alike. A command that exits non-zero stops the benchmark (its output is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]

# (name, argv after `python -m`, target median in seconds)
COMMANDS = (
    ("apiary --help", ["toolkit.cli", "--help"], 1.5),
    ("apiary ls", ["toolkit.cli", "ls"], 1.5),
    ("apiary show debug_moe", ["toolkit.cli", "show", "debug_moe"], 1.5),
    ("apiary show grpo", ["toolkit.cli", "show", "grpo"], 1.5),
    ("train --help", ["framework.cli", "--help"], 1.5),
    ("train recipe=debug_moe --cfg job", ["framework.cli", "recipe=debug_moe", "--cfg", "job"], 3.0),
    ("train recipe=qwen35_35b_128k parallel.cp=8 --cfg job",
     ["framework.cli", "recipe=qwen35_35b_128k", "parallel.cp=8", "--cfg", "job"], 3.0),
)


def run_once(python: str, checkout: Path, argv: list[str]) -> float:
    """Seconds from starting ``python -m argv`` in ``checkout`` to its exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(checkout)
    t0 = time.perf_counter()
    p = subprocess.run([python, "-m", *argv], cwd=checkout, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{checkout}: python -m {' '.join(argv)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return dt


def measure(variants: list[tuple[str, Path]], argv: list[str], runs: int) -> list[list[float]]:
    """Per variant, ``runs`` timings after one warm-up run each; variants alternate run by run."""
    for python, checkout in variants:
        run_once(python, checkout, argv)
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(runs):
        for i, (python, checkout) in enumerate(variants):
            times[i].append(run_once(python, checkout, argv))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per command and variant (default 5)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="commands whose name contains one of these")
    ap.add_argument("--python", default=sys.executable, help="interpreter for this checkout (default: this one)")
    ap.add_argument("--vs", type=Path, metavar="CHECKOUT", help="another checkout of the repository to compare with")
    ap.add_argument("--vs-python", metavar="PYTHON", help="interpreter for --vs (default: --python)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write every timing to FILE")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    if a.vs is not None and not (a.vs / "toolkit" / "cli.py").is_file():
        ap.error(f"--vs {a.vs}: not a checkout of this repository (no toolkit/cli.py)")
    cmds = [c for c in COMMANDS if not a.only or any(o in c[0] for o in a.only)]
    if not cmds:
        ap.error(f"--only {' '.join(a.only)} matches none of: {', '.join(c[0] for c in COMMANDS)}")
    variants = [(a.python, ROOT)] + ([(a.vs_python or a.python, a.vs.resolve())] if a.vs else [])
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    table = Table(title=f"start-up, {a.runs} runs each after 1 warm-up, fresh processes"
                  + (f"; A = {ROOT}, B = {a.vs} (alternating)" if a.vs else f" ({ROOT})"))
    table.add_column("command")
    for label in (["A median s", "A min s", "B median s", "B min s", "B / A"] if a.vs else ["median s", "min s"]):
        table.add_column(label, justify="right")
    table.add_column("target s", justify="right")
    table.add_column("A meets it" if a.vs else "meets it")
    record = {"runs": a.runs, "python": a.python, "checkout": str(ROOT), "vs": str(a.vs) if a.vs else None,
              "load_avg": os.getloadavg(), "commands": {}}
    for name, cmd, target in cmds:
        times = measure(variants, cmd, a.runs)
        med = [statistics.median(t) for t in times]
        cells = [f"{med[0]:.2f}", f"{min(times[0]):.2f}"]
        if a.vs:
            cells += [f"{med[1]:.2f}", f"{min(times[1]):.2f}", f"{med[1] / med[0]:.1f}x"]
        ok = med[0] < target
        table.add_row(name, *cells, f"{target:g}", "[green]pass[/green]" if ok else "[red]fail[/red]")
        record["commands"][name] = {"argv": cmd, "target_s": target, "times_s": times, "median_s": med}
    record["load_avg_after"] = os.getloadavg()
    console.print(table)
    if a.json:
        a.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
