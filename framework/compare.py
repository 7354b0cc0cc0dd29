"""`apiary compare`: run a primitive against its baseline from one seed checkpoint and show
the two side by side.

    apiary compare [recipe=X] KEY=A,B[,C ...] [k=v ...] [nproc=N] [output_dir=PATH]
                   [--check] [--json] [--tol=KIND] [--jobs=N] [--timeout=S] [--no-probe]
                   [--keep-checkpoints] [--max-numel=N]

Exactly one key sweeps (Hydra's comma syntax): a component group (`loss=ce,chunked`,
`recompute=none,full`, `state=...`) or any config key (`optimizer.lr=1e-3,2e-3`,
`moe.chunk=none,chunk2`, `nproc=1,2`). The first value is the baseline. Every variant is
validated before anything runs (exit 2 on a user error). Then:

1. one seed checkpoint (step 0, one process, the first variant's config with its parallel
   dims set to 1) is written, or `checkpoint.load_path=` names an existing one; keys that
   change the model's shape (model.flavor, model.n_layers, ...) get one seed per variant;
2. each variant trains in its own subprocess (`train ... output_dir=DIR/<i>-<value>
   checkpoint.load_path=<seed>`), same seed, data order and world size, so a crash is
   reported with the tail of its log, not fatal; after training, the same subprocess runs
   `framework.probe` on the first global batch: step-0 loss, logits (where the loss
   primitive receives them) and every parameter's full gradient;
3. a side-by-side table: loss at each logged step and its largest relative difference from
   the baseline, grad norm, step time (median of the steady state: the steps after the first
   3, or all but the first if fewer), tokens/s, TFLOPs/GPU, peak memory, and the step-0
   differences of loss, logits and gradients.

Outputs (DIR: `output_dir=`, default runs/compare/<recipe>-<key>-<timestamp>):
compare.json (everything, also on stdout with --json), compare.md (the tables and the exact
command), seed/, and per variant its run directory (metrics.jsonl, config.yaml, ...),
probe/ (probe.json, grads.pt, logits.pt) and worker.log. The variants' own checkpoints are
deleted after their run unless --keep-checkpoints.

Tolerances. What a variant may differ by depends on what the swept key changes. The kind is
chosen from the key (table KEY_KINDS) and can be forced with --tol=exact|fp32|bf16|dtype|fp8|any:

| kind  | step-0 loss, logits, grads (rel) | loss / grad-norm curves (rel) | for |
|-------|-------------|-------------|-----|
| exact | 0 (bitwise) | 0 (bitwise); grad norm 1e-5 when the data-parallel size changes (its squares are summed over other shards) | schedule-only swaps: moe.chunk, recompute, data-parallel size (same global batch, data.sharding=blocks, same ep/cp/tp/pp, at most two partial sums per step), logging/loader knobs |
| fp32  | 1e-5        | 1e-3        | another kernel or partition of the same math in float32: loss (ce/chunked/linear_ce), state, moe.comm, parallel.ep/cp/tp/pp, attention backend |
| bf16  | 2e-2        | 5e-2        | the same in bfloat16 |
| fp8   | 0.15        | 2e-2 (loss); grad norm 0.15 | precision=bf16,fp8 and precision.* (FP8 GEMMs: e4m3 3 mantissa bits, e5m2 2; one layer's rms rounding 2.5-6%, docs/skills/fp8.md) |
| dtype | fp32 or bf16 by the baseline's training.dtype | | what KEY_KINDS says for kernels |
| any   | not checked | not checked | deliberate changes: optimizer, lr, seed, dtype, model shape, another objective (loss=ce,grpo or grpo,dapo; loss.z_loss, loss.eps, ...), unknown keys; with --check (and no --tol) they are held to dtype level, so --check answers "are these equivalent?" |

Relative differences: a scalar's |a-b|/|b|; logits' and each gradient's ||a-b||/||b|| (the
gradients' value is the worst parameter's); curves take the worst logged step. An exact kind
falls back to dtype on GPU unless training.deterministic=true (GPU kernels are not bitwise
run to run). Performance (step time, tokens/s, TFLOPs, memory) is reported, never checked.

--check exits 1 when a variant crashes or leaves its tolerance, naming the variant, the
metric, the difference and the tolerance. Without it the exit code is 0 once the report is
written (a crash is shown in the report). User errors exit 2.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from framework import registry
from framework.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Tolerance:
    kind: str
    step0: float | None  # relative: probe loss, logits, gradients; None = not checked
    curve: float | None  # relative: the loss curve over the logged steps
    grad_norm: float | None  # relative: the grad-norm curve
    doc: str


TOLERANCES = {
    "exact": Tolerance("exact", 0.0, 0.0, 0.0, "bitwise: the same arithmetic, rescheduled"),
    "fp32": Tolerance("fp32", 1e-5, 1e-3, 1e-3, "float32 rounding: another kernel or partition of the same math"),
    "bf16": Tolerance("bf16", 2e-2, 5e-2, 5e-2, "bfloat16 rounding: another kernel or partition of the same math"),
    "fp8": Tolerance("fp8", 0.15, 2e-2, 0.15, "FP8 GEMM rounding (e4m3/e5m2: 3/2 mantissa bits) of linears and expert GEMMs"),
    "any": Tolerance("any", None, None, None, "a deliberate change: reported, not checked"),
}
# Another data-parallel size keeps every gradient bitwise but sums the gradient norm's squares
# over other shards: that one figure may differ by float32 rounding.
RESHARDED_NORM = 1e-5
TOL_CHOICES = ("exact", "fp32", "bf16", "dtype", "fp8", "any")

# Swept key (exact key, or prefix ending in "." or a group name) -> tolerance kind, why.
KEY_KINDS: list[tuple[str, str, str]] = [
    ("moe.chunk", "exact", "EP chunking reschedules dispatch/combine around the same expert GEMMs"),
    ("recompute", "exact", "recompute reruns the same forward ops in backward"),
    ("launcher.nproc", "dp", "data-parallel size"),
    ("parallel.dp_shard", "dp", "data-parallel size"),
    ("parallel.dp_replicate", "dp", "data-parallel size"),
    ("training.local_batch", "dp", "micro-batching"),
    ("training.global_batch", "dp", "micro-batching"),
    ("logging.", "exact", "logging does not touch the arithmetic"),
    ("data.num_workers", "exact", "loader processes do not change the batches"),
    ("checkpoint.interval", "exact", "checkpoint cadence does not touch the arithmetic"),
    ("checkpoint.keep_latest_k", "exact", "checkpoint retention does not touch the arithmetic"),
    ("loss", "dtype", "another loss kernel for the same cross-entropy"),
    ("state", "dtype", "another optimizer-state sharding changes reduction order"),
    ("moe.comm", "dtype", "another dispatch/combine backend"),
    ("model.attn_backend", "dtype", "another attention kernel"),
    ("parallel.", "dtype", "another partition of the same math changes reduction order"),
    ("training.deterministic", "dtype", "deterministic kernels change op order"),
    ("precision.compile", "dtype", "compiled kernels of the same math"),
    ("precision", "fp8", "FP8 GEMMs round activations, weights and gradients to 3 (e4m3) / 2 (e5m2) mantissa bits"),
]
# Keys whose values change the model's parameters: each variant gets its own seed checkpoint.
SHAPE_KEYS = ("model.family", "model.flavor", "model.n_layers", "model.vocab_size", "model.hf_checkpoint")
FLAGS = ("--json", "--check", "--no-probe", "--keep-checkpoints")
VALUED_FLAGS = ("--tol", "--jobs", "--timeout", "--max-numel")

_err = Console(stderr=True, highlight=False, soft_wrap=True)
_out = Console(highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- arguments
@dataclass
class Options:
    argv: list[str]
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)  # non-sweep overrides, in order
    sweep_index: int = 0  # position of the sweep override among them
    key: str = ""
    values: list[str] = field(default_factory=list)
    output_dir: str | None = None
    json: bool = False
    check: bool = False
    probe: bool = True
    keep_checkpoints: bool = False
    tol: str | None = None
    jobs: int = 1
    timeout: float | None = None
    max_numel: int | None = None
    seed_path: str | None = None  # checkpoint.load_path given by the user


def _flag_value(name: str, raw: str, cast):
    try:
        return cast(raw)
    except ValueError:
        raise UserError(f"apiary compare {name}={raw}", f"{name} takes a number.") from None


def _tol(val: str) -> str:
    if val not in TOL_CHOICES:
        raise UserError(f"apiary compare --tol={val}", f"unknown tolerance kind; one of "
                        f"{', '.join(TOL_CHOICES)}.", did_you_mean(val, TOL_CHOICES))
    return val


def add_arguments(p) -> None:
    """`apiary compare`'s flags; recipe=, the swept KEY=A,B and the other overrides are positional k=v."""
    from framework.argparsing import overrides_arg

    overrides_arg(p, "recipe=NAME, the one swept KEY=A,B[,C] (first value = baseline), other overrides, "
                     "nproc=N, output_dir=PATH")
    p.add_argument("--check", action="store_true", help="exit 1 when a variant is outside its tolerance")
    p.add_argument("--json", action="store_true", help="print compare.json on stdout (the tables on stderr)")
    p.add_argument("--no-probe", dest="probe", action="store_false", help="skip the step-0 loss/logits/gradient probe")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each variant's checkpoints")
    p.add_argument("--tol", type=_tol, metavar="|".join(TOL_CHOICES), help="force the tolerance kind")
    p.add_argument("--jobs", type=lambda v: max(1, _flag_value("--jobs", v, int)), default=1, metavar="N",
                   help="variants run at a time (default 1; their timings then share the machine)")
    p.add_argument("--timeout", type=lambda v: _flag_value("--timeout", v, float), metavar="S",
                   help="seconds per variant before it is stopped")
    p.add_argument("--max-numel", type=lambda v: _flag_value("--max-numel", v, int), metavar="N",
                   help="largest tensor the probe compares element by element")


