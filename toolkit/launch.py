"""`apiary launch` and `apiary cp-template`: preflight a recipe for a launcher, then run or submit it.

    apiary launch [recipe=NAME] [launcher=local|slurm] [SHORTHAND=v ...] [overrides] [--dry-run] [--wait] [-v]
    apiary cp-template LAUNCHER PATH

Shorthands are the chosen launcher's option names without ``launcher.``: ``nodes=4
gpus_per_node=8 partition=gpu account=proj time=04:00:00 qos=high`` for slurm, ``nproc=2`` for
local. Everything is resolved for the launcher's world size before anything is spawned or
submitted: dims, data/tokenizer/checkpoint paths, output_dir, launcher options. Bad input exits
with code 2 and one paragraph (framework.errors.UserError).
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf, open_dict
from rich.console import Console
from rich.text import Text

from framework import contracts
from framework.cli import model_label
from framework.compose import recipes, registry
from framework.compose.schema import RecipeConfig
from framework.errors import UserError, did_you_mean
from framework.launch import runlock
from framework.resolve.outputs import default_output_dir
from framework.resolve.resolver import resolve
from framework.train import run
from toolkit import argparsing
from toolkit.argparsing import Parser, overrides_arg

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

def _fail(e: UserError) -> int:
    err_console.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
    return e.exit_code


FLAGS_HINT = "Flags: --dry-run, --wait, -v/--verbose, -h/--help."


def add_arguments(p) -> None:
    """`apiary launch`'s flags; recipe=, launcher=, shorthands and overrides are positional k=v."""
    overrides_arg(p, "recipe=NAME launcher=local|slurm, the launcher's options without `launcher.` "
                     "(nodes=N gpus_per_node=G partition=P ... for slurm, nproc=N for local) and recipe overrides")
    p.add_argument("-n", "--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="check everything and print the command or batch script; start or submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the submitted job to finish (launchers with "
                   "a wait option: slurm)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every step")


def parser():
    p = Parser(prog="apiary launch", description=__doc__, flags_hint=FLAGS_HINT)
    add_arguments(p)
    return p


def _split(ns):
    launcher, tokens = None, []
    flags = {f for f in ("dry_run", "wait", "verbose") if getattr(ns, f)}
    recipe, rest = recipes.split_recipe(ns.overrides)
    for a in rest:
        if a.startswith("launcher="):
            launcher = a.split("=", 1)[1]
        else:
            tokens.append(a)
    return recipe, launcher, flags, tokens


def _launcher_class(name: str | None, recipe: str | None, tokens: list[str] = ()):
    if name is None:  # the recipe's own, with the user registries it names (the other tokens come later)
        name = str(recipes.load(recipe, [t for t in tokens if t.lstrip("+").startswith("registry=")]).launcher.name)
    else:  # user registries (the recipe's `registry:`, `registry=`) first: they may bind the launcher's name
        recipes.use_registries(recipes.recipe_path(recipe or recipes.DEFAULT_RECIPE), list(tokens))
    registry.check("launcher", name, where=f"launcher={name}")
    return name, registry.resolve("launcher", name)


def _expand(tokens: list[str], option_names: set[str]) -> list[str]:
    """``nodes=4`` -> ``launcher.nodes=4`` for the chosen launcher's option names."""
    out = []
    for t in tokens:
        key, sep, val = t.partition("=")
        if sep and key == "gpu" and key not in option_names:  # the memory preflight's GPU kind, as for `train`
            out.append(f"preflight.gpu={val}")
            continue
        out.append(f"launcher.{key}{sep}{val}" if sep and key in option_names else t)
    return out


def _check_shorthands(tokens: list[str], name: str, fields: set[str]) -> None:
    """A bare ``key=v`` that belongs to another launcher: say which launcher it belongs to."""
    top = {f.name for f in dataclasses.fields(RecipeConfig)}
    for t in tokens:
        key, sep, _ = t.partition("=")
        if not sep or "." in key or key in fields or key in top or key.startswith(("+", "~")):
            continue
        owners = []
        for other in registry.names("launcher"):
            if other != name:
                opts = registry.resolve("launcher", other).Options
                if key in {f.name for f in dataclasses.fields(opts)}:
                    owners.append(other)
        if owners:
            raise UserError(f"apiary launch {t}", f"{key} is an option of launcher {' and '.join(owners)}, "
                            f"not of {name}.", f"Add launcher={owners[0]}, or use {name}'s options: "
                            f"{', '.join(sorted(fields))}.")


def _recipe_arg(recipe: str | None) -> list[str]:
    if recipe is None:
        return []
    p = Path(recipe)
    if (p.suffix in (".yaml", ".yml") or "/" in recipe) and p.is_file():
        return [f"recipe={p.resolve()}"]  # the job may start in another directory
    return [f"recipe={recipe}"]


def _worker_argv(recipe, overrides, r, flags) -> list[str]:
    """What each worker runs as `train ...`: fixed output_dir, resume when asked (as `train` does)."""
    argv = _recipe_arg(recipe) + [o for o in overrides if not o.startswith(("output_dir=", "checkpoint.resume="))]
    argv.append(f"output_dir={Path(r.cfg.output_dir).resolve()}")
    if r.cfg.checkpoint.resume:
        argv.append("checkpoint.resume=true")
    if "verbose" in flags:
        argv.append("-v")
    return argv


JOB_INPUTS = ("data.tokenizer", "data.path", "validation.path")  # files the job reads where it runs


def _missing_inputs(cfg) -> list[str]:
    """``key=PATH`` for each input file or folder of JOB_INPUTS that this machine does not have."""
    out = []
    for key in JOB_INPUTS:
        value = OmegaConf.select(cfg, key)
        if value not in (None, "", "byte") and not Path(str(value)).exists():
            out.append(f"{key}={value}")
    return out


def _resolve(recipe, overrides, world_size, *, dry_script: bool, script: bool = False):
    """The launch resolved, and its warnings. A dry run of a batch-script launcher (slurm) renders its
    script although an input the job reads (a tokenizer, data) is missing here (a login node, a laptop):
    each missing one becomes a warning naming what the job will need, since the job checks them again
    where it runs. A hub dataset this machine cannot reach is a warning for any batch-script launch
    (``script``): the job streams it from the nodes it runs on, and checks it there."""
    try:
        return resolve(recipe, overrides, world_size=world_size), []
    except UserError as e:
        hub = script and e.where.startswith("data.name=") and "HuggingFace hub dataset" in e.reason
        if not hub and (not dry_script or
                        not any(e.where == m for m in _missing_inputs(recipes.load(recipe, overrides)))):
            raise
        hint, said = e.suggestion, f"{e.where}: {e.reason}"
    r = resolve(recipe, overrides, world_size=world_size, for_training=False)  # every check but the job's files
    missing = _missing_inputs(recipes.load(recipe, overrides))  # as given (r.cfg stores them absolute)
    if r.cfg.output_dir is None:
        with open_dict(r.cfg):
            r.cfg.output_dir = default_output_dir(r.cfg.recipe)
    if hub:
        return r, [f"{said} The job streams it where it runs, and stops with exit 2 before "
                   "training if it cannot reach it there."]
    return r, [f"{m} does not exist on this machine; the job needs it where it runs, or it stops with exit 2 "
               f"before training. {hint if i == 0 else ''}".strip() for i, m in enumerate(missing)]


def launch_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns, code = argparsing.run(parser(), argv, where="apiary launch {flag}")
        if ns is None:
            return code
    except UserError as e:
        return _fail(e)
    return launch_args(ns)


def launch_args(ns) -> int:
    try:
        recipe, name, flags, tokens = _split(ns)
        name, cls = _launcher_class(name, recipe, tokens)
        fields = {f.name for f in dataclasses.fields(cls.Options)} - {"name"}
        _check_shorthands(tokens, name, fields)
        overrides = [f"launcher={name}", *_expand(tokens, fields)]
        if "wait" in flags:
            if "wait" not in fields:
                raise UserError("--wait", f"launcher {name} has no wait option.", "Drop --wait.")
            overrides.append("launcher.wait=true")

        check_options = contracts.member(cls, "launcher", "check_options")

        def world_size(cfg) -> int:  # resolve composes the recipe once and asks this for its ranks
            if check_options is not None:
                check_options(cfg.launcher)
            return int(cls.world_size(cfg.launcher))

        script = contracts.member(cls, "launcher", "render") is not None
        r, warnings = _resolve(recipe, overrides, world_size, dry_script="dry_run" in flags and script,
                               script=script)
        opts, world = r.cfg.launcher, r.layout.world_size
        preflight = contracts.member(cls, "launcher", "preflight")
        if preflight is not None:
            warnings += preflight(opts, r, dry_run="dry_run" in flags) or []
        if r.cfg.parallel.gpus is not None and int(r.cfg.parallel.gpus) != world:
            warnings.append(f"the recipe is laid out for parallel.gpus={r.cfg.parallel.gpus}; this launch has "
                            f"{world} ranks, so its dims are derived for {world}.")
        argv_w = _worker_argv(recipe, [o for o in overrides], r, flags)
    except UserError as e:
        return _fail(e)

    summary = (f"apiary launch {r.cfg.recipe} via {name}: {world} ranks, dims {r.layout.dims}, "
               f"{model_label(r)}, "
               f"output {Path(r.cfg.output_dir).resolve()}")
    out = err_console if "dry_run" in flags else console  # a dry run's stdout is the script alone
    out.print(summary, markup=False)
    for w in warnings:
        err_console.print("[yellow]warning[/yellow]", Text(str(w)))

    if "dry_run" not in flags:
        try:  # one run per output_dir: checked (local: taken) before anything starts or is submitted
            lock = runlock.hold_for_launch(cls, Path(r.cfg.output_dir).resolve())
        except UserError as e:
            return _fail(e)
        if lock is not None:
            try:
                return _launch(cls, opts, argv_w, r, flags, world)
            finally:
                lock.release()
    return _launch(cls, opts, argv_w, r, flags, world)


def _launch(cls, opts, argv_w, r, flags, world) -> int:
    render = contracts.member(cls, "launcher", "render")
    if render is not None:  # a batch-script launcher (slurm)
        try:
            script = render(opts, r, argv_w)
        except UserError as e:
            return _fail(e)
        if "dry_run" in flags:
            sys.stdout.write(script)
            sys.stdout.flush()
            err_console.print("dry run: nothing submitted. Without --dry-run the script is written to "
                              f"{Path(r.cfg.output_dir).resolve()}/train.sbatch and submitted with sbatch.", markup=False)
            return 0
        try:
            return int(cls.launch(opts, argv_w, dataclasses.replace(run.launch_env(r, argv_w), warned=True)))
        except UserError as e:
            return _fail(e)

    # a process launcher (local): in-process for one rank, a supervised command (torchrun) otherwise
    if "dry_run" in flags:
        return _dry_run_process_launcher(cls, opts, argv_w, r)

    try:
        return int(cls.launch(opts, argv_w, run.launch_env(r, argv_w, verbose="verbose" in flags)))
    except UserError as e:  # found while the model loads (e.g. a NaN in a checkpoint tensor)
        return _fail(e)


def _dry_run_process_launcher(cls, opts, argv_w, r) -> int:
    """The launcher's own ``launch``, with the command it would start printed instead of started:
    the line it hands ``supervise`` (torchrun for nproc > 1), or ``train ARGS`` for the run it would
    do in this process."""

    def print_command(cmd, env=None, nproc=None) -> int:
        console.print(" ".join(shlex.quote(str(c)) for c in cmd), markup=False)
        return 0

    def print_in_process() -> int:
        return print_command(["train", *argv_w])

    code = int(cls.launch(opts, argv_w, dataclasses.replace(run.launch_env(r, argv_w), supervise=print_command,
                                                            run_here=print_in_process, worker_env=dict)))
    if code == 0:
        err_console.print("dry run: nothing started.")
    return code


CP_TEMPLATE_USAGE = "usage: apiary cp-template LAUNCHER PATH   (then launch with launcher.template=PATH)"


def cp_template_main(argv: list[str]) -> int:
    """``apiary cp-template slurm my.sbatch.j2``: copy a launcher's script template to edit it."""
    try:
        if len(argv) != 2:
            raise UserError(f"apiary cp-template {' '.join(argv)}".strip(), "needs a launcher name and a path.",
                            CP_TEMPLATE_USAGE)

        name, dest = argv
        registry.check("launcher", name, where=f"apiary cp-template {name}")
        cls = registry.resolve("launcher", name)
        src = contracts.member(cls, "launcher", "TEMPLATE")
        if src is None or not Path(src).is_file():
            with_tpl = [n for n in registry.names("launcher")
                        if contracts.member(registry.resolve("launcher", n), "launcher", "TEMPLATE")]
            raise UserError(f"apiary cp-template {name}", f"launcher {name} has no script template.",
                            did_you_mean(name, with_tpl) or f"Launchers with one: {', '.join(with_tpl) or 'none'}.")
        d = Path(dest)
        if d.is_dir():
            d = d / Path(src).name
        if d.exists():
            raise UserError(f"apiary cp-template {name} {dest}", f"{d} already exists; not overwriting it.",
                            "Choose another path or remove it first.")
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, d)
        except OSError as e:
            raise UserError(f"apiary cp-template {name} {dest}", f"cannot write {d}: {e.strerror or e}.",
                            "Choose a path in a folder you can write.") from None
    except UserError as e:
        return _fail(e)
    console.print(f"copied {Path(src).name} -> {d}  (use it with `apiary launch ... launcher={name} "
                  f"launcher.template={d}`)", markup=False)
    return 0
