"""The overrides a resume command repeats (the end-of-run summary prints the command): the run's
launch, as given, which the hand-off carries to rank 0 (``Resolved.launch``) and the run folder keeps
(``launches.jsonl``); nothing is composed again.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from omegaconf import OmegaConf

from framework.resolve import resume
from framework.train import integrity

# keys a resume command sets itself, or that follow from the recipe
_NOT_REPEATED = ("output_dir", "training.steps", "checkpoint.resume", "checkpoint.load_step", "recipe", "description",
                 "checkpoint.verify")  # checkpoint.verify=false: one load's opt-in, never carried on


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _new_run_dir(out: str, step: str) -> str:
    """The new run's folder: the run's own name with ``-from-STEP`` in place of the suffixes earlier new runs
    added (a chain of weights-only runs names the last step once, not ``-from-step-2-from-step-2``), numbered
    when that folder exists already."""
    stem = re.sub(r"(-from-step-\d+)+(-\d+)?$", "", out)
    new, n = f"{stem}-from-{step}", 2
    while new == out or Path(new).exists():
        new, n = f"{stem}-from-{step}-{n}", n + 1
    return new


def launch_steps(launch: dict | None) -> list[str]:
    """The launch's own ``training.steps=N`` (the last given), which a new run from the weights repeats."""
    given = [o for o in (launch or {}).get("overrides") or [] if isinstance(o, str) and _key(o) == "training.steps"]
    return given[-1:]


def run_overrides(launch: dict | None) -> list[str] | None:
    """The overrides that make the run's recipe give its config again (a resume must repeat what its
    checkpoint depends on, framework/resolve/resume.py): the launch's own as given (a resume's include
    those it kept from the launch before), the last of each key, without the keys a resume command
    sets itself. None without a launch (a run folder of an older apiary)."""
    if not launch or not isinstance(launch.get("overrides"), list):
        return None
    last = {_key(o): i for i, o in enumerate(launch["overrides"])}
    return [o for i, o in enumerate(launch["overrides"]) if last[_key(o)] == i
            and _key(o) not in _NOT_REPEATED and not _key(o).startswith("hydra.")]


