"""The one launch `train` and `apiary launch` both call: resolve the recipe for the chosen launcher's
ranks, take the run lock, then start the ranks here or submit them (a launcher component's ``launch``),
or with ``dry_run`` print what would start (the command, or the batch script).

    launch(recipe, overrides, *, dry_run=False, verbose=False) -> exit code

``overrides`` are Hydra's (``launcher=NAME``, ``launcher.KEY=V``, recipe keys): the user registries
they name (``registry=PATH``, the recipe's ``registry:``) are applied by the composition before any
name is looked up. Bad input is one paragraph (UserError, exit 2) before anything starts.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf, open_dict
from rich.console import Console
from rich.text import Text

from framework import contracts
from framework.compose import recipes, registry
from framework.errors import UserError
from framework.launch import lifecycle, runlock
from framework.plan.preflight import check_memory
from framework.resolve import disk, paths
from framework.resolve.handoff import preview_resolved, write_resolved
from framework.resolve.inputs import world_size_env
from framework.resolve.outputs import default_output_dir
from framework.resolve.resolver import check_candidate, resolve
from framework.train import run

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

JOB_INPUTS = ("data.tokenizer", "data.path", "validation.path")  # files a submitted job reads where it runs


def fail(e: UserError) -> int:
    err_console.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
    return e.exit_code


def model_label(r) -> str:
    """The model a launch's first line names: its family and flavor, or with model.hf_checkpoint the
    folder (its config.json is the architecture, the flavor only supplies defaults)."""
    what = f"HF folder {paths.shown(r.cfg.model.hf_checkpoint)}" if r.cfg.model.hf_checkpoint else r.facts.flavor
    return f"{r.facts.family} {what} ({r.facts.n_params / 1e6:,.1f}M params)"


def launcher_of(cfg):
    return registry.resolve("launcher", cfg.launcher.name)


def world_size(cfg) -> int:
    """The ranks the chosen launcher starts (its own options checked first, so that the message names
    the option); a stray WORLD_SIZE in this shell is refused (framework/resolve/inputs.py)."""
    world_size_env()
    cls = launcher_of(cfg)
    check_options = contracts.member(cls, "launcher", "check_options")
    if check_options is not None:
        check_options(cfg.launcher)
    return int(cls.world_size(cfg.launcher))


def launch_env(resolved, argv: list[str] | None = None, verbose: bool = False) -> contracts.LaunchEnv:
    """What a launcher component needs of the framework to start ``resolved``'s ranks with ``train argv``."""
    def worker_env(ranks_argv: list[str] | None = None) -> dict[str, str]:
        return write_resolved(resolved, list(argv or []) if ranks_argv is None else list(ranks_argv))

    return contracts.LaunchEnv(resolved=resolved, supervise=lifecycle.supervise,
                               run_here=functools.partial(run.train_here, resolved, verbose), worker_env=worker_env)


def recipe_arg(recipe: str | None) -> list[str]:
    if recipe is None:
        return []
    p = Path(recipe)
    if (p.suffix in (".yaml", ".yml") or "/" in recipe) and p.is_file():
        return [f"recipe={p.resolve()}"]  # the ranks may start in another directory
    return [f"recipe={recipe}"]


def worker_argv(recipe, overrides: list[str], r, verbose: bool) -> list[str]:
    """What each rank runs as `train ...`: the recipe and overrides, output_dir fixed (absolute), a resume
    asked for when the run resumes."""
    argv = recipe_arg(recipe) + [o for o in overrides if not o.startswith(("output_dir=", "checkpoint.resume="))]
    argv.append(f"output_dir={Path(r.cfg.output_dir).resolve()}")
    if r.cfg.checkpoint.resume:
        argv.append("checkpoint.resume=true")
    if verbose:
        argv.append("-v")
    return argv


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name the file system cannot hold (too long): nothing there
        return False


def _missing_inputs(cfg) -> list[str]:
    """``key=PATH`` for each input file or folder of JOB_INPUTS that this machine does not have."""
    out = []
    for key in JOB_INPUTS:
        value = OmegaConf.select(cfg, key)
        if value not in (None, "", "byte") and not _exists(str(value)):
            out.append(f"{key}={value}")
    return out


def _resolve(recipe, overrides, *, dry_run: bool):
    """The launch resolved, and its warnings. For a batch-script launcher the job runs elsewhere:
    a hub dataset this machine cannot reach is a warning (the job streams it, and checks it, where it runs),
    and a dry run renders its script although an input the job reads (a tokenizer, data) is missing here
    (a login node, a laptop), each missing one a warning naming what the job will need."""
    try:
        return resolve(recipe, overrides, world_size=world_size), []
    except UserError as e:
        first = e
    try:
        cfg = recipes.load(recipe, overrides)
        script = contracts.member(launcher_of(cfg), "launcher", "render") is not None
    except UserError:
        raise first from None
    hub = script and first.where.startswith("data.name=") and "HuggingFace hub dataset" in first.reason
    missing = _missing_inputs(cfg)  # as given (the resolved config stores them absolute)
    if not hub and not (dry_run and script and first.where in missing):
        raise first
    r = resolve(recipe, overrides, world_size=world_size, for_training=False)  # every check but the job's files
    check_memory(r, recipe, overrides, check_candidate)  # the memory preflight needs none of them: it still holds
    if r.cfg.output_dir is None:
        with open_dict(r.cfg):
            r.cfg.output_dir = default_output_dir(r.cfg.recipe)
    if hub:
        return r, [f"{first.where}: {first.reason} The job streams it where it runs, and stops with exit 2 before "
                   "training if it cannot reach it there."]
    return r, [f"{m} does not exist on this machine; the job needs it where it runs, or it stops with exit 2 "
               f"before training. {first.suggestion if i == 0 else ''}".strip() for i, m in enumerate(missing)]


