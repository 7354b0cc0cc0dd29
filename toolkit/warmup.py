"""`apiary warmup`: fill the kernel cache for a recipe's shapes on one GPU before a large launch.

    apiary warmup recipe=NAME [k=v ...] [-v]

It trains the recipe's first steps in this process, on one device, with the job's own overrides
(model, seq_len, loss, dtype: the shapes its kernels are compiled and tuned for), with
``training.steps=2``, ``checkpoint.enable=false`` and a temporary output directory (removed
afterwards); then prints what the cache holds (files and size, autotuning entries). Training then
finds the entries under the same ``training.kernel_cache`` (framework/train/kernel_cache.py). The
Slurm template runs it before the job's first step with ``launcher.warmup=true``.

An RL loop's recipe (one that follows a generator's rollouts, or publishes weights to an engine)
warms up on the packaged rollouts with publication off: the kernels see the same shapes
(``training.seq_len`` x ``training.local_batch`` rows of the same model), and no generator or engine
has to run beside it. Warmup says so in one line.

Refused: ``nproc``/``launcher.*`` other than one local process (warmup runs on one device; the
job's launcher options belong to `apiary launch`), and ``training.cache_autotuning=false`` (the
tuning results would not be kept). Per-rank shapes under context or tensor parallelism differ
from one device's; warm those up with the job itself.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rich.console import Console

from framework.compose import recipes, registry
from framework.compose.hydra_cli import ALIASES
from framework.errors import UserError
from framework.resolve.resolver import resolve
from framework.train import kernel_cache, run
from toolkit.argparsing import Parser, overrides_arg

console = Console(highlight=False, soft_wrap=True)
STEPS = 2
_SET = {"training.steps": str(STEPS), "checkpoint.enable": "false"}


def add_arguments(p) -> None:
    overrides_arg(p, help="recipe=NAME and the job's key=value overrides (Hydra's grammar)")
    p.add_argument("-v", "--verbose", action="store_true", help="torchtitan's INFO logs")


def parser():
    p = Parser(prog="apiary warmup", description=__doc__)
    add_arguments(p)
    return p


def _key(a: str) -> str:
    k = a.lstrip("+~").split("=", 1)[0]
    return ALIASES.get(k, k)


def warmup_overrides(words: list[str], output_dir: str) -> tuple[str | None, list[str], list[str]]:
    """(recipe, overrides for resolve, notes on what warmup replaced); UserError for refused keys."""
    out, notes = [], []
    recipe, words = recipes.split_recipe(words)
    for a in words:
        k = _key(a)
        val = a.split("=", 1)[1] if "=" in a else ""
        if k == "launcher.nproc" and val.strip() == "1":
            continue
        if k == "launcher" and val.strip() in registry.names("launcher") and \
                registry.resolve("launcher", val.strip()).RUNS_HERE:
            continue
        if k.startswith("launcher"):
            raise UserError(f"apiary warmup {a}", "warmup runs one local process on one device; launcher options "
                            "belong to the job.", "Drop it here and pass it to `apiary launch` or `train`.")
        if k in ("output_dir", "checkpoint.resume"):
            notes.append(f"{a} is not used (warmup writes to a temporary directory it removes)")
            continue
        if k.startswith("checkpoint.") and k not in _SET:  # the job's saves and loads (warmup has none)
            notes.append(f"{a} is not used (warmup saves and loads no checkpoint)")
            continue
        if k in _SET:
            if val != _SET[k]:
                notes.append(f"{a} -> {k}={_SET[k]} (warmup runs {STEPS} steps without checkpoints)")
            continue
        out.append(a)
    out += [f"{k}={v}" for k, v in _SET.items()] + [f"output_dir={output_dir}"]
    return recipe, out, notes


def loop_overrides(recipe: str | None, overrides: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, notes) that let an RL loop's recipe warm up alone: rollouts from the packaged file
    instead of a generator's folder, no publication (so no engine link and no vLLM import)."""
    cfg = recipes.load(recipe, overrides)
    extra, notes = [], []
    if cfg.data.follow:
        extra += ["data.follow=false", "data.path=null", "rl.max_lag=null"]
        notes.append(f"the job follows {cfg.data.path}; warmup trains on the packaged rollouts (same shapes; "
                     "this model did not sample them, so their mismatch and loss mean nothing)")
    if cfg.publish.interval > 0:
        extra += ["publish.interval=0"]
        notes.append("the job publishes its weights; warmup publishes none (no engine or generator needed)")
    return overrides + extra, notes


def cache_summary(dirs: dict[str, Path]) -> list[tuple[str, Path, int, int, int]]:
    """(name, dir, files, bytes, autotuning entries) for each cache directory."""
    rows = []
    for name, d in dirs.items():
        files = [p for p in d.rglob("*") if p.is_file()] if d.is_dir() else []
        rows.append((name, d, len(files), sum(p.stat().st_size for p in files),
                     sum(p.name.endswith(".autotune.json") for p in files)))
    return rows


def warmup_args(ns) -> int:
    tmp = tempfile.mkdtemp(prefix="apiary-warmup-")
    try:
        recipe, overrides, notes = warmup_overrides(ns.overrides, str(Path(tmp) / "run"))
        overrides, loop_notes = loop_overrides(recipe, overrides)
        notes += loop_notes
        r = resolve(recipe, overrides, world_size=1)
        if not r.cfg.training.cache_autotuning:
            raise UserError("apiary warmup training.cache_autotuning=false",
                            "the autotuning results would not be kept, so warmup would tune for nothing.",
                            "Leave training.cache_autotuning=true (the default).")
        if r.cfg.training.kernel_cache:
            problem = kernel_cache.unusable(Path(r.cfg.training.kernel_cache).expanduser().resolve())
            if problem:
                raise UserError(f"apiary warmup training.kernel_cache={r.cfg.training.kernel_cache}",
                                f"cannot hold the cache ({problem}).", "Give a writable directory.")
        from framework import devices  # reason: start-up time of the CLI (devices imports torch)

        if not devices.has_accelerator():
            notes.append("this machine has no GPU: nothing is compiled or tuned for one here; run warmup where "
                         "the job runs (or on a machine with the same GPU and a shared training.kernel_cache)")
        for n in notes:
            console.print(f"warmup: {n}", markup=False)
        kernel_cache.configure(r.cfg.training.kernel_cache, r.cfg.training.cache_autotuning)  # run.train's too
        before = {name: files for name, _, files, _, _ in cache_summary(kernel_cache.cache_dirs())}
        # sets the cache variables, as every launcher's workers do; no summary (its run folder is temporary)
        run.train(r, verbose=ns.verbose, report=False)
        console.print(f"warmup: {r.cfg.recipe} trained {STEPS} steps at seq_len {r.cfg.training.seq_len}; "
                      "kernel cache:", markup=False)
        for name, d, files, size, tuned in cache_summary(kernel_cache.cache_dirs()):
            console.print(f"  {name:8s} {d}: {files} files ({files - before.get(name, 0):+d}), "
                          f"{size / 2**20:.1f} MiB, {tuned} autotuning results", markup=False)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
