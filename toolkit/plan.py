"""`apiary plan`: derived dims with their rules, per-GPU memory by term, verdict, step time.

    apiary plan recipe=NAME [gpus=N] [gpu_memory=80GiB] [gpu=H100|H200] [gpus_per_node=8]
                [key=value overrides ...] [calib.CONSTANT=VALUE ...] [calibration=FILE.json|.yaml]
                [--json] [--search [--top=N]] [--constants]

gpus defaults to the recipe's parallel.gpus (else 8); gpu_memory accepts 80GiB, 141GB, 79.1GiB
or plain bytes (at least 1 GiB: `gpu_memory=80` is refused, naming 80GiB) and picks the GPU kind
when gpu= is absent (above 100 GiB: H200, else H100).
Other key=value arguments are recipe overrides, exactly as `train` takes them. --search varies
ep, cp, pp, tp (those not set on the command line), recompute, loss and state around the
derived layout, drops what does not fit and ranks the rest by estimated time per token.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from framework.cli import _fail
from framework.compose import recipes
from framework.errors import UserError
from framework.plan import planner, preflight
from framework.plan.planner import Constants
from framework.resolve.layout import derive, params_text
from framework.resolve.resolver import check_candidate, resolve
from toolkit import argparsing
from toolkit.argparsing import Parser, overrides_arg

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, where: str = "gpu_memory") -> int:
    """'80GiB' -> 85899345920, '141GB' -> 141000000000, '85899345920' -> itself."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{where}={text}", "is not a memory size.",
                        "Write it as 80GiB, 141GB, 79.1GiB or a number of bytes.")
    return int(float(m.group(1)) * _UNITS[unit])


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return float(text)
    except ValueError:
        return text


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix == "" and not v):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


FLAGS_HINT = "Flags: --json, --search, --top=N, --constants, -h."


def _top(val: str) -> int:
    if not val.isdigit() or int(val) < 1:
        raise UserError(f"--top={val}", "must be a positive integer.", "For example --top=5.")
    return int(val)


def add_arguments(p) -> None:
    """`apiary plan`'s flags; everything else is a positional k=v (planner settings or recipe overrides)."""
    overrides_arg(p, "recipe=NAME gpus=N gpu_memory=80GiB gpu=H100|H200 gpus_per_node=N calib.CONSTANT=V "
                     "calibration=FILE and recipe overrides (key=value, group=option, +key=value, ~key)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--search", action="store_true", help="rank valid layouts (ep, cp, pp, tp, recompute, loss, "
                   "state) that fit, by estimated time per token")
    p.add_argument("--top", type=_top, default=None, metavar="N", help="rows of --search to show (default 10)")
    p.add_argument("--constants", action="store_true", help="print the planner's constants and exit")


def parser():
    p = Parser(prog="apiary plan", description=__doc__, flags_hint=FLAGS_HINT)
    add_arguments(p)
    return p


def _check_flags(ns) -> None:
    """A flag that acts only with another one, given without it, is refused (exit 2), never ignored."""
    if ns.top is not None and not ns.search:
        raise UserError(f"--top={ns.top}", "picks how many rows --search shows, and this plan does not search, so "
                        "the flag would be ignored.", f"Add --search (apiary plan ... --search --top={ns.top}), or "
                        "drop --top.")
    if ns.constants:
        others = [f for f, on in (("--json", ns.json), ("--search", ns.search), ("--top", ns.top is not None)) if on]
        others += list(ns.overrides)
        if others:
            raise UserError(f"--constants with {' '.join(others)}", "--constants prints the planner's default "
                            "constants and exits: it plans nothing, so the rest would be ignored.",
                            "Run `apiary plan --constants` alone, or drop --constants.")


