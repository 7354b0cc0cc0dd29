"""Console scripts: `train` (Hydra's command line: framework/hydra_cli.py) and `apiary` (argparse
subcommands: ls, show, cp, plan, compare, launch, warmup, cp-template, export).

    train [recipe=NAME] [key=value | group=option | +key=value | ~key ...] [-m] [--cfg job|hydra|all] [-v]
    apiary ls | show NAME | cp NAME PATH | plan ... | compare KEY=A,B ... | launch ... | cp-template ... | export ...
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from framework.errors import UserError
from framework.hydra_cli import ALIASES  # noqa: F401  (compare and probe import it from here)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
console = Console(highlight=False, soft_wrap=True)


def _fail(e: UserError) -> int:
    err_console.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
    return e.exit_code


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def _print_cfg(r, args) -> None:
    """--cfg job|all: the resolved config (+ Hydra's section for all) and the derived layout."""
    from omegaconf import OmegaConf

    from framework import hydra_cli

    cfg = r.cfg
    if args.cfg in ("hydra", "all"):
        hydra = hydra_cli.hydra_cfg(args.recipe, args.overrides, args.resolve)
        if args.cfg == "hydra":
            cfg = hydra
        else:
            cfg = OmegaConf.merge(OmegaConf.to_container(r.cfg), hydra)
    if args.package not in (None, "_global_"):
        sel = OmegaConf.select(cfg, args.package)
        if sel is None:
            raise UserError(f"train --package {args.package}", "no such key in the config.",
                            "Run `train --cfg all` to see the keys.")
        console.print(f"# @package {args.package}", markup=False)
        cfg = sel
    if OmegaConf.is_config(cfg):
        console.print(OmegaConf.to_yaml(cfg, resolve=args.resolve), end="", markup=False)
    else:
        console.print(str(cfg), markup=False)
    if args.cfg != "hydra":
        console.print(f"# derived layout for {r.layout.world_size} GPUs:", markup=False)
        for dim, rule in r.layout.rules.items():
            console.print(f"#   {dim} = {r.layout.dims[dim]}: {rule}", markup=False)


def train_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from framework import hydra_cli, lifecycle

    if "TORCHELASTIC_RUN_ID" in os.environ:
        lifecycle.die_with_parent()  # torchrun killed outright: this worker dies with it
    try:
        try:
            args = hydra_cli.parse(argv)
        except SystemExit as e:  # --version: argparse printed it
            return int(e.code or 0)
        if args.help:
            console.print(hydra_cli.help_text(), end="", markup=False)
            return 0
        if args.hydra_help:
            h, name, base = hydra_cli.hydra_for(args.recipe)
            h.hydra_help(config_name=name, args_parser=hydra_cli.parser(), args=args)
            return 0
        recipe, overrides = args.recipe, args.overrides
        if args.multirun:
            if _under_torchrun():
                raise UserError("train -m", "a sweep is started once, not by each torchrun worker.",
                                "Run `train -m ...` without torchrun; nproc=N launches each job's ranks.")
            return hydra_cli.multirun(recipe, overrides, lambda job, out: _run_job(recipe, job, out, args.verbose))
        if args.info:
            from framework.resolve import resolve

            resolve(recipe, overrides, for_training=False)
            hydra_cli.info(recipe, overrides, args.info)
            return 0
        from framework.resolve import resolve

        if _under_torchrun() and not any(o.startswith("output_dir=") for o in overrides):
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
            overrides.append(f"output_dir=runs/{recipe or 'debug_moe'}/torchrun-{run_id}")
        r = resolve(recipe, overrides, for_training=args.cfg is None)
        if args.cfg:
            _print_cfg(r, args)
            return 0
    except UserError as e:
        return _fail(e)

    from framework import run

    if _under_torchrun():
        from framework import runlock

        try:
            lock = runlock.hold_in_worker(r.cfg.output_dir)  # rank 0 of a job no apiary parent started
        except UserError as e:
            return _fail(e)
        try:
            run.train(r, verbose=args.verbose)
        finally:
            if lock is not None:
                lock.release()
        return 0
    worker_argv = [a for a in argv if not a.startswith("output_dir=")] + [f"output_dir={r.cfg.output_dir}"]
    return _launch(r, worker_argv, args.verbose)


def _launch(r, worker_argv: list[str], verbose: bool) -> int:
    from framework import registry, run, runlock

    launcher = registry.resolve("launcher", r.cfg.launcher.name)
    try:  # one run per output_dir, checked before any worker starts
        if hasattr(launcher, "check_options"):
            launcher.check_options(r.cfg.launcher)
        lock = runlock.hold_for_launch(launcher, r.cfg.output_dir)
    except UserError as e:
        return _fail(e)
    if r.cfg.checkpoint.resume:  # the directory is fixed now; workers resume it
        worker_argv = [a for a in worker_argv if not a.startswith("checkpoint.resume")] + ["checkpoint.resume=true"]
    console.print(Text.assemble(("apiary", "bold"), f" {r.cfg.recipe}: {r.facts.family} {r.facts.flavor} "
                  f"({r.facts.n_params / 1e6:,.1f}M params), dims {r.layout.dims}, output {r.cfg.output_dir}"))

    def in_process():
        last = run.train(r, verbose=verbose)
        if last:
            console.print(f"done: step {last['step']} loss {last['loss']:.4f} -> {r.cfg.output_dir}", markup=False)
        return 0

    try:
        return launcher.launch(r.cfg.launcher, worker_argv, in_process, run.launch_env(r))
    finally:
        if lock is not None:
            lock.release()


def _run_job(recipe, job: list[str], output_dir: str, verbose: bool) -> int:
    """One job of a `train -m` sweep, in the directory Hydra's launcher made for it."""
    from framework import hydra_cli
    from framework.resolve import resolve

    restore = hydra_cli.env_snapshot()
    try:
        overrides = [o for o in job if not o.startswith("output_dir=")] + [f"output_dir={output_dir}"]
        r = resolve(recipe, overrides)
        worker_argv = ([f"recipe={recipe}"] if recipe else []) + overrides + (["-v"] if verbose else [])
        return _launch(r, worker_argv, verbose)
    finally:
        restore()


def _ls() -> int:
    from framework import recipes, registry

    t = Table(title="recipes", show_lines=False)
    t.add_column("name")
    t.add_column("description")
    import yaml

    for name in recipes.recipe_names():
        desc = (yaml.safe_load(recipes.recipe_path(name).read_text()) or {}).get("description", "")
        t.add_row(Text(name), Text(str(desc)))
    console.print(t)
    t = Table(title="registry (first name of each kind = baseline; `from`: registry.yaml or a user registry file)")
    for c in ("kind", "name", "target", "doc", "from"):
        t.add_column(c)
    for kind, names in registry.entries().items():
        for name, e in names.items():
            t.add_row(*map(Text, (kind, name, e["target"], e["doc"], e.get("source", "registry.yaml"))))
    console.print(t)
    return 0


def _show(name: str) -> int:
    from framework import recipes, registry

    if (Path(name) / "config.json").is_file():  # a HuggingFace model folder
        from framework.hf_show import show_hf

        return show_hf(name, console)
    if name in recipes.recipe_names() or name.endswith((".yaml", ".yml")):
        console.print(recipes.recipe_path(name).read_text(), markup=False, end="")
        return 0
    for kind, names in registry.entries().items():
        if name in names:
            e = names[name]
            console.print(f"{kind} {name}: {e['doc']}\n  target: {e['target']}\n  from: {e['source']}", markup=False)
            skill = registry.ROOT / "docs" / "skills" / f"{name}.md"
            if skill.is_file():
                console.print(f"  skill page: {skill}", markup=False)
            return 0
    from framework.errors import did_you_mean

    known = recipes.recipe_names() + [n for ns in registry.entries().values() for n in ns]
    raise UserError(f"apiary show {name}", "no recipe or registry name called that.",
                    did_you_mean(name, known) or "Run `apiary ls`.")


def _cp(name: str, dest: str) -> int:
    from framework import recipes

    src = recipes.recipe_path(name)
    d = Path(dest)
    if d.is_dir():
        d = d / src.name
    if d.exists():
        raise UserError(f"apiary cp {name} {dest}", f"{d} already exists; not overwriting it.",
                        "Choose another path or remove it first.")
    d.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, d)
    console.print(f"copied {src.name} -> {d}  (run it with `train recipe={d}`)", markup=False)
    return 0


