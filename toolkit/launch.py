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
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from framework import contracts
from framework.compose import recipes, registry
from framework.compose.schema import RecipeConfig
from framework.errors import UserError, did_you_mean
from framework.launch import start
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
    """The shorthands expanded for the chosen launcher (named after the user registries are applied),
    then the one launch `train` runs too (framework/launch/start.py)."""
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
    except UserError as e:
        return _fail(e)
    return start.launch(recipe, overrides, dry_run="dry_run" in flags, verbose="verbose" in flags)


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
