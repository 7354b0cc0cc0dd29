"""`train`'s command line on Hydra: Hydra's own argument parser, `--cfg job|hydra|all`,
`--resolve`, `--info`, `-m/--multirun` through Hydra's sweeper and basic launcher, and a
`--help` generated from the schema and registry.yaml.

A recipe is Hydra's primary config (its folder is the config dir, recipes/ is on the search
path, each registry kind with options is a config group). apiary's own checks (framework.resolve)
run on every job's overrides before Hydra launches anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import typing
from pathlib import Path

from hydra import version as hydra_version
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobRuntime
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from rich.text import Text

from framework import compat, contracts
from framework.compose import hydra_keys, recipe_files, recipes, registry
from framework.compose.schema import RecipeConfig
from framework.errors import UserError
from framework.resolve.resolver import resolve

# Short spellings accepted on the command line, rewritten to their full keys.
ALIASES = {"nproc": "launcher.nproc", "gpu": "preflight.gpu"}

SYNOPSIS = "train [recipe=NAME] [key=value | group=option | +key=value | ~key ...] [-m] [--cfg job|hydra|all] " \
           "[--resolve] [-p PACKAGE] [--info [WHAT]] [-v] [-h]"
_UNSUPPORTED = {"shell_completion": "--shell-completion", "config_path": "--config-path",
                "config_name": "--config-name", "config_dir": "--config-dir",
                "experimental_rerun": "--experimental-rerun"}


def _refuse(msg: str):
    raise UserError("train", f"{msg}.", f"Usage: {SYNOPSIS}. See `train --help`.")


def parser() -> argparse.ArgumentParser:
    """Hydra's own argument parser, plus apiary's -v/--verbose."""
    p = compat.hydra_args_parser("train", _refuse)
    p.add_argument("-v", "--verbose", action="store_true", help="log every step (torchtitan's INFO logging)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """argv -> Namespace(recipe, overrides, and Hydra's flags). `nproc=N` becomes launcher.nproc=N."""
    recipe, rest = recipes.split_recipe(argv)
    args, extra = parser().parse_known_args(rest)
    flags = [a for a in extra if a.startswith("-")]
    if flags:
        raise UserError(f"argument {flags[0]}", "unknown flag.",
                        "Flags: -m/--multirun, --cfg job|hydra|all, --resolve, -p/--package, --info, "
                        "-v/--verbose, -h/--help (train --help lists them).")
    overrides = []
    for a in [*args.overrides, *extra]:
        key, sep, val = a.partition("=")
        overrides.append(f"{ALIASES.get(key, key)}{sep}{val}" if sep else a)
    args.overrides, args.recipe = overrides, recipe
    for attr, flag in _UNSUPPORTED.items():
        if getattr(args, attr):
            raise UserError(f"train {flag}", "is not used by apiary: the recipe is the primary config.",
                            "Choose it with recipe=NAME or recipe=PATH.yaml.")
    commands = [n for n, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                ("--info", args.info)) if on]
    if len(commands) > 1:
        raise UserError("train " + " ".join(commands), "Only one of --run, --multirun, --cfg and --info can be "
                        "specified.", "Drop all but one.")
    if args.resolve and not (args.cfg or args.help):
        raise UserError("train --resolve", "The --resolve flag can only be used in conjunction with --cfg or "
                        "--help.", "For example: train --cfg job --resolve.")
    if args.package and not args.cfg:
        raise UserError(f"train --package {args.package}", "only selects what --cfg prints.",
                        f"For example: train --cfg job -p {args.package}.")
    if not (args.help or args.hydra_help):  # hydra.* keys that would do nothing for this command
        # --cfg job and --info preview a run: the same verdict; --cfg hydra|all print Hydra's config as given
        hydra_keys.check(overrides, "multirun" if args.multirun else "show" if args.cfg in ("hydra", "all") else "run")
    return args


def unset_to_null(overrides: list[str]) -> list[str]:
    """After framework.compose.recipes has checked them: `~key` / `~key=v` -> `key=null` (what it means here)."""
    return [f"{o[1:].split('=', 1)[0]}=null" if o.startswith("~") else o for o in overrides]


