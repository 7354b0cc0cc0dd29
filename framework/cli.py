"""Console scripts: `train` (Hydra override grammar) and `apiary` (ls, show, cp).

    train [recipe=NAME] [key=value | group=option | +key=value | ~key ...] [--cfg job] [-v]
    apiary ls | show NAME | cp NAME PATH | compare KEY=A,B ... | plan ... | launch ... | cp-template ...
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from framework.errors import UserError

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
console = Console(highlight=False, soft_wrap=True)

# Short spellings accepted on the command line, rewritten to their full keys.
ALIASES = {"nproc": "launcher.nproc"}


def _split_args(argv: list[str]):
    recipe, flags, overrides = None, set(), []
    it = iter(argv)
    for a in it:
        if a.startswith("recipe="):
            recipe = a.split("=", 1)[1]
        elif a == "--cfg":
            flags.add("cfg:" + next(it, "job"))
        elif a.startswith("--cfg="):
            flags.add("cfg:" + a.split("=", 1)[1])
        elif a in ("-v", "--verbose"):
            flags.add("verbose")
        elif a in ("-h", "--help"):
            flags.add("help")
        elif a.startswith("-"):
            raise UserError(f"argument {a}", "unknown flag.", "Flags: --cfg job, -v/--verbose, -h/--help.")
        else:
            key, sep, val = a.partition("=")
            overrides.append(f"{ALIASES.get(key, key)}{sep}{val}" if sep else a)
    return recipe, flags, overrides


def _fail(e: UserError) -> int:
    err_console.print(f"[bold red]error[/bold red] {e}", soft_wrap=True)
    return e.exit_code


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def train_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from framework import lifecycle, runlock

    if "TORCHELASTIC_RUN_ID" in os.environ:
        lifecycle.die_with_parent()  # torchrun killed outright: this worker dies with it
    try:
        recipe, flags, overrides = _split_args(argv)
        if "help" in flags:
            console.print(__doc__)
            return 0
        from framework.resolve import resolve
        from omegaconf import OmegaConf

        if _under_torchrun() and not any(o.startswith("output_dir=") for o in overrides):
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
            overrides.append(f"output_dir=runs/{recipe or 'debug_moe'}/torchrun-{run_id}")
        r = resolve(recipe, overrides, for_training="cfg:job" not in flags)
        if "cfg:job" in flags:
            console.print(OmegaConf.to_yaml(r.cfg), end="", markup=False)
            console.print(f"# derived layout for {r.layout.world_size} GPUs:", markup=False)
            for dim, rule in r.layout.rules.items():
                console.print(f"#   {dim} = {r.layout.dims[dim]}: {rule}", markup=False)
            return 0
    except UserError as e:
        return _fail(e)

    from framework import registry, run

    if _under_torchrun():
        try:
            lock = runlock.hold_in_worker(r.cfg.output_dir)  # rank 0 of a job no apiary parent started
        except UserError as e:
            return _fail(e)
        try:
            run.train(r, verbose="verbose" in flags)
        finally:
            if lock is not None:
                lock.release()
        return 0
    launcher = registry.resolve("launcher", r.cfg.launcher.name)
    try:  # one run per output_dir, checked before any worker starts
        if hasattr(launcher, "check_options"):
            launcher.check_options(r.cfg.launcher)
        lock = runlock.hold_for_launch(launcher, r.cfg.output_dir)
    except UserError as e:
        return _fail(e)
    worker_argv = [a for a in argv if not a.startswith("output_dir=")] + [f"output_dir={r.cfg.output_dir}"]
    if r.cfg.checkpoint.resume:  # the directory is fixed now; workers resume it
        worker_argv = [a for a in worker_argv if not a.startswith("checkpoint.resume")] + ["checkpoint.resume=true"]
    console.print(f"[bold]apiary[/bold] {r.cfg.recipe}: {r.facts.family} {r.facts.flavor} "
                  f"({r.facts.n_params / 1e6:,.1f}M params), dims {r.layout.dims}, output {r.cfg.output_dir}")

    def in_process():
        last = run.train(r, verbose="verbose" in flags)
        if last:
            console.print(f"done: step {last['step']} loss {last['loss']:.4f} -> {r.cfg.output_dir}")
        return 0

    try:
        return launcher.launch(r.cfg.launcher, worker_argv, in_process)
    finally:
        if lock is not None:
            lock.release()


def _ls() -> int:
    from framework import recipes, registry

    t = Table(title="recipes", show_lines=False)
    t.add_column("name")
    t.add_column("description")
    import yaml

    for name in recipes.recipe_names():
        desc = (yaml.safe_load(recipes.recipe_path(name).read_text()) or {}).get("description", "")
        t.add_row(name, desc)
    console.print(t)
    t = Table(title="registry.yaml (first name of each kind = baseline)")
    for c in ("kind", "name", "target", "doc"):
        t.add_column(c)
    for kind, names in registry.entries().items():
        for name, e in names.items():
            t.add_row(kind, name, e["target"], e["doc"])
    console.print(t)
    return 0


def _show(name: str) -> int:
    from framework import recipes, registry

    if name in recipes.recipe_names() or name.endswith((".yaml", ".yml")):
        console.print(recipes.recipe_path(name).read_text(), markup=False, end="")
        return 0
    for kind, names in registry.entries().items():
        if name in names:
            e = names[name]
            console.print(f"{kind} {name}: {e['doc']}\n  target: {e['target']}", markup=False)
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
    console.print(f"copied {src.name} -> {d}  (run it with `train recipe={d}`)")
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


APIARY_USAGE = """usage: apiary COMMAND
  ls                 recipes and registry names with their docs
  show NAME          a recipe's YAML, or a registry name's binding
  cp NAME PATH       copy a recipe to edit it (then `train recipe=PATH`)
  launch [recipe=X] [launcher=slurm nodes=N gpus_per_node=G | launcher=local nproc=N] [k=v ...] [--dry-run] [--wait]
                     check the recipe for that world size, then run it here or submit it to Slurm
  cp-template LAUNCHER PATH   copy a launcher's script template (then launcher.template=PATH)
  export RUN_DIR --hf OUT   latest checkpoint as a HuggingFace folder (qwen3_5)
  compare KEY=A,B    run variants from one seed checkpoint side by side (--check, --json)
  plan recipe=X [gpus=N] [gpu_memory=80GiB] [k=v ...] [--json] [--search]
                     derived dims, per-GPU memory by term, verdict, step time (apiary plan -h)
"""


def apiary_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help", "help"):
            console.print(APIARY_USAGE, markup=False)
            return 0
        cmd, rest = argv[0], argv[1:]
        if cmd == "ls":
            return _ls()
        if cmd == "show" and len(rest) == 1:
            return _show(rest[0])
        if cmd == "cp" and len(rest) == 2:
            return _cp(*rest)
        if cmd == "launch":
            from framework.launch_cli import launch_main

            return launch_main(rest)
        if cmd == "cp-template":
            from framework.launch_cli import cp_template_main

            return cp_template_main(rest)
        if cmd == "export" and len(rest) == 3 and rest[1] == "--hf":
            return _export(rest[0], rest[2])
        if cmd == "compare":
            from framework.compare import compare_main

            return compare_main(rest)
        if cmd == "plan":
            from framework.plan_cli import plan_main

            return plan_main(rest)
        raise UserError(f"apiary {' '.join(argv)}", "unknown command or wrong arguments.",
                        APIARY_USAGE.replace("\n", " ").strip())
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