def ranks(cfg, overrides: list[str], env=os.environ) -> tuple[str, list[str]]:
    """The command that starts the run's ranks again, and the overrides with what it needs: a resume keeps
    the parallel degrees, so a run of N ranks that a torchrun of the user's own started (its config's
    launcher.nproc is 1; docs/launching.md "torchrun by hand") resumes with ``nproc=N`` on one machine
    (was: a one-process command, refused for its data-parallel size), or with a torchrun of the same shape
    across machines. Under a batch scheduler (SLURM_JOB_ID), or when the launch named its ranks, as is."""
    dims = OmegaConf.select(cfg, "parallel", default=None) if cfg is not None else None
    nproc = OmegaConf.select(cfg, "launcher.nproc", default=None) if cfg is not None else None
    if dims is None or nproc is None or "SLURM_JOB_ID" in env:
        return "train", overrides
    world = math.prod(int(dims.get(k) or 1) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
    if world <= int(nproc) or any(_key(o) in ("nproc", "launcher.nproc") for o in overrides):
        return "train", overrides
    here = int(env.get("LOCAL_WORLD_SIZE") or world)
    if here >= world:
        return "train", [*overrides, f"nproc={world}"]
    return (f"torchrun --nnodes={world // here} --nproc_per_node={here} [this launch's rendezvous options] "
            "-m framework.cli train", overrides)


def _down(x: float, digits: int = 3) -> float:
    """``x`` cut (not rounded up) to ``digits`` significant digits: a rate printed in a command that never
    exceeds the one it stands for."""
    near = float(f"{x:.{digits}g}")
    if near <= x * (1 + 1e-9):  # rounding did not go up (beyond the float noise of x's arithmetic)
        return near
    e = math.floor(math.log10(x)) - digits + 1
    return float(f"{math.floor(x / 10**e) * 10**e:.{digits}g}")


def continuation(cfg, steps: int) -> tuple[list[str], str]:
    """The schedule overrides for training a finished run of ``steps`` steps on to ``2 * steps``, and a note
    (empty when nothing needs saying). The default never raises the learning rate at the step after the
    last: ``lr.total_steps`` stretched over the new steps restarts part of the decay (step 10 of 10 at 1/8
    of optimizer.lr, step 11 of 20 at 5/9 of it), so (0) a schedule laid out past the new steps, kept;
    (1) where the stretch does not raise it, the stretch; (2) where the schedule's own end is above 0, the
    schedule kept (steps past it hold its final rate); (3) else the stretch from the rate the run reached
    (optimizer.lr scaled so step ``steps + 1`` uses at most the rate step ``steps`` used). The note names
    the rate the plain stretch would jump to."""
    c = OmegaConf.to_container(cfg, resolve=True)
    warmup = resume.warmup_steps(c)  # a warm-up the launch shortened is kept (a resume refuses another one)
    kept = [f"lr.warmup_steps={warmup}"] if warmup != int(c["lr"]["warmup_steps"]) else []
    c["lr"]["warmup_steps"] = warmup
    overrides, note = _continuation(c, steps)
    return overrides + kept, note


def _continuation(c: dict, steps: int) -> tuple[list[str], str]:
    """``continuation`` of the run's config ``c`` (resolved, its warm-up the one the schedule used)."""
    to, lr0 = 2 * steps, float(c["optimizer"]["lr"])

    def next_lr(total: int, lr: float) -> float:
        return resume.lr_at({**c, "training": {**c["training"], "steps": to}, "lr": {**c["lr"], "total_steps": total},
                             "optimizer": {**c["optimizer"], "lr": lr}}, steps + 1)

    last, horizon = resume.lr_at(c, steps), resume.horizon(c)
    stretched, held = next_lr(to, lr0), next_lr(horizon, lr0)
    if horizon >= to:  # the schedule was laid out past the new steps: it goes on as planned
        return [f"lr.total_steps={horizon}"], ""
    if stretched <= last * (1 + 1e-9):
        return [f"lr.total_steps={to}"], ""
    jump = f"lr.total_steps={to} alone stretches the schedule and raises the lr to {stretched:.3g} at step {steps + 1}"
    if held > 0:
        return [f"lr.total_steps={horizon}"], (f"step {steps} used lr {last:.3g}; this keeps the schedule (steps after "
                                               f"{horizon} hold its final lr {held:.3g}); {jump}")
    if last <= 0:
        return [f"lr.total_steps={to}"], f"step {steps} used lr 0; {jump}"
    scaled = _down(lr0 * last / stretched)
    return [f"lr.total_steps={to}", f"optimizer.lr={scaled:g}"], (
        f"step {steps} used lr {last:.3g}; this stretches the schedule over {to} steps from that rate (optimizer.lr="
        f"{scaled:g}: lr {next_lr(to, scaled):.3g} at step {steps + 1}, then the stretched shape); {jump}")


def from_weights(step_dir, recipe: str, out: str, overrides: list[str], quote) -> str:
    """The command that starts a new run from a run's last step when no full step exists to resume from
    (checkpoint.model_only_last=true saved it; a resume of it is refused, framework/train/integrity.py): a new
    run loading its weights (checkpoint.load_path), or, for a run with an adapter, whose step holds the
    adapters, its merged export as the new run's HF base (model.hf_checkpoint)."""
    step_dir = Path(step_dir)
    adapted = integrity.adapter_run(step_dir)
    new_out = _new_run_dir(out, step_dir.name)
    if adapted is None:
        base, drop, first = f"checkpoint.load_path={step_dir}", ("checkpoint.load_path",), ""
    elif (why := integrity.seeded_base(adapted[1])) is not None:  # nothing to export merged: say so, no command
        return (f"none: {why}; train adapters on model.hf_checkpoint=DIR or checkpoint.load_path=STEP to start new "
                "runs from them")
    else:
        merged = adapted[1] / f"merged-{step_dir.name}"
        base, drop = f"model.hf_checkpoint={merged}", ("checkpoint.load_path", "model.hf_checkpoint")
        first = (f"apiary export {quote(str(adapted[1]))} --hf {quote(str(merged))} --merged "
                 f"--step {step_dir.name.removeprefix('step-')}, then ")
    kept = [o for o in overrides if _key(o) not in drop]
    return (f"{first}train recipe={quote(recipe)} {quote(base)} output_dir={quote(new_out)}"
            + "".join(f" {quote(o)}" for o in kept))