# ------------------------------------------------------------------------------------ Hydra
def hydra_for(recipe: str | None):
    """A Hydra instance whose primary config is the recipe; returns (hydra, config_name, base overrides)."""
    path = recipes.recipe_path(recipe or recipes.DEFAULT_RECIPE)
    recipes._store()
    GlobalHydra.instance().clear()
    hydra_version.setbase(None)
    h = compat.hydra_for_config_dir(str(path.parent), task_name="train")
    return h, path.stem, [f"hydra.searchpath=[file://{recipes.RECIPES_DIR}]"]


def hydra_cfg(recipe, overrides: list[str], resolve: bool):
    """Hydra's own `hydra` section for these overrides, as Hydra's --cfg hydra prints it."""
    h, name, base = hydra_for(recipe)
    try:
        cfg = h.compose_config(config_name=name, overrides=[*base, *sweep_dir(recipe, overrides),
                                                            *unset_to_null(overrides)],
                               run_mode=RunMode.RUN, with_log_configuration=False)
        HydraConfig.instance().set_config(cfg)
        OmegaConf.set_readonly(cfg.hydra, None)
        out = compat.hydra_sanitized_cfg(cfg)
        if resolve:
            OmegaConf.resolve(out)
        return out
    finally:
        GlobalHydra.instance().clear()


@contextlib.contextmanager
def _own_logging():
    """Hydra points the root logger at this process's stdout/stderr; undo that when it is done
    (the stream may be gone for a caller that keeps running, e.g. a test capturing output)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def info(recipe, overrides: list[str], what: str) -> None:
    h, name, base = hydra_for(recipe)
    try:
        with _own_logging():
            h.show_info(what, config_name=name, overrides=[*base, *unset_to_null(overrides)])
    finally:
        GlobalHydra.instance().clear()


def sweep_dir(recipe, overrides: list[str]) -> list[str]:
    """apiary's default sweep directory, runs/RECIPE/multirun-TIME, unless hydra.sweep.dir is given."""
    if any(o.startswith("hydra.sweep.dir=") for o in overrides):
        return []
    stem = recipes.recipe_path(recipe or recipes.DEFAULT_RECIPE).stem
    return [f"hydra.sweep.dir=runs/{stem}/multirun-{time.strftime('%Y%m%d-%H%M%S')}"]


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Hydra's BasicSweeper expansion of the command line into one override list per job."""
    plain = [o for o in overrides if not o.startswith("~") and not o.startswith("hydra.")]
    unset = [o for o in overrides if o.startswith("~")]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
        batches = compat.hydra_split_sweep(parsed)
    except HydraException as e:
        recipes.check_ascii(plain, "train -m")
        raise UserError("train -m", f"cannot expand the sweep: {e}".rstrip(".") + ".",
                        "Sweep with key=A,B (or range(a,b)); every other override takes one value.") from None
    return [[*job, *unset] for batch in batches for job in batch]


