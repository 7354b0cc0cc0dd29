"""The `apiary` console script: one argparse parser with a subparser per command.

    apiary ls | show NAME | cp NAME PATH | plan ... | compare KEY=A,B ... | launch ... | warmup ...
           | cp-template LAUNCHER PATH | export RUN_DIR --hf OUT [--step N] [--dtype D] | autotune-table KERNEL_CACHE --out FILE
           | logprobs MODEL ROLLOUTS --out DIR [--step N] [--temperature T] | plot RUN [RUN ...] [--out FILE]

Each command's k=v arguments are recipe overrides in `train`'s grammar (framework.cli, Hydra).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import sys
import warnings
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from rich.table import Table
from rich.text import Text

from framework import compat, contracts
from framework.cli import _fail, console
from framework.compose import recipes, registry
from framework.errors import UserError, did_you_mean
from framework.launch import pipes
from framework.report import no_step
from framework.resolve.inputs import writable_folder
from framework.train import autotune_table, integrity
from toolkit import argparsing, compare, launch, logprobs, plan, warmup


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A table on stdout: rich's in a terminal; piped or redirected, plain aligned text with every row
    whole on one line (rich fitted the table to 80 columns there and cut cells with an ellipsis)."""
    if console.is_terminal:
        t = Table(title=title)
        for c in columns:
            t.add_column(c)
        for row in rows:
            t.add_row(*map(Text, row))
        console.print(t)
        return
    rows = [tuple(" ".join(str(v).split()) for v in row) for row in rows]
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    console.print(title, markup=False, soft_wrap=True)
    for row in [columns, *rows]:
        console.print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip(), markup=False, soft_wrap=True)


def _ls() -> int:
    kinds = registry.entries()  # a bad user registry (APIARY_REGISTRY) stops here, before any table is printed
    _table("recipes", ("name", "description"),
           [(name, str((yaml.safe_load(recipes.recipe_path(name).read_text()) or {}).get("description", "")))
            for name in recipes.recipe_names()])
    console.print()
    _table("registry (first name of each kind = baseline; `from`: registry.yaml or a user registry file)",
           ("kind", "name", "target", "doc", "from"),
           [(kind, name, e["target"], e["doc"], e.get("source", "registry.yaml"))
            for kind, names in kinds.items() for name, e in names.items()])
    return 0


def _show(name: str) -> int:
    if (Path(name) / "config.json").is_file():  # a HuggingFace model folder
        from toolkit.show import show_hf  # reason: start-up time (it resolves a recipe: torch, torchtitan)

        return show_hf(name, console)
    if name in recipes.recipe_names() or name.endswith((".yaml", ".yml")):
        console.print(recipes.recipe_path(name, "`apiary show {}`").read_text(), markup=False, end="")
        return 0
    _not_a_run_folder(name)
    found = [(kind, names[name]) for kind, names in registry.entries().items() if name in names]
    for kind, e in found:  # a name may be bound in several kinds (none, auto): each binding
        console.print(f"{kind} {name}: {e['doc']}\n  target: {e['target']}\n  from: {e['source']}", markup=False)
        skill = registry.skill_page(kind, name)
        if skill.is_file():
            shown = skill.relative_to(registry.ROOT) if skill.is_relative_to(registry.ROOT) else skill
            console.print(f"  skill page: {shown}", markup=False)
    if found:
        return 0
    known = recipes.recipe_names() + [n for ns in registry.entries().values() for n in ns]
    page = registry.ROOT / "docs" / "skills" / f"{name}.md"  # a topic, not a component: its page (`apiary show tis`)
    raise UserError(f"apiary show {name}", "no recipe or registry name called that" + (
        f"; it is a skill page: {page.relative_to(registry.ROOT)}" if page.is_file() else "") + ".",
        "Read it, or run `apiary ls` for the names apiary show takes." if page.is_file()
        else f"Did you mean `apiary show {name}.yaml` (a file in this folder)?" if Path(f"{name}.yaml").is_file()
        else did_you_mean(name, known) or "Run `apiary ls`.")