def _export(run_dir: str, out: str) -> int:
    from omegaconf import OmegaConf

    from framework import registry

    cfg_path = Path(run_dir) / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"apiary export {run_dir}", "is not a run folder (no config.yaml).",
                        "Point it at runs/RECIPE/TIMESTAMP.")
    family = OmegaConf.load(cfg_path).model.family
    mod = registry.resolve("model", family)
    if not hasattr(mod, "export_hf"):
        raise UserError(f"apiary export {run_dir}", f"model.family={family} has no HF exporter.",
                        "Export exists for qwen3_5.")
    console.print(f"exported {run_dir} -> {mod.export_hf(run_dir, out)}", markup=False)
    return 0


APIARY_DESCRIPTION = """recipes, registry names, planning, A/B comparison, launching and export.
Each command's k=v arguments are recipe overrides in `train`'s grammar; `apiary COMMAND --help`
lists its options."""


def apiary_parser():
    """One argparse parser, one subparser per command (plan, compare, launch add their own flags)."""
    from framework import compare, launch_cli, plan_cli, warmup
    from framework.argparsing import Parser

    p = Parser(prog="apiary", description=APIARY_DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser, required=True)
    ls = sub.add_parser("ls", help="recipes and registry names with their docs and where each came from",
                        description="Recipes and registry names with their docs; `from` says which registry file "
                                    "bound each name (registry.yaml or a user file).")
    ls.add_argument("registry", nargs="*", metavar="registry=PATH",
                    help="also list a user registry file's names (as the APIARY_REGISTRY variable does)")
    show = sub.add_parser("show", help="a recipe's YAML, or a registry name's binding")
    show.add_argument("name", metavar="NAME", help="a recipe name or file, or a registry name")
    cp = sub.add_parser("cp", help="copy a recipe to edit it (then `train recipe=PATH`)")
    cp.add_argument("name", metavar="NAME", help="the recipe to copy")
    cp.add_argument("dest", metavar="PATH", help="a file or a folder; never overwritten")
    for name, mod, helptext in (
            ("plan", plan_cli, "derived dims, per-GPU memory by term, verdict, step time; --search ranks layouts"),
            ("compare", compare, "run variants of one key from one seed checkpoint side by side (--check, --json)"),
            ("launch", launch_cli, "check the recipe for a launcher's world size, then run it here or submit it"),
            ("warmup", warmup, "fill the kernel cache for a recipe's shapes on one device (2 steps, no checkpoint)")):
        doc = compare.USAGE if mod is compare else mod.__doc__
        hint = mod.parser().flags_hint
        sp = sub.add_parser(name, help=helptext, description=doc, flags_hint=hint)
        mod.add_arguments(sp)
        sp.set_defaults(flags_hint=hint, flag_where="argument {flag}" if name == "plan" else f"apiary {name} {{flag}}")
    cpt = sub.add_parser("cp-template", help="copy a launcher's script template (then launcher.template=PATH)")
    cpt.add_argument("launcher", metavar="LAUNCHER", help="a launcher with a template (slurm)")
    cpt.add_argument("dest", metavar="PATH", help="where to write it; never overwritten")
    ex = sub.add_parser("export", help="a run's latest checkpoint as a HuggingFace folder (qwen3_5)")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="runs/RECIPE/TIMESTAMP")
    ex.add_argument("--hf", required=True, metavar="OUT", help="the HuggingFace folder to write")
    return p