def multirun(recipe, overrides: list[str], run_job) -> int:
    """Check every job, then sweep with Hydra's BasicSweeper and BasicLauncher (one job after another,
    each in its own directory under hydra.sweep.dir). run_job(job_overrides, output_dir) -> exit code."""
    for o in overrides:
        if o.startswith(("output_dir=", "checkpoint.resume=")):
            raise UserError(f"train -m {o}", "each job of a sweep gets its own directory under the sweep "
                            "directory.", "Set hydra.sweep.dir=PATH instead (jobs go to PATH/0, PATH/1, ...).")
    jobs = sweep_jobs(overrides)
    if not jobs:
        raise UserError("train -m " + " ".join(overrides), "the sweep expands to no jobs (an empty range or "
                        "list), so nothing would run.", "Give each swept key at least one value: range(a,b) "
                        "with b > a, or key=A,B.")
    for i, job in enumerate(jobs):  # bad input in any job stops the sweep before the first one starts
        try:
            resolve(recipe, job, for_training=True)
        except UserError as e:  # which job: its swept values (`-m loss=ce,chunked loss.num_chunks=2`: the ce one)
            keys = {o.partition("=")[0] for o in sweep_keys(overrides)}
            swept = " ".join(o for o in job if o.partition("=")[0] in keys)
            raise UserError(f"train -m job {i} ({swept}): {e.where}", e.reason, e.suggestion) from None
    extra = sweep_dir(recipe, overrides)
    codes, done = [], []

    def task(_cfg) -> int:
        hc = HydraConfig.get()
        log = Path(hc.runtime.output_dir) / f"{hc.job.name}.log"
        _drop_file_handlers(log)  # the job's whole output goes there instead (Hydra's handler logged nothing)
        try:
            with _tee_output(log):
                code = run_job(list(hc.overrides.task), hc.runtime.output_dir)
        finally:  # apiary's own composition renames Hydra's job; the next job's log is train.log again
            JobRuntime.instance().set("name", "train")
        codes.append(code)
        done.append((list(hc.overrides.task), hc.runtime.output_dir, code))
        return code

    h, name, base = hydra_for(recipe)
    # a recipe file that chooses a component in its own section (`loss: {name: chunked, num_chunks: 4}`): Hydra
    # composes each job itself, so the choice goes first as a group override, as recipes.load does for a run
    given = {o.lstrip("+~").partition("=")[0] for o in overrides}
    chosen, _ = recipe_files.file_group_choices(recipes.recipe_path(recipe or recipes.DEFAULT_RECIPE), [])
    chosen = [g for g in chosen if g.partition("=")[0] not in given]
    try:
        with _own_logging():
            h.multirun(config_name=name, task_function=task,
                       overrides=[*base, *extra, *chosen, *unset_to_null(overrides)])
    finally:
        GlobalHydra.instance().clear()
    sweep_table(done, [o.partition("=")[0] for o in sweep_keys(overrides)])
    return max(codes, default=0)


def sweep_keys(overrides: list[str]) -> list[str]:
    """The overrides of a command line that sweep (several values)."""
    plain = [o for o in overrides if not o.startswith("~") and not o.startswith("hydra.")]
    parsed = OverridesParser.create().parse_overrides(plain)
    return [raw for raw, ov in zip(plain, parsed) if ov.is_sweep_override()]


def sweep_table(done: list, keys: list[str]) -> None:
    """One line per job of a sweep, from each job's summary.json: its folder, the swept values, exit code,
    steps, loss (first -> last), last val_loss and mean tok/s."""
    if not done:
        return

    def num(v, fmt="{:.4f}"):
        return "-" if v is None else fmt.format(v)

    table = Table()
    for col in ("job", *(keys or ["overrides"]), "exit", "steps", "loss first -> last", "val_loss", "tok/s"):
        table.add_column(col, overflow="fold")
    for job, out, code in done:
        try:
            s = json.loads((Path(out) / "summary.json").read_text())
        except (OSError, ValueError):
            s = {}
        given = dict(o.partition("=")[::2] for o in job)
        values = [given.get(k, "") for k in keys] if keys else [" ".join(job)]
        loss = f"{num(s.get('loss_first'))} -> {num(s.get('loss_last'))}" if s.get("loss_last") is not None else "-"
        steps = f"{s['step']}/{s['total_steps']}" if s.get("step") is not None else "-"
        cells = [Path(out).name, *values, str(code), steps, loss, num(s.get("val_loss_last")),
                 num(s.get("tokens_per_s_mean"), "{:,.0f}")]
        table.add_row(*(Text(c) for c in cells))
    console = Console()
    console.print(f"sweep {Path(done[0][1]).parent}: {len(done)} job(s), one folder each", markup=False,
                  highlight=False, soft_wrap=True)
    Console(width=max(console.width, 120)).print(table)


def _drop_file_handlers(log: Path) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log.absolute():
            root.removeHandler(handler)
            handler.close()