def _split(ns):
    _check_flags(ns)
    opts = dict(recipe=None, gpus=None, gpu_memory=None, gpu=None, gpus_per_node=None, json=ns.json,
                search=ns.search, top=ns.top or 10, constants=ns.constants)
    calibration, overrides = {}, []
    opts["recipe"], rest = recipes.split_recipe(ns.overrides)
    for a in rest:
        key, sep, val = a.partition("=")
        if key in ("gpus", "gpus_per_node"):
            if not val.isdigit() or int(val) < 1:
                raise UserError(a, "must be a positive integer.", f"For example {key}={32 if key == 'gpus' else 8}.")
            opts[key] = int(val)
        elif key == "gpu_memory":
            opts["gpu_memory"] = parse_bytes(val)
            if opts["gpu_memory"] < _UNITS["gib"] and val.strip().replace(".", "", 1).isdigit():  # `gpu_memory=80`: bytes
                raise UserError(a, f"is {opts['gpu_memory']} bytes (a number without a unit counts bytes), "
                                "less than any GPU's memory.", f"Write the unit: gpu_memory={val.strip()}GiB "
                                f"(or {val.strip()}GB).")
        elif key == "gpu":
            opts["gpu"] = val.upper()
        elif key.startswith("calib.") and sep:
            calibration[key[len("calib."):]] = _value(val)
        elif key == "calibration" and sep:
            path = Path(val)
            if not path.is_file():
                raise UserError(a, f"no file at {path}.", "Give a JSON or YAML file of {constant: value}.")
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
                mark = getattr(e, "problem_mark", None)
                at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
                what = " ".join(str(getattr(e, "problem", None) or e).split())
                raise UserError(a, f"{at} is not JSON or YAML ({what}).",
                                "Give a file of {constant: value} (`apiary plan --constants` lists them).") from None
            if not isinstance(data, dict):
                raise UserError(a, "must hold a mapping of planner constants to values.")
            calibration = {**_flatten(data), **calibration}
        else:
            overrides.append(a)
    return opts, calibration, overrides


# --------------------------------------------------------------------------------------------
# dims: the rules and what each must satisfy


# derive's refusals that name the whole layout, by the start of their reason -> the rows they break
_PRODUCTS = {"dp_replicate x tp x pp": {"dp_replicate", "tp"}, "dp_replicate x dp_shard": {"dp_shard"},
             "the table's EP": {"ep"}}


def violated(layout, facts, cfg) -> set[str]:
    """The dims framework.resolve.layout.derive refuses for ``layout`` given as-is (none for a derived
    layout; derive reports the first rule broken)."""
    par = SimpleNamespace(**{k: cfg.parallel[k] for k in cfg.parallel})
    for dim, value in layout.dims.items():
        setattr(par, dim, value)
    try:
        derive(par, cfg.training, cfg.layout, facts, layout.world_size)
    except UserError as e:
        key = e.where.split("=", 1)[0].removeprefix("parallel.")
        if key in layout.dims:
            return {key}
        return next((dims for start, dims in _PRODUCTS.items() if e.reason.startswith(start)), set(layout.dims))
    return set()


def constraints(layout, facts, cfg) -> dict[str, str]:
    """What each dim must satisfy, with its numbers; ok / VIOLATED as framework.resolve.layout.derive says."""
    W, dpr, dps, cp, pp, tp = (layout.world_size, layout.dp_replicate, layout.dp_shard, layout.cp,
                               layout.pp, layout.tp)
    seq = int(cfg.training.seq_len)
    split = 2 * cp * (tp if tp > 1 else 1)
    room = W // (dpr * tp * pp)
    ep_space = dps * cp * tp
    bad = violated(layout, facts, cfg)

    def ok(dim):
        return "VIOLATED" if dim in bad else "ok"
    out = {
        "dp_replicate": f"HSDP replicas; dp_replicate x tp x pp = {dpr * tp * pp} divides world {W}: {ok('dp_replicate')}",
        "tp": f"dp_replicate x tp x pp = {dpr * tp * pp} divides world {W}: {ok('tp')}",
        "pp": f"divides the {facts.n_layers} layers: {ok('pp')}",
        "cp": (f"seq {seq} divisible by 2 x cp{' x tp' if tp > 1 else ''} = {split}: "
               f"{ok('cp')}; divides the {room} ranks left after dp_replicate x tp x pp: "
               f"{ok('cp')}; {seq // cp:,} tokens per GPU"),
        "dp_shard": (f"dp_replicate x dp_shard x cp x tp x pp = {dpr * dps * cp * tp * pp} = world {W}: "
                     f"{ok('dp_shard')}"),
        "ep": (f"divides dp_shard x cp x tp = {ep_space}: {ok('ep')}; divides the "
               f"{facts.num_experts} experts: {ok('ep')}" if facts.num_experts
               else "dense model: 1"),
    }
    return out