def parser():
    from framework.argparsing import Parser

    p = Parser(prog="apiary compare", description=USAGE,
               flags_hint=f"Flags: {', '.join(FLAGS)}, {'=, '.join(VALUED_FLAGS)}=, -h.")
    add_arguments(p)
    return p


def parse_args(argv: list[str], ns=None) -> Options:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from framework import argparsing
    from framework.cli import ALIASES

    if ns is None:
        ns, code = argparsing.run(parser(), list(argv), where="apiary compare {flag}")
        if ns is None:
            raise _Help(code)
    o = Options(argv=list(argv), json=ns.json, check=ns.check, probe=ns.probe, keep_checkpoints=ns.keep_checkpoints,
                tol=ns.tol, jobs=ns.jobs, timeout=ns.timeout, max_numel=ns.max_numel)
    plain: list[str] = []
    for a in ns.overrides:
        name, eq, val = a.partition("=")
        if name == "recipe" and eq:
            o.recipe = val
        elif name == "output_dir" and eq:
            o.output_dir = val
        else:
            plain.append(f"{ALIASES.get(name, name)}={val}" if eq else a)
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except HydraException as e:
        raise UserError("apiary compare", f"cannot parse the overrides: {e}".rstrip("."),
                        "Use key=value, group=option, and key=A,B for the one key to compare.") from None
    sweeps = [(i, ov) for i, ov in enumerate(parsed) if ov.is_sweep_override()]
    if not sweeps:
        raise UserError("apiary compare", "no key to compare: exactly one key takes comma-separated values.",
                        "For example loss=ce,chunked or optimizer.lr=1e-3,2e-3 (the first value is the baseline).")
    if len(sweeps) > 1:
        keys = ", ".join(ov.key_or_group for _, ov in sweeps)
        raise UserError("apiary compare", f"{len(sweeps)} keys take several values ({keys}); compare sweeps "
                        "exactly one.", "Fix the others to one value each (quote a value that contains a comma).")
    i, ov = sweeps[0]
    try:
        values = [str(v) for v in ov.sweep_string_iterator()]
    except HydraException as e:
        raise UserError(f"apiary compare {plain[i]}", f"cannot enumerate the values: {e}".rstrip(".") + ".",
                        "List them: key=A,B,C (or range(a,b)).") from None
    if len(values) < 2:
        raise UserError(f"apiary compare {plain[i]}", "needs at least two values (baseline first).")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise UserError(f"apiary compare {plain[i]}", f"lists {', '.join(repeated)} more than once; identical "
                        "variants compare nothing and double the cost.", "List each value once (baseline first).")
    o.key, o.values = ov.key_or_group, values
    if o.key in ("recipe", "output_dir") or o.key.startswith(("checkpoint.load_path", "checkpoint.resume",
                                                              "checkpoint.create_seed", "hydra")):
        raise UserError(f"apiary compare {plain[i]}", f"{o.key} cannot be compared.",
                        "Compare a component group or a config key.")
    for j, (raw, ov2) in enumerate(zip(plain, parsed)):
        if j == i:
            o.sweep_index = len(o.overrides)
            continue
        k = ov2.key_or_group
        if k in ("checkpoint.resume", "checkpoint.create_seed") and str(ov2.value()).lower() == "true":
            raise UserError(f"apiary compare {k}=true", "every variant starts fresh from one seed checkpoint.",
                            f"Drop {k}; pass checkpoint.load_path=PATH to start from existing weights.")
        if k == "checkpoint.load_path":  # the seed to share, instead of writing one
            if ov2.value() not in (None, "null"):
                o.seed_path = str(Path(str(ov2.value())).resolve())
            continue
        o.overrides.append(raw)
    return o