@contextlib.contextmanager
def _tee_output(path: Path):
    """This process's stdout and stderr (file descriptors 1 and 2, so a job's torchrun and its ranks
    too) copied into ``path`` while the block runs, and still shown on the terminal."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    log = open(path, "ab")  # noqa: SIM115 (closed below, after the pumps)
    lock = threading.Lock()
    saved, pumps = {}, []

    def pump(read_fd: int, out_fd: int) -> None:
        while chunk := os.read(read_fd, 65536):
            os.write(out_fd, chunk)
            with lock:
                log.write(chunk)
                log.flush()
        os.close(read_fd)

    try:
        for fd in (1, 2):
            saved[fd] = os.dup(fd)
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(target=pump, args=(r, saved[fd]), daemon=True)
            t.start()
            pumps.append(t)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, orig in saved.items():
            os.dup2(orig, fd)  # the pipe's last writer closes: its pump reads the end
        for t in pumps:
            t.join(timeout=30)
        for orig in saved.values():
            os.close(orig)
        log.close()


# ------------------------------------------------------------------------------------ --help
def _type_name(t, f=None) -> str:
    if f is not None and "choices" in f.metadata:  # a schema `one_of` str key: its values
        return "|".join(f.metadata["choices"]) + ("|null" if type(None) in typing.get_args(t) else "")
    if isinstance(t, str):
        return t.replace("Optional[", "").rstrip("]") + ("|null" if t.startswith("Optional[") else "")
    names = contracts.choices(t)
    if names is not None:
        return "|".join(map(str, names)) + ("|null" if type(None) in typing.get_args(t) else "")
    args = typing.get_args(t)
    if type(None) in args:
        return "|".join(_type_name(a) for a in args if a is not type(None)) + "|null"
    return getattr(t, "__name__", str(t))


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return "???" if f.default == "???" else repr(f.default) if isinstance(f.default, str) else str(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return ""
    return "???"


def _keys(cls, prefix: str = "") -> list[str]:
    lines, docs = [], contracts.field_docs(cls)  # the comment on or above each field, or its string
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        hints = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(t):
            lines.extend(_keys(t, f"{prefix}{f.name}."))
            continue
        if t is typing.Any or f.name == "name" and prefix and "choices" not in f.metadata:  # a group's own name
            continue
        default = _default(f)
        head = f"{prefix}{f.name}: {_type_name(t, f)}" + (f" = {default}" if default else "")
        lines.append(f"  {head:<47}  {docs.get(f.name, '')}".rstrip())  # two spaces before the doc
    return lines


def help_text() -> str:
    out = [f"usage: {SYNOPSIS}", "",
           "Train a recipe. Overrides use Hydra's grammar: key=value, group=option, +key=value (as key=value), "
           "~key to unset an optional key (back to null: derived or off), key=A,B with -m to sweep. "
           "nproc=N is short for launcher.nproc=N.", "",
           "flags (Hydra's):",
           "  -m, --multirun        run every combination of the swept keys (Hydra's basic sweeper and launcher),",
           "                        one directory each under hydra.sweep.dir (default runs/RECIPE/multirun-TIME)",
           "  -c, --cfg job|hydra|all  print the resolved config (job: with the derived layout) and exit",
           "  --resolve             with --cfg: resolve interpolations before printing",
           "  -p, --package KEY     with --cfg: print only that part of the config",
           "  -i, --info [all|config|defaults|defaults-tree|plugins|searchpath]  Hydra's information",
           "  -r, --run             run one job (the default)",
           "  --hydra-help          Hydra's own help",
           "  --version             Hydra's version",
           "  -v, --verbose         log every step",
           "  -h, --help            this help", "",
           f"recipes (recipe=NAME or recipe=PATH.yaml; default {recipes.DEFAULT_RECIPE}): "
           + ", ".join(recipes.recipe_names()), "",
           "groups (registry.yaml; group=option chooses one, group.KEY=VALUE sets its options):"]
    for kind in registry.GROUP_KINDS:
        out.append(f"  {kind}:")
        for name in registry.names(kind):
            out.append(f"    {name:<12} {registry.doc(kind, name)}")
            opts = registry.options_of(kind, name)
            if opts is not None and dataclasses.is_dataclass(opts):
                keys = [ln.strip() for ln in _keys(opts, f"{kind}.")]
                if keys:
                    out.extend(f"                   {k}" for k in keys)
    for kind in (k for k in registry.entries() if k not in registry.GROUP_KINDS):
        names = ", ".join(registry.names(kind))
        out.append(f"  {kind} (a key's value): {names}")
    out += ["", "keys (framework/compose/schema.py; key: type = default  doc):", *_keys(RecipeConfig)]
    return "\n".join(out) + "\n"


def env_snapshot():
    """Restore the process environment after an in-process job (it sets RANK, MASTER_PORT, ...)."""
    saved = dict(os.environ)

    def restore():
        os.environ.clear()
        os.environ.update(saved)

    return restore
