"""`apiary plot RUN [RUN ...] [--out FILE]`: one PNG of runs' metrics over steps.

Four panels, one line per run: loss (and val_loss, dashed, where records have it), grad norm,
tokens/s and peak memory in GiB (labelled by the records' peak_mem_kind: torch's reserved memory
on a GPU, the process's max RSS on CPU). RL runs (records with a reward, a lag or a mismatch) get
four more below: the mean reward of each step's records, their lag behind the trainer's version
(mean, max dashed), the training-inference mismatch (mean |logp_gen - logp_train|) and the KL to
the reference (with a KL term). A RUN is a run folder holding metrics.jsonl (or that file
itself); only metrics.jsonl is read: records a resume superseded sit in metrics.superseded.jsonl.
The PNG goes to plot.png in the first run's folder unless --out names a file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml
from rich.console import Console
from rich.text import Text

from framework.errors import UserError

METRICS = "metrics.jsonl"
WIDTH_IN, HEIGHT_IN, DPI = 12, 8, 100  # a PNG of four panels: 1200 x 800 pixels (eight: 1200 x 1600)
MEM_KINDS = {"cuda_max_memory_reserved": "torch reserved on GPU", "cpu_max_rss": "max RSS on CPU"}
NUMERIC = ("loss", "val_loss", "grad_norm", "tokens_per_s", "peak_mem_bytes")
RL_KEYS = ("data/reward_mean", "data/lag_mean", "policy/mismatch_abs_mean")  # a run with any of them is RL
RL_NUMERIC = (*RL_KEYS, "data/lag_max", "policy/kl_mean")
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a run folder holding metrics.jsonl (runs/RECIPE/TIMESTAMP), or the metrics.jsonl itself")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="the PNG to write (default: plot.png in the first run's folder)")


# --------------------------------------------------------------------------- reading runs
def _number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def read_records(path: Path, where: str = "apiary plot") -> list[dict]:
    """The records of one metrics.jsonl, in file order; a line that is not a record is a UserError
    naming the file and line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{where} {path}", f"cannot be read: {e}.") from None
    recs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        at = f"{where} {path}:{n}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise UserError(at, f"is not a JSON record ({e}): {line[:60]!r}.",
                            "A line cut short by a crash: remove it (a resume moves such lines to "
                            "metrics.superseded.jsonl).") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
            raise UserError(at, "is not a metrics record: each line is a JSON object with an integer step.",
                            "Point apiary plot at a run folder written by train.")
        bad = [k for k in (*NUMERIC, *RL_NUMERIC) if not _number(rec.get(k))]
        if bad:
            raise UserError(at, f"{bad[0]}={rec[bad[0]]!r} is not a number.", "Fix or remove the line.")
        recs.append(rec)
    if not recs:
        raise UserError(f"{where} {path}", "holds no records.",
                        "The run logged no step yet; plot it once its first step is logged.")
    return recs


