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
   `toolkit.probe` on the first global batch: step-0 loss, logits (where the loss
   primitive receives them) and every parameter's full gradient;
3. a side-by-side table: loss at each logged step and its largest relative difference from
   the baseline, grad norm, step time (median of the steady state: the steps after the first
   3, or all but the first if fewer), tokens/s, TFLOPs/GPU, peak memory, and the step-0
   differences of loss, logits and gradients.

Outputs (DIR: `output_dir=`, default runs/compare/<recipe>-<key>-<timestamp>):
compare.json (everything, also on stdout with --json), compare.md (the tables and the exact
command), compare.png (loss and grad norm by step, and each variant minus the baseline),
seed/, and per variant its run directory (metrics.jsonl, config.yaml, ...),
probe/ (probe.json, grads.pt, logits.pt) and worker.log. The variants' own checkpoints are
deleted after their run unless --keep-checkpoints.

Tolerances. What a variant may differ by depends on what the swept key changes. The kind is
chosen from the key (a component's NUMERICS, else toolkit.compare.tolerance.KEY_KINDS) and can
be forced with --tol=exact|fp32|bf16|dtype|fp8|any:

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

import re
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from framework.compose import recipes
from framework.compose.hydra_cli import ALIASES
from framework.errors import UserError, did_you_mean
from toolkit import argparsing
from toolkit.compare.tolerance import TOL_CHOICES

USAGE = __doc__
FLAGS = ("--json", "--check", "--no-probe", "--keep-checkpoints")
VALUED_FLAGS = ("--tol", "--jobs", "--timeout", "--max-numel")


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
    argparsing.overrides_arg(p, "recipe=NAME, the one swept KEY=A,B[,C] (first value = baseline), other overrides, "
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
    p = argparsing.Parser(prog="apiary compare", description=USAGE,
               flags_hint=f"Flags: {', '.join(FLAGS)}, {'=, '.join(VALUED_FLAGS)}=, -h.")
    add_arguments(p)
    return p


def parse_args(argv: list[str], ns=None) -> Options:
    if ns is None:
        ns, code = argparsing.run(parser(), list(argv), where="apiary compare {flag}")
        if ns is None:
            raise HelpShown(code)
    o = Options(argv=list(argv), json=ns.json, check=ns.check, probe=ns.probe, keep_checkpoints=ns.keep_checkpoints,
                tol=ns.tol, jobs=ns.jobs, timeout=ns.timeout, max_numel=ns.max_numel)
    plain: list[str] = []
    o.recipe, rest = recipes.split_recipe(ns.overrides)
    if o.recipe is not None and "," in o.recipe:  # several recipes: said before "no key to compare"
        recipes.recipe_path(o.recipe)
    for a in rest:
        name, eq, val = a.partition("=")
        if name == "output_dir" and eq:
            o.output_dir = val
        else:
            plain.append(f"{ALIASES.get(name, name)}={val}" if eq else a)
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except HydraException as e:
        recipes.check_bare_words(plain)
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


class HelpShown(Exception):
    pass


def quote_override(value: str) -> str:
    """A value as a Hydra override right-hand side."""
    if re.fullmatch(r"[\w./:+\-@]*", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def slug(s: str, n: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:n] or "x"


