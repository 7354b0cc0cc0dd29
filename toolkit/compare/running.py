"""apiary compare's runs: the plan (variants resolved, seeds, tolerance), each variant in its own
subprocess (train, then the probe), and the results with their differences.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.text import Text

from framework.compose.recipes import DEFAULT_RECIPE, recipe_path
from framework.errors import UserError
from framework.resolve.resolver import resolve
from toolkit.compare.args import Options, quote_override, slug
from toolkit.compare.diffs import check, differences
from toolkit.compare.tolerance import RESHARDED_NORM, TOLERANCES, Tolerance, classify

# Keys whose values change the model's parameters: each variant gets its own seed checkpoint.
SHAPE_KEYS = ("model.family", "model.flavor", "model.n_layers", "model.vocab_size", "model.hf_checkpoint")


err_console = Console(stderr=True, highlight=False, soft_wrap=True)
out_console = Console(highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- plan
@dataclass
class Variant:
    index: int
    value: str
    label: str  # key=value
    name: str  # directory name
    overrides: list[str]
    resolved: object = None
    seed: str | None = None


@dataclass
class Plan:
    opts: Options
    compare_dir: Path
    variants: list[Variant]
    seed_runs: list[tuple[Path, list[str]]]  # (seed output dir, overrides) to create
    tolerance: Tolerance
    kind_reason: str
    recipe: str




def plan(o: Options) -> Plan:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    variants = []
    for i, value in enumerate(o.values):
        ovs = list(o.overrides)
        ovs.insert(o.sweep_index, f"{o.key}={quote_override(value)}")
        variants.append(Variant(i, value, f"{o.key}={value}", f"{i}-{slug(value)}", ovs))

    recipe = recipe_path(o.recipe or DEFAULT_RECIPE).stem
    cdir = Path(o.output_dir or Path("runs") / "compare" / f"{recipe}-{slug(o.key)}-{stamp}").resolve()
    given_seed = [f"checkpoint.load_path={o.seed_path}"] if o.seed_path else []
    for v in variants:
        try:
            v.resolved = resolve(o.recipe, v.overrides + given_seed + [f"output_dir={cdir / v.name}"])
        except UserError as e:
            raise UserError(f"variant {v.label}: {e.where}", e.reason, e.suggestion) from None
    seen: dict = {}
    for v in variants:  # values spelled differently may still resolve to one config (1e-3 and 0.001)
        c = OmegaConf.to_container(v.resolved.cfg)
        c.pop("output_dir", None)
        key = repr(c)
        if key in seen:
            raise UserError(f"apiary compare {o.key}={','.join(o.values)}", f"variants {seen[key]} and {v.label} "
                            "resolve to the same configuration; they would compare nothing.",
                            "Compare values that differ.")
        seen[key] = v.label
    if cdir.exists() and any(cdir.iterdir()):
        raise UserError(f"output_dir={cdir}", "already holds files; a comparison writes a fresh directory.",
                        "Choose another output_dir or remove it.")
    worlds = {v.resolved.layout.world_size for v in variants}
    if len(worlds) > 1 and o.key not in ("launcher.nproc",):
        raise UserError(f"apiary compare {o.key}", f"the variants need different world sizes {sorted(worlds)}.",
                        "Compare at one world size (set nproc=N).")
    # Seeds: one shared (or one per variant for shape keys), or the user's load_path.
    seed_runs = []
    shape = o.key in SHAPE_KEYS
    for v in variants:
        if o.seed_path:
            v.seed = o.seed_path
            continue
        if shape or not seed_runs:
            sdir = cdir / (f"seed-{v.name}" if shape else "seed")
            fixed = ["launcher=local", "launcher.nproc=1", "training.global_batch=null", "checkpoint.enable=true",
                     "checkpoint.create_seed=true", "checkpoint.resume=false", "checkpoint.load_path=null",
                     *(f"parallel.{d}=1" for d in ("dp_replicate", "dp_shard", "cp", "ep", "pp", "tp")),
                     f"output_dir={sdir}"]
            keys = {a.partition("=")[0] for a in fixed}  # each key once: `train` refuses one given twice
            sov = [a for a in v.overrides if not a.lstrip("+~").startswith("launcher")
                   and a.lstrip("+~").partition("=")[0] not in keys] + fixed
            try:
                resolve(o.recipe, sov)
            except UserError as e:
                raise UserError(f"seed checkpoint for {v.label}: {e.where}", e.reason, e.suggestion) from None
            seed_runs.append((sdir, sov))
        v.seed = str(seed_runs[-1][0] / "checkpoint" / "step-0")
    from framework import devices  # reason: start-up time (torch; `apiary --help` imports this package)

    kind, why = classify(o.key, variants, devices.has_accelerator())
    if o.check and kind == "any" and not o.tol:
        # --check claims the variants are equivalent: hold a deliberate change to rounding level.
        dt = "fp32" if variants[0].resolved.cfg.training.dtype == "float32" else "bf16"
        why = f"--check holds even a deliberate change to {dt} rounding ({why}; --tol=any checks only for crashes)"
        kind = dt
    if o.tol:
        forced = o.tol
        if forced == "dtype":
            forced = "fp32" if variants[0].resolved.cfg.training.dtype == "float32" else "bf16"
        kind, why = forced, f"--tol={o.tol} (the key alone suggests {kind}: {why})"
    tol = TOLERANCES[kind]
    if kind == "exact" and len({v.resolved.layout.dp for v in variants}) > 1:
        tol = replace(tol, grad_norm=RESHARDED_NORM)
        why += f"; the grad norm sums over other shards (rel {RESHARDED_NORM:g})"
        if math.isfinite(variants[0].resolved.cfg.training.max_norm):  # clipping scales each update by that norm
            tol = replace(tol, curve=RESHARDED_NORM)
            why += ", and the clipping it sets moves the later steps' losses by as much"
    return Plan(o, cdir, variants, seed_runs, tol, why, variants[0].resolved.cfg.recipe)


# --------------------------------------------------------------------------- running
def _run(cmd: list[str], log: Path, timeout: float | None) -> tuple[int, float, bool]:
    """Run ``cmd`` with its output in ``log``; returns (exit code, seconds, timed out)."""
    from toolkit.probe import clean_env  # reason: start-up time (torch, torchtitan)

    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(clean_env(), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc, timed_out = p.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the variant's own process group (torchrun and its ranks)
            rc, timed_out = p.wait(), True
        except BaseException:  # Ctrl-C: the group started in its own session, so stop it here
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    return rc, time.perf_counter() - t0, timed_out


def _tail(log: Path, lines: int = 25, chars: int = 4000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    keep = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(keep[-lines:])[-chars:]


def _recipe_arg(o: Options) -> list[str]:
    return [f"recipe={o.recipe}"] if o.recipe else []


def _variant_cmd(p: Plan, v: Variant) -> list[str]:
    o, vdir = p.opts, p.compare_dir / v.name
    args = [*_recipe_arg(o), *v.overrides, f"output_dir={vdir}", f"checkpoint.load_path={v.seed}"]
    if not o.probe:
        return [sys.executable, "-m", "framework.cli", "train", *args]
    extra = [f"--max-numel={o.max_numel}"] if o.max_numel else []
    return [sys.executable, "-m", "toolkit.probe", "--train", f"--dump={vdir / 'probe'}", *extra, *args]


def _read_metrics(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    out = []
    for ln in f.read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError:
            continue
    return out


def _steady(records: list[dict]) -> list[dict]:
    if len(records) > 3:
        return records[3:]
    return records[1:] if len(records) > 1 else records


def _median(records: list[dict], key: str):
    xs = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def _per_median_step(records: list[dict], key: str, step_time):
    """A rate over the reported (median) step time: the median of the rate times each step's time (tokens, or
    FLOPs, per step) divided by it. A median of per-step rates can rank variants opposite to their step times."""
    per_step = [{key: r[key] * r["step_time_s"]} for r in records
                if isinstance(r.get(key), (int, float)) and isinstance(r.get("step_time_s"), (int, float))]
    amount = _median(per_step, key)
    return amount / step_time if amount is not None and step_time else None


def summarize(recs: list[dict]) -> dict:
    """One variant's row: medians over the steady steps; rates over the median step time, so tokens/s and
    TFLOPs rank the variants as step time does."""
    steady = _steady(recs)
    step_time = _median(steady, "step_time_s")
    return {
        "final_loss": recs[-1]["loss"] if recs else None,
        "step_time_s": step_time,
        "tokens_per_s": _per_median_step(steady, "tokens_per_s", step_time),
        "tokens_per_s_per_gpu": _per_median_step(steady, "tokens_per_s_per_gpu", step_time),
        "tflops_per_gpu": _per_median_step(steady, "tflops_per_gpu", step_time),
        "peak_mem_bytes": max((r["peak_mem_bytes"] for r in recs if r.get("peak_mem_bytes") is not None),
                              default=None),
        "peak_mem_kind": recs[-1].get("peak_mem_kind") if recs else None,
        "steady_steps": [r["step"] for r in steady],
    }


def _run_variant(p: Plan, v: Variant) -> dict:
    vdir = p.compare_dir / v.name
    log = p.compare_dir / "logs" / f"{v.name}.log"
    err_console.print(Text.assemble(("compare", "bold"), f" {v.label}: running -> {vdir}"))
    rc, secs, timed_out = _run(_variant_cmd(p, v), log, p.opts.timeout)
    recs = _read_metrics(vdir)
    status = "ok" if rc == 0 else ("timeout" if timed_out else "crashed")
    res = {"name": v.name, "label": v.label, "value": v.value, "dir": str(vdir), "log": str(log),
           "status": status, "returncode": rc, "wall_s": round(secs, 2), "seed": v.seed,
           "world_size": v.resolved.layout.world_size, "dims": dict(v.resolved.layout.dims),
           "steps": [r["step"] for r in recs], "loss": [r.get("loss") for r in recs],
           "grad_norm": [r.get("grad_norm") for r in recs]}
    if status != "ok":
        res["log_tail"] = _tail(log)
    res["summary"] = summarize(recs)
    res["probe"] = None
    pj = vdir / "probe" / "probe.json"
    if p.opts.probe and pj.is_file():
        try:
            res["probe"] = json.loads(pj.read_text())
        except json.JSONDecodeError:
            res["probe"] = {"error": "unreadable probe.json"}
        if recs and res["probe"] and "loss" in res["probe"]:
            res["probe"]["step1_loss_abs_diff"] = abs(res["probe"]["loss"] - recs[0]["loss"])
    elif p.opts.probe and status == "ok":
        res["probe"] = {"error": "the probe wrote no probe.json"}
    if not p.opts.keep_checkpoints:
        shutil.rmtree(vdir / "checkpoint", ignore_errors=True)
    word = {"ok": ("ok", "green"), "crashed": ("crashed", "bold red"), "timeout": ("timed out", "bold red")}[status]
    err_console.print(Text.assemble(("compare", "bold"), f" {v.label}: ", word, f" in {secs:.1f} s (exit {rc}, log {log})"))
    return res



def run_plan(p: Plan) -> dict:
    o = p.opts
    p.compare_dir.mkdir(parents=True, exist_ok=True)
    command = "apiary compare " + shlex.join(o.argv)
    for sdir, sov in p.seed_runs:
        log = p.compare_dir / "logs" / f"{sdir.name}.log"
        err_console.print(Text.assemble(("compare", "bold"), f" seed checkpoint -> {sdir}"))
        rc, secs, _ = _run([sys.executable, "-m", "framework.cli", "train", *_recipe_arg(o), *sov], log,
                           o.timeout)
        if rc != 0 or not (sdir / "checkpoint" / "step-0" / ".metadata").is_file():
            raise SeedFailed(f"the seed checkpoint run failed (exit {rc}); last lines of {log}:\n{_tail(log)}")
    if o.jobs > 1:
        err_console.print(f"[yellow]compare[/yellow]: {o.jobs} variants at a time; their step times and throughput "
                   "share the machine and are not comparable")
        with ThreadPoolExecutor(o.jobs) as ex:
            results = list(ex.map(lambda v: _run_variant(p, v), p.variants))
    else:
        results = [_run_variant(p, v) for v in p.variants]
    base = results[0]
    failures = []
    for r in results:
        r["diff"] = differences(base, r) if r is not base and r["status"] == "ok" and base["status"] == "ok" else {}
        r["violations"] = check(base, r, p.tolerance)
        failures += r["violations"]
    t = p.tolerance
    return {
        "command": command, "cwd": os.getcwd(), "recipe": p.recipe, "key": o.key, "values": o.values,
        "compare_dir": str(p.compare_dir), "world_size": p.variants[0].resolved.layout.world_size,
        "world_sizes": [v.resolved.layout.world_size for v in p.variants],
        "tolerance": {"kind": t.kind, "step0": t.step0, "curve": t.curve, "grad_norm": t.grad_norm,
                      "doc": t.doc},
        "kind_reason": p.kind_reason, "jobs": o.jobs,
        "check": {"enabled": o.check, "passed": not failures, "failures": failures},
        "variants": results,
    }


class SeedFailed(Exception):
    pass