def _recipe(folder: Path) -> str | None:
    cfg = folder / "config.yaml"
    if not cfg.is_file():
        return None
    try:
        cfg = yaml.safe_load(cfg.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # a config we cannot read only costs the label its recipe
        return None
    if not isinstance(cfg, dict) or not cfg.get("recipe"):
        return None
    return str(cfg["recipe"])


def load_run(arg: str) -> dict:
    """A run: its folder, name, recipe and records, one per step in step order (records of one step
    are merged, a later value winning: a validation record joins its step's training record)."""
    p = Path(arg)
    if p.is_file() and p.name == METRICS:
        p = p.parent
    if not p.exists():
        raise UserError(f"apiary plot {arg}", "no such folder.", "Give a run folder (runs/RECIPE/TIMESTAMP).")
    if not p.is_dir():
        raise UserError(f"apiary plot {arg}", f"is a file, not a run folder holding {METRICS}.",
                        "Give the run's folder.")
    f = p / METRICS
    if not f.is_file():
        raise UserError(f"apiary plot {arg}", f"holds no {METRICS}: not a run folder, or the run logged nothing yet.",
                        "Give a run folder (runs/RECIPE/TIMESTAMP).")
    by_step: dict[int, dict] = {}
    for rec in read_records(f):
        by_step[rec["step"]] = {**by_step.get(rec["step"], {}), **rec}  # e.g. a val_loss record of a step
    recs = [by_step[s] for s in sorted(by_step)]
    return {"dir": p.resolve(), "name": p.resolve().name, "recipe": _recipe(p), "records": recs}


def _labels(runs: list[dict]) -> list[str]:
    labels = [r["name"] + (f" ({r['recipe']})" if r["recipe"] and r["recipe"] not in r["name"] else "") for r in runs]
    twice = {lab for lab in labels if labels.count(lab) > 1}  # the same folder name in two places: add the parent
    return [f"{r['dir'].parent.name}/{lab}" if lab in twice else lab for r, lab in zip(runs, labels)]


def series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have ``key``; None and non-finite values become NaN (a gap)."""
    xs, ys = [], []
    for r in records:
        if key in r:
            v = r[key]
            xs.append(r["step"])
            ys.append(float(v) / scale if v is not None and math.isfinite(v) else math.nan)
    return xs, ys


def mem_kind(kind: str | None) -> str:
    return MEM_KINDS.get(kind, kind or "kind not recorded")


# --------------------------------------------------------------------------- drawing
def draw(panels: list[dict], out: Path, title: str, where: str = "apiary plot --out") -> dict:
    """Draw ``panels`` (2 x 2) into the PNG ``out``, WIDTH_IN x HEIGHT_IN inches at DPI.

    Panels fill rows of two (four: 2 x 2, eight: 4 x 2; HEIGHT_IN per two rows).
    Each panel: {"title", "ylabel", "lines": [{"label", "x", "y", "style": "-"|"--", "color": i, "width": w}],
    optional "zero": the legend label of a reference line at 0, "legend": False (the colours are another panel's)
    and "empty": the text shown when it has no line}.
    Returns what was drawn, read back from the figure: {panel title: {line label: (x, y)}}."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the start-up time of apiary's other commands
    from matplotlib.figure import Figure  # (same reason)
    from matplotlib.ticker import MaxNLocator  # (same reason)

    rows = max((len(panels) + 1) // 2, 2)
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN * rows / 2), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=11)
    colors = [f"C{i}" for i in range(10)]
    axes = fig.subplots(rows, 2, sharex=True).ravel()
    for ax, panel in zip(axes, panels):
        ax.set_title(panel["title"], fontsize=11)
        ax.set_ylabel(panel["ylabel"])
        ax.grid(True, alpha=0.3)
        if panel.get("zero"):
            ax.axhline(0.0, color="0.5", linewidth=0.8, zorder=0, label=panel["zero"], gid="reference")
        for ln in panel["lines"]:
            few = len(ln["x"]) <= 30
            ax.plot(ln["x"], ln["y"], ln.get("style", "-"), color=colors[ln.get("color", 0) % 10], label=ln["label"],
                    marker="o" if few else None, markersize=3.5 * ln.get("width", 1.4) / 1.4,
                    linewidth=ln.get("width", 1.4))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # steps
        if panel["lines"] and panel.get("legend", True):
            ax.legend(fontsize=8, loc="best")
        if not panel["lines"]:
            ax.text(0.5, 0.5, panel.get("empty", "not recorded"), ha="center", va="center", transform=ax.transAxes,
                    color="0.4")
    for ax in axes[-2:]:
        ax.set_xlabel("step")
    for ax in axes[:-2]:
        ax.tick_params(labelbottom=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, format="png", dpi=DPI)
    except OSError as e:
        raise UserError(f"{where} {out}", f"cannot be written: {e.strerror or e}.",
                        "Choose a writable path.") from None
    return {ax.get_title(): {ln.get_label(): (ln.get_xdata(orig=False).tolist(), ln.get_ydata(orig=False).tolist())
                             for ln in ax.get_lines() if ln.get_gid() != "reference"} for ax in axes}


def run_panels(runs: list[dict]) -> list[dict]:
    labels = _labels(runs)
    kinds = [dict.fromkeys(r.get("peak_mem_kind") for r in run["records"] if "peak_mem_bytes" in r) for run in runs]
    all_kinds = list(dict.fromkeys(k for ks in kinds for k in ks))
    panels = [
        {"title": "loss" + (" (dashed: val_loss)" if any("val_loss" in r for run in runs for r in run["records"])
                            else ""), "ylabel": "loss (per token)", "lines": []},
        {"title": "grad norm", "ylabel": "grad norm (L2, before clipping)", "lines": [], "legend": False},
        {"title": "throughput", "ylabel": "tokens/s (all ranks)", "lines": [], "legend": False},
        {"title": "peak memory", "ylabel": "peak memory (GiB, " + (" / ".join(map(mem_kind, all_kinds)) or
                                                                  "kind not recorded") + ")",
         "lines": [], "legend": len(all_kinds) > 1},
    ]
    for i, (run, label) in enumerate(zip(runs, labels)):
        recs = run["records"]
        for panel, key, scale, suffix, style in ((0, "loss", 1, "", "-"), (0, "val_loss", 1, " val_loss", "--"),
                                                 (1, "grad_norm", 1, "", "-"), (2, "tokens_per_s", 1, "", "-"),
                                                 (3, "peak_mem_bytes", 2**30, "", "-")):
            x, y = series(recs, key, scale)
            if not x:
                continue
            if panel == 3 and len(all_kinds) > 1:
                suffix = " (" + ", ".join(map(mem_kind, kinds[i])) + ")"
            panels[panel]["lines"].append({"label": label + suffix, "x": x, "y": y, "style": style, "color": i})
    if any(k in r for run in runs for r in run["records"] for k in RL_KEYS):
        panels.extend(rl_panels(runs, labels))
    return panels


def rl_panels(runs: list[dict], labels: list[str]) -> list[dict]:
    """An RL run's four panels: reward, lag (max dashed), mismatch, KL to the reference."""
    panels = [
        {"title": "reward", "ylabel": "mean reward of the step's records", "lines": [],
         "empty": "no reward in the records (docs/rl.md)"},
        {"title": "lag (dashed: max)", "ylabel": "versions behind the trainer", "lines": [], "legend": False,
         "empty": "no lag: data.follow=false, or records without policy_version"},
        {"title": "training-inference mismatch", "ylabel": "mean |logp_gen - logp_train|", "lines": [],
         "legend": False, "empty": "not recorded"},
        {"title": "KL to the reference", "ylabel": "mean KL (k3) over trained tokens", "lines": [], "legend": False,
         "empty": "no KL term (loss.kl_coef=0)"},
    ]
    for i, (run, label) in enumerate(zip(runs, labels)):
        for panel, key, suffix, style in ((0, "data/reward_mean", "", "-"), (1, "data/lag_mean", "", "-"),
                                          (1, "data/lag_max", " max", "--"), (2, "policy/mismatch_abs_mean", "", "-"),
                                          (3, "policy/kl_mean", "", "-")):
            x, y = series(run["records"], key)
            if x:
                panels[panel]["lines"].append({"label": label + suffix, "x": x, "y": y, "style": style, "color": i})
    return panels


def plot_runs(args: list[str], out: str | None = None) -> tuple[Path, dict]:
    """Read every run (all checked before drawing), draw, and return (the PNG, what was drawn)."""
    if out is not None and Path(out).suffix.lower() != ".png":
        raise UserError(f"apiary plot --out {out}", "apiary plot writes PNG images.", f"Name it {Path(out).stem}.png.")
    runs = [load_run(a) for a in args]
    seen = [r["dir"] for r in runs]
    twice = next((a for a, d in zip(args, seen) if seen.count(d) > 1), None)
    if twice is not None:
        raise UserError(f"apiary plot {twice}", "names a run given more than once; its lines would hide each other.",
                        "List each run once.")
    dest = Path(out) if out is not None else runs[0]["dir"] / "plot.png"
    names = ", ".join(_labels(runs))
    drawn = draw(run_panels(runs), dest, "apiary plot: " + (names if len(names) <= 150 else names[:147] + "..."))
    return dest, drawn


def run(args) -> int:
    """`apiary plot` on argparse's namespace (runs, out); exit code 0, or 2 on bad input."""
    try:
        dest, drawn = plot_runs(args.runs, args.out)
    except UserError as e:
        err_console.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
        return e.exit_code
    console.print(f"wrote {dest} ({len(args.runs)} run{'s' if len(args.runs) > 1 else ''}, "
                  f"{WIDTH_IN * DPI}x{HEIGHT_IN * DPI * max((len(drawn) + 1) // 2, 2) // 2})", markup=False)
    return 0
