"""apiary compare's report: the side-by-side tables (rich), compare.md and compare.png.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from toolkit import plot as plots
from toolkit.compare.diffs import rel_diff
from toolkit.compare.tolerance import TOLERANCES


# --------------------------------------------------------------------------- report
def _fmt(x, spec=".4g", none="-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and x == 0.0:
        return "0"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _step_rows(results: list[dict], limit: int = 25) -> list[list[str]]:
    base = results[0]
    steps = sorted({s for r in results for s in r["steps"]})
    if len(steps) > limit:
        k = math.ceil(len(steps) / (limit - 1))
        steps = sorted(set(steps[::k]) | {steps[-1]})
    rows = []
    for s in steps:
        row = [str(s)]
        bl = dict(zip(base["steps"], base["loss"])).get(s)
        for i, r in enumerate(results):
            lv = dict(zip(r["steps"], r["loss"])).get(s)
            row.append(_fmt(lv, ".6f"))
            if i:
                row.append(_fmt(rel_diff(lv, bl), ".2e") if lv is not None and bl is not None else "-")
        rows.append(row)
    return rows


def _summary_rows(result: dict) -> list[list[str]]:
    rs, tol = result["variants"], TOLERANCES[result["tolerance"]["kind"]]
    rows = []

    def add(name, f):
        rows.append([name, *[f(r) for r in rs]])

    add("status", lambda r: r["status"])
    add("steps logged", lambda r: str(len(r["steps"])))
    add("final loss", lambda r: _fmt(r["summary"]["final_loss"], ".6f"))
    add("loss: max rel diff", lambda r: "baseline" if r is rs[0] else _fmt(r.get("diff", {}).get("loss_max_rel"), ".2e"))
    add("grad norm (final)", lambda r: _fmt(r["grad_norm"][-1] if r["grad_norm"] else None, ".4f"))
    add("grad norm: max rel diff",
        lambda r: "baseline" if r is rs[0] else _fmt(r.get("diff", {}).get("grad_norm_max_rel"), ".2e"))
    add("step time s (median, steady)", lambda r: _fmt(r["summary"]["step_time_s"], ".4f"))
    add("tokens/s (median)", lambda r: _fmt(r["summary"]["tokens_per_s"], ",.0f"))
    add("TFLOPs/GPU (median)", lambda r: _fmt(r["summary"]["tflops_per_gpu"], ".3g"))
    short = {"cuda_max_memory_reserved": "CUDA reserved", "cpu_max_rss": "CPU max RSS"}
    add("peak memory GiB", lambda r: _gib(r["summary"]["peak_mem_bytes"]) + (
        f" ({short.get(r['summary']['peak_mem_kind'], r['summary']['peak_mem_kind'])})"
        if r["summary"]["peak_mem_kind"] else ""))
    add("step-0 loss", lambda r: _fmt((r.get("probe") or {}).get("loss"), ".6f",
                                       none=(r.get("probe") or {}).get("error", "-")[:40]))
    add("step-0 loss: abs diff", lambda r: "baseline" if r is rs[0] else _fmt(r.get("diff", {}).get("step0_loss_abs"), ".2e"))
    add("step-0 logits: max abs diff",
        lambda r: "baseline" if r is rs[0] else _fmt(r.get("diff", {}).get("logits_max_abs"), ".2e",
                                                     none="n/a" if r.get("diff", {}).get("logits_note") else "-"))
    add("step-0 logits: rel diff",
        lambda r: "baseline" if r is rs[0] else _fmt(r.get("diff", {}).get("logits_rel"), ".2e",
                                                     none="n/a" if r.get("diff", {}).get("logits_note") else "-"))
    add("step-0 grads: max abs diff", lambda r: "baseline" if r is rs[0] else _fmt(r.get("diff", {}).get("grads_max_abs"), ".2e"))
    add("step-0 grads: rel diff (worst)", lambda r: "baseline" if r is rs[0] else (
        _fmt(r.get("diff", {}).get("grads_rel"), ".2e") + (f" {r['diff']['grads_worst_param']}"
                                                          if r.get("diff", {}).get("grads_worst_param") else "")))

    def verdict(r):
        if r["status"] != "ok":
            return r["status"].upper()
        if r is rs[0]:
            return "baseline"
        if tol.step0 is None:
            return "not checked (any)"
        return "FAIL" if r.get("violations") else f"within {tol.kind}"
    add("verdict", verdict)
    return rows


def _heading(result: dict) -> str:
    t = result["tolerance"]
    return (f"apiary compare {result['key']}: {', '.join(result['values'])} (baseline {result['values'][0]}) "
            f"on {result['recipe']}, world size {'/'.join(map(str, dict.fromkeys(result['world_sizes'])))}; "
            f"tolerance {t['kind']}"
            f" (step-0 {_fmt(t['step0'], 'g', 'unchecked')}, loss curve {_fmt(t['curve'], 'g', 'unchecked')}, "
            f"grad-norm curve {_fmt(t['grad_norm'], 'g', 'unchecked')}): "
            f"{result['kind_reason']}")


def print_table(console: Console, table: Table) -> None:
    """A terminal gets the table at its width (long cells fold onto more lines, never cut). Piped or
    redirected output has no width to fit: the table is printed as wide as its widest row needs, so
    every column and header stays whole (rich would otherwise cut it at 80 columns)."""
    if console.is_terminal:
        console.print(table)
        return
    need = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    Console(file=console.file, width=max(need, console.width), color_system=console.color_system,
            highlight=False, soft_wrap=True).print(table)


def print_report(result: dict, console: Console) -> None:
    rs = result["variants"]
    console.print(_heading(result), markup=False)
    t = Table(title="loss by step (rel diff: vs the baseline)")
    t.add_column("step", justify="right", overflow="fold")
    for i, r in enumerate(rs):
        t.add_column(r["label"], justify="right", overflow="fold")
        if i:
            t.add_column("rel diff", justify="right", overflow="fold")
    for row in _step_rows(rs):
        t.add_row(*map(Text, row))
    print_table(console, t)
    t = Table(title="summary")
    t.add_column("metric", overflow="fold")
    for r in rs:
        t.add_column(r["label"], justify="right", overflow="fold")
    for row in _summary_rows(result):
        t.add_row(*map(Text, row))
    print_table(console, t)
    for r in rs:
        notes = [r.get("diff", {}).get(k) for k in ("logits_note", "grads_note")]
        notes += [n for n in (r.get("probe") or {}).get("notes", []) if not any(n in (m or "") for m in notes)]
        for n in filter(None, notes):
            console.print(f"note ({r['label']}): {n}", markup=False)
        if r["status"] != "ok":
            console.print(Text.assemble((f"{r['label']} {r['status']}", "bold red"),
                                        f" (exit {r['returncode']}); last lines of {r['log']}:"))
            console.print(r.get("log_tail", ""), markup=False)
        elif (r.get("probe") or {}).get("error"):
            console.print(f"note ({r['label']}): the probe failed: {r['probe']['error'].splitlines()[0]}",
                          markup=False)
    c = result["check"]
    if c["failures"]:
        style = "bold red" if c["enabled"] else "yellow"
        console.print(f"[{style}]{'check failed' if c['enabled'] else 'outside tolerance (no --check)'}:"
                      f"[/{style}]")
        for f in c["failures"]:
            console.print(f"  {f['message']}", markup=False)
    elif c["enabled"]:
        console.print(Text.assemble(("check passed", "green"), f": every variant within {result['tolerance']['kind']}."))
    console.print(f"report: {result['compare_dir']}/compare.md, compare.json"
                  + (f", {result['plot']}" if result.get("plot") else ""), markup=False)


def markdown(result: dict) -> str:
    rs = result["variants"]
    lines = [f"# apiary compare: {result['key']} = {', '.join(result['values'])}", "",
             "```", result["command"], "```", "", _heading(result), ""]
    if result.get("plot"):
        lines += [f"![loss and grad norm by step, and each variant minus the baseline]({result['plot']})", ""]
    head = ["step"] + [x for i, r in enumerate(rs) for x in ([r["label"]] + (["rel diff"] if i else []))]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in _step_rows(rs, limit=10**9)]
    lines += ["", "| metric | " + " | ".join(r["label"] for r in rs) + " |", "|" + "---|" * (len(rs) + 1)]
    lines += ["| " + " | ".join(row) + " |" for row in _summary_rows(result)]
    c = result["check"]
    lines += ["", "## Tolerance", "", f"kind `{result['tolerance']['kind']}`: {result['kind_reason']}.", ""]
    if c["failures"]:
        lines += ["## Outside tolerance" + ("" if c["enabled"] else " (not enforced: no --check)"), ""]
        lines += [f"- {f['message']}" for f in c["failures"]]
    else:
        lines += ["Every variant within tolerance." if result["tolerance"]["step0"] is not None
                  else "Not checked (kind `any`)."]
    for r in rs:
        if r["status"] != "ok":
            lines += ["", f"## {r['label']}: {r['status']} (exit {r['returncode']})", "", "```",
                      r.get("log_tail", ""), "```"]
    lines += ["", "Seed: " + ", ".join(sorted({str(r['seed']) for r in rs})),
              "Runs: " + ", ".join(f"`{r['dir']}`" for r in rs), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- compare.png
def _minus(a: dict, b: dict) -> tuple[list[int], list[float]]:
    """a - b at the steps both logged (NaN where either value is missing or not finite)."""
    bs = dict(zip(*b))
    xs = [x for x in a[0] if x in bs]
    av = dict(zip(*a))
    return xs, [av[x] - bs[x] if math.isfinite(av[x]) and math.isfinite(bs[x]) else math.nan for x in xs]


def plot(result: dict, path: Path) -> dict:
    """compare.png: every variant's loss and grad norm by step (from its metrics.jsonl, as in
    compare.json) and each variant minus the baseline; returns what was drawn (toolkit.plot.draw)."""
    rs = result["variants"]
    base = f"baseline ({rs[0]['label']})"
    panels = [{"title": "loss", "ylabel": "loss (per token)", "lines": []},
              {"title": "grad norm", "ylabel": "grad norm (L2, before clipping)", "lines": [], "legend": False},
              {"title": "loss - baseline", "ylabel": "loss difference (variant - baseline)", "lines": [], "zero": base},
              {"title": "grad norm - baseline", "ylabel": "grad norm difference (variant - baseline)", "lines": [],
               "zero": base}]
    curves = []
    for i, r in enumerate(rs):
        label = r["label"] + ("" if r["status"] == "ok" else f" ({r['status']})")
        recs = [{"step": s, "loss": lo, "grad_norm": g} for s, lo, g in zip(r["steps"], r["loss"], r["grad_norm"])]
        own = {k: plots.series(recs, k) for k in ("loss", "grad_norm")}
        curves.append(own)
        for panel, key in ((0, "loss"), (1, "grad_norm")):
            panels[panel]["lines"].append({"label": label, "x": own[key][0], "y": own[key][1], "color": i,
                                           "width": 3.0 if i == 0 else 1.4})  # the baseline shows under equal runs
        if i == 0:
            continue
        for panel, key in ((2, "loss"), (3, "grad_norm")):
            x, y = _minus(own[key], curves[0][key])
            n = len(x)
            same = f" (identical at {'the' if n == 1 else 'all'} {n} common step{'s' if n > 1 else ''})"
            panels[panel]["lines"].append({"label": label + (same if n and all(v == 0 for v in y) else ""),
                                           "x": x, "y": y, "color": i})
    for panel in panels[2:]:
        panel["empty"] = "no step logged by both"
    values = ", ".join(result["values"])
    title = (f"apiary compare {result['key']}: {values} (baseline {result['values'][0]}) on {result['recipe']}, "
             f"tolerance {result['tolerance']['kind']}")
    return plots.draw(panels, path, title)

