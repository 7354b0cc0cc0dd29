"""A run's folder: where it writes, what a resume loads from it, and the folders that must stay apart.

    check(cfg) -> the step a resume loads (None: a fresh run)

runs the checks of a launch (a print-only resolve runs none).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

from framework.errors import UserError
from framework.resolve.inputs import what_is, writable_folder
from framework.train import integrity


def default_output_dir(recipe: str) -> str:
    return str(Path("runs") / recipe / time.strftime("%Y%m%d-%H%M%S"))


def latest_run_dir(recipe: str) -> Path | None:
    root = Path("runs") / recipe
    runs = [p for p in root.glob("*") if checkpoint_steps(p)] if root.is_dir() else []
    runs.sort(key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def sweep_jobs(recipe: str) -> list[Path]:
    """The job folders of the recipe's sweeps (``train -m``: runs/RECIPE/multirun-TIME/N) holding a checkpoint, the
    newest sweep first."""
    sweeps = sorted(Path("runs", recipe).glob("multirun-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [j for s in sweeps for j in sorted(s.iterdir(), key=lambda p: (len(p.name), p.name))
            if j.is_dir() and checkpoint_steps(j)]


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The complete checkpoint steps of a run (a save killed midway is never one)."""
    return integrity.complete_steps(Path(run_dir) / "checkpoint")


def _any_step_dir(run_dir: Path) -> bool:
    """Any checkpoint/step-N folder, complete or not: a fresh run must not overwrite either."""
    return bool(integrity.step_dirs(Path(run_dir) / "checkpoint"))


def check_outputs(cfg) -> int | None:
    """Resume only from an intact checkpoint; never silently reuse or overwrite one."""
    ck = cfg.checkpoint
    if ck.resume:
        if cfg.output_dir is None:
            latest = latest_run_dir(cfg.recipe)
            if latest is None:
                jobs = sweep_jobs(cfg.recipe)  # a sweep's job folders are never picked for the user: one of them
                raise UserError("checkpoint.resume=true", f"no earlier run of {cfg.recipe} with a checkpoint "
                                f"under runs/{cfg.recipe}/" + (" (a sweep's jobs are in its multirun-* folders, one "
                                                              "run each, resumed one at a time)." if jobs else "."),
                                "Pass output_dir=PATH of the run to continue" + (
                                    ": " + ", ".join(f"output_dir={j}" for j in jobs[:6])
                                    + (f" (and {len(jobs) - 6} more)" if len(jobs) > 6 else "") if jobs else "") + ".")
            cfg.output_dir = str(latest)
        if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
            raise UserError(f"output_dir={cfg.output_dir}", f"is {what_is(Path(cfg.output_dir))}, not a folder, so "
                            "it holds no run to resume.", "Pass output_dir=PATH of the run's folder "
                            "(runs/RECIPE/TIMESTAMP).")
        step = integrity.check_resume(Path(cfg.output_dir), ck.load_step, "checkpoint.resume=true",  # exit 2 if corrupt
                                      verify_manifest=bool(ck.verify))  # or unverifiable
        if step >= cfg.training.steps:
            raise UserError("checkpoint.resume=true", f"{cfg.output_dir} is already at step {step} of "
                            f"training.steps={cfg.training.steps}.", "Raise training.steps to train further.")
        ck.load_step = step  # torchtitan loads this verified step (its own pick, the newest, may hold the model only)
        return step
    else:
        if ck.load_step is not None:
            raise UserError(f"checkpoint.load_step={ck.load_step}", "picks the step a resume loads; this run "
                            "does not resume.", "Add checkpoint.resume=true (with output_dir=RUN), or drop it.")
        if cfg.output_dir is None:
            cfg.output_dir = default_output_dir(cfg.recipe)
        elif Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
            raise UserError(f"output_dir={cfg.output_dir}", f"is {what_is(Path(cfg.output_dir))}, not a folder; "
                            "the run writes config.yaml, metrics.jsonl and checkpoints into a folder there.",
                            "Choose another output_dir (a new or empty folder).")
        elif _any_step_dir(Path(cfg.output_dir)):
            raise UserError(f"output_dir={cfg.output_dir}", "already holds checkpoints of an earlier run; a fresh "
                            "run would load or overwrite them.", "Pass checkpoint.resume=true to continue it, or "
                            "choose another output_dir.")
        elif (other := _other_recipe(Path(cfg.output_dir), cfg.recipe)) is not None:
            raise UserError(f"output_dir={cfg.output_dir}", f"holds a run of another recipe ({other}: its config.yaml, "
                            "metrics.jsonl); this run would replace its config.yaml and move its metrics aside, "
                            "leaving one folder with two runs in it.", "Choose another output_dir (a new or empty "
                            "folder), or delete that run's folder first.")
        elif odd := integrity.step_like(Path(cfg.output_dir) / "checkpoint"):
            raise UserError(f"output_dir={cfg.output_dir}", f"{odd[0]} is named like a checkpoint step, and "
                            "torchtitan loads any name holding step-N in the checkpoint folder: a fresh run would "
                            "load it.", "Move it out of the checkpoint folder, or choose another output_dir.")