def _not_a_run_folder(name: str) -> None:
    """A training run's folder (config.yaml, checkpoint/step-N; was: "no recipe or registry name called
    that"): said, with the commands that read one."""
    run = Path(name)
    if not ((run / "config.yaml").is_file() or (run / "checkpoint").is_dir()):
        return
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoint").glob("step-*") if p.name[5:].isdigit())
    held = f", checkpoints step-{steps[0]}" + (f" to step-{steps[-1]}" if len(steps) > 1 else "") if steps else ""
    raise UserError(f"apiary show {name}", f"is a training run's folder (its settings in config.yaml{held}), not a "
                    "recipe or registry name, which is what apiary show prints.",
                    f"Its weights as a HuggingFace model: `apiary export {name} --hf OUT` (then `apiary show OUT`); "
                    f"its model's log-probs for rollouts: `apiary logprobs {name} ROLLOUTS --out DIR`; its curves: "
                    f"`apiary plot {name}`; its settings: {run / 'config.yaml'}.")


def _cp(name: str, dest: str) -> int:
    src = recipes.recipe_path(name)
    d = Path(dest)
    if d.is_dir():
        d = d / src.name
    if d.suffix != ".yaml":  # was: copied, then `train recipe=mine.txt` refused the printed command
        raise UserError(f"apiary cp {name} {dest}", f"a recipe file is read by Hydra, which finds only files named "
                        f"*.yaml, and {d.name} ends in {d.suffix or 'no suffix'}.", f"Name it {d.with_suffix('.yaml')}.")
    if d.exists():
        raise UserError(f"apiary cp {name} {dest}", f"{d} already exists; not overwriting it.",
                        "Choose another path or remove it first.")
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, d)
    except OSError as e:
        raise UserError(f"apiary cp {name} {dest}", f"cannot write {d}: {e.strerror or e}.",
                        "Choose a path in a folder you can write.") from None
    console.print(f"copied {src.name} -> {d}  (run it with `train recipe={d}`)", markup=False)
    return 0


EXPORT_DTYPES = ("bfloat16", "float16", "float32")  # `apiary export --dtype` (the default first)