def apiary_main(argv: list[str] | None = None) -> int:
    from framework import argparsing

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        p = apiary_parser()
        if not argv or argv[0] == "help":
            p.print_help()
            return 0
        try:
            ns, extra = p.parse_known_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        cmd, rest = ns.cmd, argv[argv.index(ns.cmd) + 1:]
        if cmd in ("plan", "compare", "launch", "warmup"):
            argparsing.finish(ns, extra, f"apiary {cmd}", ns.flags_hint, ns.flag_where)
            if cmd == "plan":
                from framework.plan_cli import plan_args

                return plan_args(ns)
            if cmd == "compare":
                from framework.compare import compare_main

                return compare_main(rest, ns)
            if cmd == "warmup":
                from framework.warmup import warmup_args

                return warmup_args(ns)
            from framework.launch_cli import launch_args

            return launch_args(ns)
        if extra:
            raise UserError(f"apiary {cmd} {' '.join(extra)}", "unrecognized arguments.", f"See `apiary {cmd} --help`.")
        if cmd == "ls":
            from framework import registry

            for a in ns.registry:
                key, sep, val = a.partition("=")
                if key != "registry" or not sep:
                    raise UserError(f"apiary ls {a}", "takes only registry=PATH.", "See `apiary ls --help`.")
                registry.use(val, where=a)
            return _ls()
        if cmd == "show":
            return _show(ns.name)
        if cmd == "cp":
            return _cp(ns.name, ns.dest)
        if cmd == "cp-template":
            from framework.launch_cli import cp_template_main

            return cp_template_main([ns.launcher, ns.dest])
        return _export(ns.run_dir, ns.hf)
    except UserError as e:
        return _fail(e)


def _arm() -> None:
    """`train` from the command line: a signal while starting up exits 75 at once (no
    KeyboardInterrupt traceback); once training runs, it checkpoints first (framework/preempt.py)."""
    from framework import preempt

    preempt.arm()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("train", "apiary"):
        prog = sys.argv.pop(1)
        if prog == "train":
            _arm()
        sys.exit(train_main() if prog == "train" else apiary_main())
    sys.exit(apiary_main())


def train_entry() -> None:
    _arm()
    sys.exit(train_main())


def apiary_entry() -> None:
    sys.exit(apiary_main())


if __name__ == "__main__":
    main()