def launch(recipe: str | None, overrides: list[str], *, dry_run: bool = False, verbose: bool = False) -> int:
    """Resolve ``train recipe overrides`` for its launcher, then start, submit or (``dry_run``) print it;
    returns the exit code (a UserError: said in one paragraph, its code)."""
    try:
        r, warnings = _resolve(recipe, list(overrides), dry_run=dry_run)
        cls = launcher_of(r.cfg)
        warnings += _launch_warnings(cls, r, dry_run)
        argv = worker_argv(recipe, list(overrides), r, verbose)
    except UserError as e:
        return fail(e)
    _first_line(r, warnings, dry_run)
    if dry_run:
        return _dry_run(cls, r, argv)
    try:  # one run per output_dir: checked (a process launcher: taken) before anything starts or is submitted
        lock = runlock.hold_for_launch(cls, Path(r.cfg.output_dir).resolve())
    except UserError as e:
        return fail(e)
    try:
        env = dataclasses.replace(launch_env(r, argv, verbose), warned=True)
        return int(cls.launch(r.cfg.launcher, argv, env))
    except UserError as e:  # found while the model loads (e.g. a NaN in a checkpoint tensor)
        return fail(e)
    finally:
        if lock is not None:
            lock.release()


def _launch_warnings(cls, r, dry_run: bool) -> list[str]:
    """The launcher's own ``preflight`` warnings (optional), and a recipe laid out for another GPU count."""
    warnings = []
    preflight = contracts.member(cls, "launcher", "preflight")
    if preflight is not None:
        warnings += preflight(r.cfg.launcher, r, dry_run=dry_run) or []
    room = disk.checkpoint_room_warning(r)
    if room is not None:
        warnings.append(room)
    world = r.layout.world_size
    if r.cfg.parallel.gpus is not None and int(r.cfg.parallel.gpus) != world:
        warnings.append(f"the recipe is laid out for parallel.gpus={r.cfg.parallel.gpus}; this launch has "
                        f"{world} rank{'' if world == 1 else 's'}, so its dims are derived for {world}.")
    return warnings


def _first_line(r, warnings: list[str], dry_run: bool) -> None:
    """The launch's first line (the recipe, launcher, model, ranks, dims, output folder), then its warnings."""
    world = r.layout.world_size
    dims = " · ".join(f"{k} {v}" for k, v in r.layout.dims.items())
    out = err_console if dry_run else console  # a dry run's stdout is the command or script alone
    out.print(Text.assemble(("apiary", "bold"), f" {r.cfg.recipe} via {r.cfg.launcher.name}: {model_label(r)} · "
                            f"{world} rank{'' if world == 1 else 's'} · {dims} · output "
                            f"{Path(r.cfg.output_dir).resolve()}"))
    for w in warnings:
        err_console.print("[yellow]warning[/yellow]", Text(str(w)))


def _dry_run(cls, r, argv: list[str]) -> int:
    """A batch-script launcher's script (its hand-off file previewed, not written); a process launcher's
    own ``launch`` with the command it would start printed instead of started: the line it hands
    ``supervise`` (torchrun for nproc > 1), or ``train ARGS`` for the run it would do in this process."""
    render = contracts.member(cls, "launcher", "render")
    if render is not None:
        try:
            script = render(r.cfg.launcher, r, argv, lambda ranks_argv=None: preview_resolved(r, ranks_argv or argv))
        except UserError as e:
            return fail(e)
        sys.stdout.write(script)
        sys.stdout.flush()
        err_console.print("dry run: nothing submitted. Without --dry-run the script is written to "
                          f"{Path(r.cfg.output_dir).resolve()}/train.sbatch and submitted with sbatch.", markup=False)
        return 0

    def print_command(cmd, env=None, nproc=None) -> int:
        console.print(" ".join(shlex.quote(str(c)) for c in cmd), markup=False)
        return 0

    env = dataclasses.replace(launch_env(r, argv), supervise=print_command, warned=True,
                              run_here=lambda: print_command(["train", *argv]),
                              worker_env=lambda ranks_argv=None: {})
    try:
        code = int(cls.launch(r.cfg.launcher, argv, env))
    except UserError as e:
        return fail(e)
    if code == 0:
        err_console.print("dry run: nothing started.")
    return code