def _takes(fn, *names: str) -> bool:
    """``fn`` accepts these keyword arguments (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    return all(n in params for n in names) or any(p.kind is p.VAR_KEYWORD for p in params.values())


@contextlib.contextmanager
def _one_process_dcp():
    """Export and logprobs read a checkpoint in this one process on purpose: DCP's UserWarning that it assumes so
    ("torch.distributed is disabled, ...") is silenced (was: printed on every export)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _export(run_dir: str, out: str, merged: bool = False, unverified: bool = False, step: int | None = None,
            dtype: str | None = None) -> int:
    cfg_path = Path(run_dir) / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"apiary export {run_dir}", "is not a run folder (no config.yaml).",
                        "Point it at runs/RECIPE/TIMESTAMP.")
    steps = {n: d for n, d in integrity.step_dirs(Path(run_dir) / "checkpoint").items() if (d / ".metadata").is_file()}
    cut = [f"checkpoint/step-{n}" for n in integrity.step_dirs(Path(run_dir) / "checkpoint") if n not in steps]
    if not steps and cut:  # was: "Train with checkpoint.enable=true first", for a run that did
        raise UserError(f"apiary export {run_dir}", f"holds no complete checkpoint: {', '.join(cut)} has no .metadata "
                        "(a save cut short, or a damaged step), and DCP cannot read a step without it.",
                        "Nothing can be exported from this run; train again (a fresh run in another output_dir).")
    if step is not None and not steps:  # was: "Train with checkpoint.enable=true first", for a run that had it on
        raise UserError(f"apiary export {run_dir} --step {step}", *no_step.refusal(run_dir))
    if step is not None and step not in steps:
        raise UserError(f"apiary export {run_dir} --step {step}", "no complete checkpoint of that step; complete: "
                        f"{', '.join(map(str, steps))}.", "Pick one of those steps.")
    if steps:  # the step every exporter takes (--step, else the latest with DCP's .metadata), checked against its manifest
        integrity.check_step(steps[max(steps) if step is None else step], f"apiary export {run_dir}",
                             unverified_ok=unverified, override="--unverified", fresh="train again",
                             pick="Export step {n}, the previous complete one, with --step {n} (it is verified the "
                                  "same way)")
    logprobs.run_folder_paths(Path(run_dir), OmegaConf.load(cfg_path), f"apiary export {run_dir}")
    family = OmegaConf.load(cfg_path).model.family
    mod = registry.resolve("model", family)
    export = contracts.member(mod, "model", "export_hf")
    if export is None:
        raise UserError(f"apiary export {run_dir}", f"model.family={family} has no HF exporter.",
                        "A model family exports by defining export_hf(run_dir, out_path, *, step, dtype, shard_bytes), "
                        "as the shipped ones (qwen3, llama3, qwen3_5) do.")
    adapter = str(OmegaConf.select(OmegaConf.load(cfg_path), "adapter.name", default="none") or "none")
    if merged and adapter == "none":
        raise UserError(f"apiary export {run_dir} --merged", "folds adapters into their base, and this run trained "
                        "every weight without adapters (adapter=none).", "Drop --merged: the export is the full model.")
    if adapter != "none" and (dtype is not None or (step is not None and step != max(steps))):
        flag = f"--dtype {dtype}" if dtype is not None else f"--step {step}"
        raise UserError(f"apiary export {run_dir} {flag}", f"the run trained adapters (adapter={adapter}), whose "
                        "exporter writes the latest step in its own dtypes (the adapters as trained; with --merged, "
                        "the merged model in float32).", f"Drop {flag.split()[0]}.")
    if adapter == "none" and not _takes(export, "step", "dtype", "shard_bytes"):
        raise UserError(f"apiary export {run_dir}", f"model.family={family}'s export_hf takes no step, dtype and "
                        "shard_bytes keywords, so it cannot export a chosen step streamed in shards.",
                        "Give it export_hf(run_dir, out_path, *, step=None, dtype='bfloat16', shard_bytes=None), as "
                        "the shipped families have (framework/contracts/protocols.py ModelFamily).")
    dest = Path(out)
    if dest.is_dir() and any(dest.iterdir()):  # (a file: writable_folder names it)
        raise UserError(f"apiary export {run_dir} --hf {out}", "is not an empty folder; exporting there would "
                        "overwrite or mix with what it holds.", "Choose a new folder (it is created), or empty this one.")
    writable_folder(dest, f"apiary export {run_dir} --hf {out}", "nothing could be exported")
    if not steps:  # none saved: why, from the run's files (was: "Train with checkpoint.enable=true first")
        raise UserError(f"apiary export {run_dir}", *no_step.refusal(run_dir))
    from framework.train import published  # reason: start-up time (imports torch)

    what = ""
    if adapter != "none":  # the adapter component writes its own format (PEFT's), or the merged model
        export_adapter = contracts.member(registry.resolve("adapter", adapter), "adapter", "export_hf")
        if export_adapter is None:
            raise UserError(f"apiary export {run_dir}", f"adapter={adapter} has no exporter (export_hf).",
                            "An adapter exports by defining export_hf(run_dir, out_path, family, merged=...), as "
                            "lora does (framework/contracts/members.py OPTIONAL_MEMBERS).")
        with _one_process_dcp():
            folder, what = export_adapter(run_dir, out, mod, merged=merged)
        if not (Path(folder) / "config.json").is_file():
            console.print(f"exported {run_dir} -> {folder} ({what})", markup=False)
            return 0
        what = f"{what}; "
    else:  # streamed a layer at a time, in publication's shards
        dtype = dtype or EXPORT_DTYPES[0]
        with _one_process_dcp():
            folder = Path(export(run_dir, out, step=step, dtype=dtype, shard_bytes=published.SHARD_BYTES))
        shards = len(list(folder.glob("model-*-of-*.safetensors"))) or 1
        what = f"step {max(steps) if step is None else step}, {dtype}, {shards} safetensors file{'s' * (shards > 1)}; "
    # the tokenizer files and generation_config.json beside the weights
    cfg = OmegaConf.load(cfg_path)
    tok = str(cfg.data.tokenizer)
    tok_dir = tok if Path(tok).is_dir() else None
    copied = published.add_hf_extras(folder, json.loads((folder / "config.json").read_text()), tok_dir)
    byte = "no tokenizer files: the run used the byte-level tokenizer (ids 0-255 are UTF-8 bytes, then BOS and EOS)"
    note = (f"tokenizer files from {tok}: {', '.join(copied)}" if copied else byte if tok == "byte"
            else f"no tokenizer files found in data.tokenizer={tok}")
    console.print(f"exported {run_dir} -> {folder} ({what}{note})", markup=False)
    return 0