class _Help(Exception):
    pass


def _quote(value: str) -> str:
    """A value as a Hydra override right-hand side."""
    if re.fullmatch(r"[\w./:+\-@]*", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _slug(s: str, n: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:n] or "x"


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


def _objective(loss_name: str) -> str:
    """What a loss optimises: the cross-entropy family (ce, chunked, linear_ce, and sft, which is
    the same masked NLL) or a policy objective by name."""
    obj = getattr(registry.resolve("loss", loss_name), "objective", "") or "cross-entropy"
    return "cross-entropy" if obj == "sft" else obj


def _objective_change(key: str, cfgs) -> str | None:
    """Why sweeping ``key`` changes the loss's objective (not just its kernel), or None."""
    if not (key == "loss" or key.startswith("loss.")) or getattr(cfgs[0], "loss", None) is None:
        return None
    if key == "loss":
        objs = sorted({_objective(c.loss.name) for c in cfgs})
        return (f"loss swaps the objective ({', '.join(objs)}), not only its kernel: a deliberate change, "
                "reported, not checked") if len(objs) > 1 else None
    sub = key.split(".", 1)[1]
    if sub in getattr(registry.resolve("loss", cfgs[0].loss.name), "objective_keys", ()):
        return f"{key} is a hyperparameter of the objective: a deliberate change, reported, not checked"
    return None


def classify(key: str, variants: list[Variant], accelerator: bool) -> tuple[str, str]:
    """The tolerance kind for sweeping ``key`` over ``variants`` (resolved) and why."""
    kind, why = "any", f"no tolerance is known for {key}: treated as a deliberate change (pass --tol to check)"
    for pat, k, reason in KEY_KINDS:
        if key == pat or (pat.endswith(".") and key.startswith(pat)) or key.startswith(pat + "."):
            kind, why = k, reason
            break
    else:
        for pat in ("optimizer", "lr", "training.", "model.", "moe.", "data."):
            if key == pat or key.startswith(pat if pat.endswith(".") else pat + "."):
                why = f"{key} changes what is computed: a deliberate change, reported, not checked"
                break
    cfgs = [v.resolved.cfg for v in variants]
    base = cfgs[0]
    deliberate = _objective_change(key, cfgs)
    if deliberate:
        kind, why = "any", deliberate
    if kind == "dp":
        gb = {v.resolved.cfg.training.local_batch * v.resolved.layout.dp * v.resolved.grad_accum for v in variants}
        sums = max(v.resolved.layout.dp * v.resolved.grad_accum for v in variants)
        moved = {d: sorted({v.resolved.layout.dims[d] for v in variants}) for d in ("ep", "cp", "tp", "pp")}
        moved = {d: vals for d, vals in moved.items() if len(vals) > 1}
        if len(gb) > 1:
            kind, why = "any", f"{why} with another global batch ({sorted(gb)} sequences per step)"
        elif moved:
            kind, why = "dtype", (f"{why}, and the layout also changes " + ", ".join(
                f"{d} {' -> '.join(map(str, vals))}" for d, vals in moved.items()) + " (another partition)")
        elif any(c.data.sharding != "blocks" for c in cfgs):
            kind, why = "any", f"{why} with data.sharding=documents (other sequences per rank)"
        elif sums > 2:
            kind, why = "dtype", (f"{why}: the same {gb.pop()} sequences per step, but {sums} partial sums can be "
                                  "added in another order")
        else:
            kind, why = "exact", f"{why}: the same {gb.pop()} sequences per step, at most two partial sums"
    if kind == "exact" and accelerator and not base.training.deterministic:
        kind, why = "dtype", f"{why}; on GPU only bitwise with training.deterministic=true"
    eps = sorted({v.resolved.layout.dims["ep"] for v in variants})
    if len(eps) > 1 and variants[0].resolved.facts.num_experts and kind in ("exact", "dtype", "fp32"):
        # torchtitan's GroupedExperts run their GEMMs in bf16 whatever training.dtype is, and
        # another EP size reorders each expert's rows: expert gradients agree to bf16 only.
        kind, why = "bf16", (f"{why}; EP {' -> '.join(map(str, eps))} reorders each expert's rows and the "
                             "grouped expert GEMMs run in bf16 whatever training.dtype is")
    if kind == "dtype":
        kind = "fp32" if base.training.dtype == "float32" else "bf16"
        if kind == "fp32" and variants[0].resolved.facts.num_experts:
            kind, why = "bf16", (f"{why}; the model's grouped expert GEMMs run in bf16 whatever "
                                 "training.dtype is, so expert gradients agree to bf16 only")
    return kind, why


def plan(o: Options) -> Plan:
    from framework import devices
    from framework.recipes import DEFAULT_RECIPE, recipe_path
    from framework.resolve import resolve

    stamp = time.strftime("%Y%m%d-%H%M%S")
    variants = []
    for i, value in enumerate(o.values):
        ovs = list(o.overrides)
        ovs.insert(o.sweep_index, f"{o.key}={_quote(value)}")
        variants.append(Variant(i, value, f"{o.key}={value}", f"{i}-{_slug(value)}", ovs))

    recipe = recipe_path(o.recipe or DEFAULT_RECIPE).stem
    cdir = Path(o.output_dir or Path("runs") / "compare" / f"{recipe}-{_slug(o.key)}-{stamp}").resolve()
    given_seed = [f"checkpoint.load_path={o.seed_path}"] if o.seed_path else []
    for v in variants:
        try:
            v.resolved = resolve(o.recipe, v.overrides + given_seed + [f"output_dir={cdir / v.name}"])
        except UserError as e:
            raise UserError(f"variant {v.label}: {e.where}", e.reason, e.suggestion) from None
    from omegaconf import OmegaConf

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
            own = [a for a in v.overrides if not a.lstrip("+~").startswith("launcher")]
            sov = own + ["launcher=local", "launcher.nproc=1", "training.global_batch=null",
                                 "checkpoint.enable=true", "checkpoint.create_seed=true",
                                 "checkpoint.resume=false", "checkpoint.load_path=null",
                                 *(f"parallel.{d}=1" for d in ("dp_replicate", "dp_shard", "cp", "ep", "pp", "tp")),
                                 f"output_dir={sdir}"]
            try:
                resolve(o.recipe, sov)
            except UserError as e:
                raise UserError(f"seed checkpoint for {v.label}: {e.where}", e.reason, e.suggestion) from None
            seed_runs.append((sdir, sov))
        v.seed = str(seed_runs[-1][0] / "checkpoint" / "step-0")
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
    return Plan(o, cdir, variants, seed_runs, tol, why, variants[0].resolved.cfg.recipe)


# --------------------------------------------------------------------------- running
def _run(cmd: list[str], log: Path, timeout: float | None) -> tuple[int, float, bool]:
    """Run ``cmd`` with its output in ``log``; returns (exit code, seconds, timed out)."""
    from framework.probe import clean_env

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
    return [sys.executable, "-m", "framework.probe", "--train", f"--dump={vdir / 'probe'}", *extra, *args]


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


def _run_variant(p: Plan, v: Variant) -> dict:
    vdir = p.compare_dir / v.name
    log = p.compare_dir / "logs" / f"{v.name}.log"
    _err.print(Text.assemble(("compare", "bold"), f" {v.label}: running -> {vdir}"))
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
    steady = _steady(recs)
    res["summary"] = {
        "final_loss": recs[-1]["loss"] if recs else None,
        "step_time_s": _median(steady, "step_time_s"),
        "tokens_per_s": _median(steady, "tokens_per_s"),
        "tokens_per_s_per_gpu": _median(steady, "tokens_per_s_per_gpu"),
        "tflops_per_gpu": _median(steady, "tflops_per_gpu"),
        "peak_mem_bytes": max((r["peak_mem_bytes"] for r in recs if r.get("peak_mem_bytes") is not None),
                              default=None),
        "peak_mem_kind": recs[-1].get("peak_mem_kind") if recs else None,
        "steady_steps": [r["step"] for r in steady],
    }
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
    word = {"ok": "[green]ok[/green]", "crashed": "[bold red]crashed[/bold red]",
            "timeout": "[bold red]timed out[/bold red]"}[status]
    _err.print(Text.assemble(("compare", "bold"), f" {v.label}: {word} in {secs:.1f} s (exit {rc}, log {log})"))
    return res


# --------------------------------------------------------------------------- differences
def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b != 0 else math.inf


def _curve(a: list, b: list) -> tuple[float | None, float | None]:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not pairs:
        return None, None
    return max(abs(x - y) for x, y in pairs), max(_rel(x, y) for x, y in pairs)


def _tensor_diffs(a_path: Path, b_path: Path) -> dict:
    """Max |a-b| and norm-wise relative difference of two logits tensors."""
    import torch

    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    if a.shape != b.shape:
        return {"note": f"logits shapes differ: {list(a.shape)} vs {list(b.shape)}"}
    d = (a.double() - b.double())
    nb = float(b.double().norm())
    nd = float(d.norm())
    return {"max_abs": float(d.abs().max()) if d.numel() else 0.0,
            "rel": 0.0 if nd == 0 else (nd / nb if nb else math.inf)}


def _grad_diffs(a_path: Path, b_path: Path) -> dict:
    import torch

    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    common = [k for k in b if k in a]
    out = {"n_params": len(common), "only_baseline": sorted(set(b) - set(a))[:10],
           "only_variant": sorted(set(a) - set(b))[:10]}
    max_abs, rel, worst = 0.0, 0.0, None
    for k in common:
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            out.setdefault("shape_mismatch", []).append(k)
            continue
        d = x - y
        if d.numel() == 0:
            continue
        m = float(d.abs().max())
        nd, ny = float(d.norm()), float(y.norm())
        r = 0.0 if nd == 0 else (nd / ny if ny else math.inf)
        max_abs = max(max_abs, m)
        if worst is None or r > rel:
            rel, worst = max(rel, r), k
    out.update(max_abs=max_abs, rel=rel, worst_param=worst if rel > 0 else None)
    return out


def differences(base: dict, var: dict) -> dict:
    d: dict = {}
    n = min(len(base["steps"]), len(var["steps"]))
    d["common_steps"] = n
    d["loss_max_abs"], d["loss_max_rel"] = _curve(var["loss"][:n], base["loss"][:n])
    d["grad_norm_max_abs"], d["grad_norm_max_rel"] = _curve(var["grad_norm"][:n], base["grad_norm"][:n])
    bp, vp = base.get("probe") or {}, var.get("probe") or {}
    if "loss" in bp and "loss" in vp:
        d["step0_loss_abs"] = abs(vp["loss"] - bp["loss"])
        d["step0_loss_rel"] = _rel(vp["loss"], bp["loss"])
        d["step0_grad_norm_rel"] = _rel(vp["grad_norm"], bp["grad_norm"])
        bdir, vdir = Path(base["dir"]) / "probe", Path(var["dir"]) / "probe"
        if bp.get("logits") and vp.get("logits"):
            t = _tensor_diffs(vdir / vp["logits"]["file"], bdir / bp["logits"]["file"])
            d["logits_max_abs"], d["logits_rel"] = t.get("max_abs"), t.get("rel")
            if "note" in t:
                d["logits_note"] = t["note"]
        else:
            d["logits_note"] = "compared only loss and grads: " + ("; ".join(
                n for n in (bp.get("notes", []) + vp.get("notes", [])) if n.startswith("logits")) or "no logits")
        if bp.get("grads") and vp.get("grads"):
            g = _grad_diffs(vdir / vp["grads"]["file"], bdir / bp["grads"]["file"])
            d["grads_max_abs"], d["grads_rel"], d["grads_worst_param"] = g["max_abs"], g["rel"], g["worst_param"]
            d["grads_n_params"] = g["n_params"]
            if g["only_baseline"] or g["only_variant"] or g.get("shape_mismatch"):
                d["grads_note"] = (f"parameters only in the baseline {g['only_baseline']}, only in the variant "
                                   f"{g['only_variant']}, shapes differ {g.get('shape_mismatch', [])}")
    return d


def check(base: dict, var: dict, tol: Tolerance) -> list[dict]:
    """Violations of ``tol`` by ``var`` (crashes always count)."""
    out = []
    if var["status"] != "ok":
        out.append({"variant": var["label"], "metric": "run", "diff": None, "tol": None,
                    "message": f"{var['label']}: the run {var['status']} (exit {var['returncode']}); "
                               f"see {var['log']}"})
        return out
    if var is base or tol.step0 is None:
        return out
    if len(var["steps"]) < len(base["steps"]):
        out.append({"variant": var["label"], "metric": "steps", "diff": len(var["steps"]),
                    "tol": len(base["steps"]), "message": f"{var['label']}: logged {len(var['steps'])} steps, "
                    f"the baseline {len(base['steps'])}"})
    d = var["diff"]
    checks = [("loss curve (max rel over steps)", d.get("loss_max_rel"), tol.curve),
              ("grad norm curve (max rel over steps)", d.get("grad_norm_max_rel"), tol.grad_norm),
              ("step-0 loss (rel)", d.get("step0_loss_rel"), tol.step0),
              ("step-0 logits (norm-wise rel)", d.get("logits_rel"), tol.step0),
              ("step-0 grads (worst parameter, norm-wise rel)", d.get("grads_rel"), tol.step0)]
    for metric, value, t in checks:
        if value is None or t is None:
            continue
        if not value <= t:
            where = f" ({d['grads_worst_param']})" if metric.startswith("step-0 grads") and d.get(
                "grads_worst_param") else ""
            out.append({"variant": var["label"], "metric": metric, "diff": value, "tol": t,
                        "message": f"{var['label']}: {metric}{where} differs by {value:.3e} from "
                                   f"{base['label']}, above the {tol.kind} tolerance {t:g}"})
    return out


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
                row.append(_fmt(_rel(lv, bl), ".2e") if lv is not None and bl is not None else "-")
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


# --------------------------------------------------------------------------- main
USAGE = __doc__


def run_plan(p: Plan) -> dict:
    o = p.opts
    p.compare_dir.mkdir(parents=True, exist_ok=True)
    command = "apiary compare " + shlex.join(o.argv)
    for sdir, sov in p.seed_runs:
        log = p.compare_dir / "logs" / f"{sdir.name}.log"
        _err.print(Text.assemble(("compare", "bold"), f" seed checkpoint -> {sdir}"))
        rc, secs, _ = _run([sys.executable, "-m", "framework.cli", "train", *_recipe_arg(o), *sov], log,
                           o.timeout)
        if rc != 0 or not (sdir / "checkpoint" / "step-0" / ".metadata").is_file():
            raise _SeedFailed(f"the seed checkpoint run failed (exit {rc}); last lines of {log}:\n{_tail(log)}")
    if o.jobs > 1:
        _err.print(f"[yellow]compare[/yellow]: {o.jobs} variants at a time; their step times and throughput "
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


class _SeedFailed(Exception):
    pass


def compare_main(argv: list[str] | None = None, ns=None) -> int:
    """`apiary compare ARGV`; ns: the namespace when `apiary`'s parser has already parsed argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        o = parse_args(argv, ns)
        p = plan(o)
    except _Help as h:  # argparse printed the help
        return int(h.args[0]) if h.args else 0
    except UserError as e:
        _err.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
        return e.exit_code
    try:
        result = run_plan(p)
    except _SeedFailed as e:
        _err.print("[bold red]error[/bold red]", Text(f"apiary compare: {e}"), soft_wrap=True)
        return 1
    (p.compare_dir / "compare.json").write_text(json.dumps(result, indent=2, default=str))
    (p.compare_dir / "compare.md").write_text(markdown(result))
    if o.json:
        print(json.dumps(result, indent=2, default=str))
        print_report(result, _err)
    else:
        print_report(result, _out)
    return 1 if (o.check and result["check"]["failures"]) else 0


if __name__ == "__main__":
    sys.exit(compare_main())