def _other_recipe(run_dir: Path, recipe) -> str | None:
    """The recipe of the run whose config.yaml ``run_dir`` holds, where it is not ``recipe`` (None: no run
    there, or one of the same recipe, which a fresh run of it may follow: its records are moved aside)."""
    try:
        held = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("recipe")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    return str(held) if held is not None and str(held) != str(recipe) else None


def check_overlaps(cfg) -> None:
    """The folders a run writes or reads must be apart: publish.dir (with publish.interval > 0), the
    run's checkpoint folder (OUTPUT_DIR/checkpoint, with checkpoint.enable) and data.path. Equal, or
    one inside the other, is refused (exit 2): published versions and checkpoints share the step-N
    names (a publish.keep prune deleted checkpoints, a republication replaced one, `latest` named a
    DCP folder), and a data folder holding either would be read, written and pruned together."""
    def where(path) -> Path:
        return Path(os.path.expanduser(str(path))).absolute().resolve()

    out = Path(str(cfg.output_dir))
    folders = []  # (name, the key to change, its folder, what it holds)
    if cfg.publish.interval > 0:
        pub = cfg.publish.dir if cfg.publish.dir is not None else out / "weights"
        folders.append(("publish", f"publish.dir={pub}", where(pub), "the published weights"))
    if cfg.checkpoint.enable:
        folders.append(("checkpoint", f"output_dir={cfg.output_dir}", where(out / "checkpoint"),
                        "the run's checkpoints"))
    if cfg.data.path is not None:
        folders.append(("data", f"data.path={cfg.data.path}", where(cfg.data.path), "the training data"))
    why = {("publish", "checkpoint"): "published versions and checkpoints would share the step-N names: pruning "
                                      "versions (publish.keep) would delete checkpoints, republishing a version "
                                      "would replace a checkpoint, and `latest` could name a checkpoint",
           ("publish", "data"): "publication would write and prune its step-N folders among the data, and the data "
                                "would be read together with the published files",
           ("checkpoint", "data"): "the checkpoints' files would be read as data, and saving and pruning "
                                   "checkpoints would write and delete among the data"}
    for i, (name_a, key_a, a, what_a) in enumerate(folders):
        for name_b, key_b, b, what_b in folders[i + 1:]:
            if a == b:
                how = f"{a} would hold both {what_a} and {what_b}"
            elif b in a.parents:
                how = f"{what_a} would go in {a}, inside {b}, which holds {what_b}"
            elif a in b.parents:
                how = f"{what_b} would go in {b}, inside {a}, which holds {what_a}"
            else:
                continue
            raise UserError(f"{key_a} {key_b}", f"{how}; {why[name_a, name_b]}.",
                            f"Keep them apart: point {key_a.split('=')[0]} or {key_b.split('=')[0]} elsewhere "
                            "(publish.dir left out is OUTPUT_DIR/weights; the checkpoints are OUTPUT_DIR/checkpoint).")


def check_writable(cfg) -> None:
    """output_dir (or its nearest existing parent) must be a folder this process can write."""
    writable_folder(cfg.output_dir, f"output_dir={cfg.output_dir}", "the run could save no config, metrics or checkpoint")


def check(cfg) -> int | None:
    """A launch's run folder: what it resumes (the step; None for a fresh run, whose folder is chosen
    here when not given), that it can be written, and the folders that must stay apart."""
    step = check_outputs(cfg)
    check_writable(cfg)
    check_overlaps(cfg)
    return step