def _autotune_table(cache: str, out: str) -> int:
    root = Path(cache)
    if not root.is_dir():
        raise UserError(f"apiary autotune-table {cache}", "is not a folder.",
                        "Give the training.kernel_cache of a run with training.autotune_configs=all.")
    kernels = autotune_table.export(root)
    if not kernels:
        raise UserError(f"apiary autotune-table {cache}", "holds no Triton autotuning results (*.autotune.json).",
                        "Run the recipe with training.autotune_configs=all training.kernel_cache=" + cache
                        + " (training.cache_autotuning=true keeps the results) first.")
    autotune_table.write(kernels, Path(out), source=f"apiary autotune-table {cache}")
    t = Table(title=f"{out}: configs kept per kernel and key")
    for c in ("kernel", "keys", "configs kept"):
        t.add_column(c)
    for name, keys in kernels.items():
        t.add_row(Text(name), str(len(keys)), ", ".join(str(len(v)) for v in keys.values()))
    console.print(t)
    return 0


APIARY_DESCRIPTION = """recipes, registry names, planning, A/B comparison, launching and export.
Each command's k=v arguments are recipe overrides in `train`'s grammar; `apiary COMMAND --help`
lists its options."""

# The commands with their own flags: (name, module with add_arguments/parser, one-line help).
TOOLS = (
    ("plan", plan, "derived dims, per-GPU memory by term, verdict, step time; --search ranks layouts"),
    ("compare", compare, "run variants of one key from one seed checkpoint side by side (--check, --json)"),
    ("launch", launch, "check the recipe for a launcher's world size, then run it here or submit it"),
    ("warmup", warmup, "fill the kernel cache for a recipe's shapes on one device (2 steps, no checkpoint)"),
)


def apiary_parser() -> argparsing.Parser:
    """One argparse parser, one subparser per command (plan, compare, launch, warmup add their own flags)."""
    p = argparsing.Parser(prog="apiary", description=APIARY_DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=argparsing.Parser, required=True)
    ls = sub.add_parser("ls", help="recipes and registry names with their docs and where each came from",
                        description="Recipes and registry names with their docs; `from` says which registry file "
                                    "bound each name (registry.yaml or a user file).")
    ls.add_argument("registry", nargs="*", metavar="registry=PATH",
                    help="also list a user registry file's names (as the APIARY_REGISTRY variable does)")
    show = sub.add_parser("show", help="a recipe's YAML, a registry name's binding, or an HF folder's model")
    show.add_argument("name", metavar="NAME", help="a recipe name or file, a registry name, or a HuggingFace model "
                      "folder (its architecture and the planner's memory for it)")
    show.add_argument("registry", nargs="*", metavar="registry=PATH", help="a user registry file that binds NAME")
    cp = sub.add_parser("cp", help="copy a recipe to edit it (then `train recipe=PATH`)")
    cp.add_argument("name", metavar="NAME", help="the recipe to copy")
    cp.add_argument("dest", metavar="PATH", help="a file or a folder; never overwritten")
    for name, mod, helptext in TOOLS:
        doc = compare.USAGE if mod is compare else mod.__doc__
        hint = mod.parser().flags_hint
        sp = sub.add_parser(name, help=helptext, description=doc, flags_hint=hint)
        mod.add_arguments(sp)
        sp.set_defaults(flags_hint=hint, flag_where="argument {flag}" if name == "plan" else f"apiary {name} {{flag}}")
    cpt = sub.add_parser("cp-template", help="copy a launcher's script template (then launcher.template=PATH)")
    cpt.add_argument("launcher", metavar="LAUNCHER", help="a launcher with a template (slurm)")
    cpt.add_argument("dest", metavar="PATH", help="where to write it; never overwritten")
    at = sub.add_parser("autotune-table", help="record Triton's autotuning winners from a kernel cache as a table",
                        description="Read the autotuning results Triton kept under KERNEL_CACHE (a run with "
                                    "training.autotune_configs=all training.kernel_cache=KERNEL_CACHE, e.g. `apiary "
                                    "warmup`) and write, per kernel and tuning key, the configs within 2% of the fastest "
                                    "(at most 2): the table training.autotune_configs=recorded reads "
                                    "(framework/train/autotune_tables/ARCH.json; framework/train/autotune_table.py).")
    at.add_argument("cache", metavar="KERNEL_CACHE", help="a training.kernel_cache folder or a Triton cache folder")
    at.add_argument("--out", required=True, metavar="FILE", help="the table to write (never merged: replaced)")
    ex = sub.add_parser("export", help="a run's checkpoint as a HuggingFace folder",
                        description="Write a run's checkpoint (the latest complete one, or --step N) as a HuggingFace "
                                    "folder: streamed a layer at a time, in safetensors shards of at most 5 GiB "
                                    "(model-0000i-of-0000n.safetensors + model.safetensors.index.json), bfloat16 "
                                    "unless --dtype says otherwise. A run that trained adapters writes its "
                                    "adapter's format (docs/skills/lora.md).")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="runs/RECIPE/TIMESTAMP")
    ex.add_argument("--hf", required=True, metavar="OUT", help="the HuggingFace folder to write")
    ex.add_argument("--merged", action="store_true",
                    help="an adapter run (adapter=lora): the base with the adapters folded in, instead of PEFT's "
                         "adapter folder (docs/skills/lora.md)")
    ex.add_argument("--step", type=int, default=None, metavar="N",
                    help="the checkpoint step to export (default: the latest complete one)")
    ex.add_argument("--dtype", choices=EXPORT_DTYPES, default=None,
                    help="the weights' dtype in the folder (default bfloat16; float32 keeps the checkpoint's fp32 "
                         "master weights bit for bit)")
    ex.add_argument("--unverified", action="store_true",
                    help="export a step that has no manifest.json, unverified (refused otherwise)")
    lp = sub.add_parser("logprobs", help="a reference model's token log-probs into rollouts (ref_logprobs)",
                        description=logprobs.__doc__)
    logprobs.add_arguments(lp)
    from toolkit import plot  # reason: start-up time (its matplotlib loads inside plot.run only)

    pl = sub.add_parser("plot", help="one PNG of runs' metrics over steps (loss, grad norm, tokens/s, memory)",
                        description=plot.__doc__)
    plot.add_arguments(pl)
    return p