# --------------------------------------------------------------------------------------------
# output


def _gib(b: float) -> str:
    return f"{b / 2**30:,.2f}"


def _print_plan(console, r, p, rules_constraints) -> None:
    f, lay = r.facts, r.layout
    console.print(f"[bold]apiary plan[/bold] {escape(r.cfg.recipe)}: {f.family} {f.flavor} ({params_text(f.n_params)} params, "
                  f"{params_text(f.n_active_params)} active), seq {r.cfg.training.seq_len:,}, local_batch "
                  f"{r.cfg.training.local_batch}, {lay.world_size} x {p.choices['gpu']} "
                  f"({_gib(p.gpu_memory_bytes)} GiB)")
    t = Table(title="derived dims")
    for col in ("dim", "value", "rule", "constraints"):
        t.add_column(col, overflow="fold")
    for dim in ("dp_replicate", "dp_shard", "cp", "ep", "pp", "tp"):
        rule = lay.rules.get(dim, "recipe value" if dim == "dp_replicate" else "")
        t.add_row(*map(Text, (dim, str(lay.dims[dim]), rule, rules_constraints[dim])))
    console.print(t)
    stage = "one pipeline stage" if p.choices["stage"] == "only" else f"peak pipeline stage: {p.choices['stage']}"
    t = Table(title=f"memory per GPU ({stage}; state {p.choices['state']}, "
                    f"recompute {p.choices['recompute']}, loss {p.choices['loss']})")
    for col, just in (("term", "left"), ("GiB", "right"), ("GB", "right"), ("group", "left"), ("count x bytes", "left")):
        t.add_column(col, justify=just, overflow="fold")
    for term in p.terms:
        t.add_row(*map(Text, (term.name, _gib(term.bytes), f"{term.bytes / 1e9:,.2f}", term.group, term.formula)))
    console.print(t)
    color = {"fits": "green", "tight": "yellow", "OOM": "red"}[p.verdict]
    console.print(f"total [bold]{_gib(p.total_bytes)} GiB[/bold] ({p.total_bytes / 1e9:,.2f} GB) of "
                  f"{_gib(p.gpu_memory_bytes)} GiB; headroom {_gib(p.headroom_bytes)} GiB -> "
                  f"[bold {color}]{p.verdict}[/bold {color}]  (torch max_memory_reserved estimate "
                  f"{_gib(p.torch_reserved_bytes)} GiB)")
    if p.verdict == "OOM":
        console.print(_preflight_note(p, r.layout.cp))
    t = Table(title="step time (roofline)")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    for k, v in p.time_s.items():
        t.add_row(k, f"{v:.3f}")
    console.print(t)
    console.print(f"step [bold]{p.step_time_s:.3f} s[/bold], {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                  f"[bold]{p.tflops_per_gpu:.1f} TFLOPs/GPU[/bold] (model FLOPs)")
    console.print("assumptions:")
    for a in p.assumptions:
        console.print(f"  - {a}", markup=False)
    for w in p.warnings:
        console.print("[yellow]warning[/yellow]", Text(str(w)))


def _preflight_note(p, cp: int) -> str:
    """What a launch of this plan does: the preflight refuses only beyond the planner's measured error above."""
    _, over, kind = preflight.measured_band(cp)
    refuse_at = p.gpu_memory_bytes * (1 + over)
    if p.total_bytes > refuse_at:
        return f"a launch refuses it (preflight.memory=refuse: above {_gib(refuse_at)} GiB, {over:.0%} over the GPU)"
    return (f"a launch warns, not refuses: within the planner's measured error above ({over:.0%} at {kind}, up to "
            f"{_gib(refuse_at)} GiB), so it may still fit")


def _print_search(console, res) -> None:
    c = res["counts"]
    t = Table(title=f"--search: {c['layouts']} layouts ({c['invalid_layouts']} invalid), {c['plans']} plans, "
                    f"{c['oom']} OOM dropped, {c['fit']} fit; ranked by estimated time per token")
    for col in ("#", "ep", "cp", "pp", "tp", "dp_shard", "recompute", "loss", "state", "GiB", "verdict",
                "step s", "tok/s/GPU", "TFLOPs/GPU", "overrides"):
        t.add_column(col, overflow="fold")
    for row in res["rows"]:
        d = row["dims"]
        t.add_row(str(row["rank"]), str(d["ep"]), str(d["cp"]), str(d["pp"]), str(d["tp"]), str(d["dp_shard"]),
                  row["recompute"], row["loss"], row["state"], _gib(row["total_bytes"]), row["verdict"],
                  f"{row['step_time_s']:.3f}", f"{row['tokens_per_s_per_gpu']:,.0f}", f"{row['tflops_per_gpu']:.1f}",
                  Text(" ".join(row["overrides"])))
    console.print(t)
    if c["rejected_by_resolve"]:
        console.print(f"{c['rejected_by_resolve']} fitting row(s) skipped: resolve rejected their overrides.")


def _print_constants(console) -> None:
    c = Constants()
    t = Table(title="planner constants (override with calib.NAME=VALUE or calibration=FILE)")
    for col in ("name", "value", "why"):
        t.add_column(col, overflow="fold")
    for fld in fields(Constants):
        t.add_row(fld.name, json.dumps(getattr(c, fld.name)) if isinstance(getattr(c, fld.name), dict)
                  else f"{getattr(c, fld.name):g}" if isinstance(getattr(c, fld.name), float) else str(getattr(c, fld.name)),
                  Text(fld.metadata.get("doc", "")))
    console.print(t)


def plan_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns, code = argparsing.run(parser(), argv, where="argument {flag}")
        if ns is None:
            return code
        return plan_args(ns)
    except UserError as e:
        return _fail(e)


def plan_args(ns) -> int:
    console = Console(highlight=False, soft_wrap=False, width=200 if not sys.stdout.isatty() else None)
    try:
        opts, calibration, overrides = _split(ns)
        if opts["constants"]:
            _print_constants(console)
            return 0
        recipe = opts["recipe"]
        gpus = opts["gpus"]  # else the recipe's parallel.gpus, else 8 (the recipe is composed once)
        r = resolve(recipe, overrides, for_training=False,
                    world_size=gpus if gpus is not None else (lambda cfg: int(cfg.parallel.gpus or 8)))
        gpus = r.layout.world_size
        if calibration:  # unknown constants fail before planning (after resolve: a registry=FILE adds its own)
            planner.Constants().calibrated(calibration)
        kwargs = dict(gpu_memory_bytes=opts["gpu_memory"], gpu=opts["gpu"], gpus_per_node=opts["gpus_per_node"],
                      calibration=calibration or None)
        p = planner.plan(r, **kwargs)
        res = (planner.search(r, overrides, gpus, top=opts["top"], plan_kwargs=kwargs, check=check_candidate)
               if opts["search"] else None)
        if opts["json"]:
            out = {"recipe": r.cfg.recipe, "world_size": gpus, **p.to_json(), "rules": r.layout.rules,
                   "constraints": constraints(r.layout, r.facts, r.cfg)}
            if res is not None:
                out["search"] = res["rows"]
                out["search_counts"] = res["counts"]
            print(json.dumps(out, indent=1, default=_json_default))
            return 0
        _print_plan(console, r, p, constraints(r.layout, r.facts, r.cfg))
        if res is not None:
            _print_search(console, res)
        return 0
    except UserError as e:
        return _fail(e)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def main() -> None:
    sys.exit(plan_main())


if __name__ == "__main__":
    main()
