"""apiary compare's report: the side-by-side tables (rich) and compare.md.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

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


def print_report(result: dict, console: Console) -> None:
    rs = result["variants"]
    console.print(_heading(result), markup=False)
    t = Table(title="loss by step (rel diff: vs the baseline)")
    t.add_column("step", justify="right")
    for i, r in enumerate(rs):
        t.add_column(r["label"], justify="right")
        if i:
            t.add_column("rel diff", justify="right")
    for row in _step_rows(rs):
        t.add_row(*map(Text, row))
    console.print(t)
    t = Table(title="summary")
    t.add_column("metric")
    for r in rs:
        t.add_column(r["label"], justify="right")
    for row in _summary_rows(result):
        t.add_row(*map(Text, row))
    console.print(t)
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
    console.print(f"report: {result['compare_dir']}/compare.md, compare.json", markup=False)


def markdown(result: dict) -> str:
    rs = result["variants"]
    lines = [f"# apiary compare: {result['key']} = {', '.join(result['values'])}", "",
             "```", result["command"], "```", "", _heading(result), ""]
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