def apiary_main(argv: list[str] | None = None) -> int:
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
                return plan.plan_args(ns)
            if cmd == "compare":
                return compare.compare_main(rest, ns)
            if cmd == "warmup":
                return warmup.warmup_args(ns)
            return launch.launch_args(ns)
        if extra:
            raise UserError(f"apiary {cmd} {' '.join(extra)}", "unrecognized arguments.", f"See `apiary {cmd} --help`.")
        for a in getattr(ns, "registry", ()):  # ls and show: a user registry file's names too
            key, sep, val = a.partition("=")
            if key != "registry" or not sep:
                raise UserError(f"apiary {cmd} {a}", "takes only registry=PATH.", f"See `apiary {cmd} --help`.")
            registry.use(val, where=a)
        if cmd == "ls":
            return _ls()
        if cmd == "show":
            return _show(ns.name)
        if cmd == "cp":
            return _cp(ns.name, ns.dest)
        if cmd == "cp-template":
            return launch.cp_template_main([ns.launcher, ns.dest])
        if cmd == "autotune-table":
            return _autotune_table(ns.cache, ns.out)
        if cmd == "logprobs":
            with _one_process_dcp():  # a run folder's checkpoint is read in this one process
                return logprobs.logprobs_args(ns)
        if cmd == "plot":
            from toolkit import plot  # reason: start-up time (matplotlib, inside plot.run)

            return plot.run(ns)
        return _export(ns.run_dir, ns.hf, ns.merged, ns.unverified, ns.step, ns.dtype)
    except UserError as e:
        return _fail(e)


def apiary_entry() -> None:
    compat.route_broken_pipe(pipes.on_broken_pipe)  # `apiary ls | head`: every console ends it quietly, 141
    try:
        code = apiary_main()
        sys.stdout.flush()
    except BrokenPipeError:  # a plain print's
        pipes.quiet_exit()
    sys.exit(code)


if __name__ == "__main__":
    apiary_entry()
