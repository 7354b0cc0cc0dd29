"""Recipe -> resolved run: typed config, model facts, derived layout, output paths.

Everything here runs before any worker is spawned and turns bad input into UserError. ``resolve`` is
three steps: compose (framework/compose/recipes.py ``load``), this package's checks (``checked``), the
planner's preflight (plan/preflight.py). The checks live beside this module, one file per reason;
``checked`` enters each once, in the order their results need: the values (values.py), the
environment, paths and inputs (inputs.py, which says the world size), the components with the model's
facts and the layout (context.py, layout.py), the settings without effect (needs.py), the run's folder
(outputs.py), publication (publishing.py), the paths stored absolute (paths.py), a resume's plan
(resume.py).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf

from framework import contracts
from framework.compose import recipes
from framework.plan import preflight
from framework.resolve import context, inputs, needs, outputs, paths, publishing, resume, values
from framework.resolve.layout import Layout


@dataclass
class Resolved:
    cfg: DictConfig  # composed recipe, derived dims filled in
    facts: object  # the model family's facts (ModelFamily.facts)
    layout: Layout
    grad_accum: int
    data_summary: str = ""  # what the run trains on (printed first by rank 0)
    resume_lines: list = field(default_factory=list)  # a resume: the step it loads, what changed (printed next)
    ctx: contracts.Context | None = None  # the components' context (check ran with it; build applies with it)
    given_parallel: dict = field(default_factory=dict)  # the parallel section as composed, before derivation
    launch: dict | None = None  # {"recipe": as given, "overrides": [...], "cwd": ...}: what a resume keeps (resume.LAUNCHES)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)


def resolve(recipe: str | None, overrides: list[str], *, world_size=None, for_training: bool = True) -> Resolved:
    """The run ``train recipe overrides`` describes, every check done (a UserError: exit 2). ``world_size``:
    the ranks to lay it out for (an int, or a function of the composed config); None: the launcher's.
    Three steps: compose (framework/compose/), the checks of this package (``checked``), the planner's
    preflight (framework/plan/)."""
    cfg = recipes.load(recipe, overrides)
    run_dir, resuming = cfg.output_dir or outputs.latest_run_dir(cfg.recipe), for_training and cfg.checkpoint.resume
    kept, kept_recipe = resume.kept_launch(run_dir, overrides, recipe) if resuming else ([], recipe)
    if kept or kept_recipe != recipe:  # a resume keeps the launch's overrides, unless given again, and recipe
        overrides, recipe = [*kept, *overrides], kept_recipe
        cfg = recipes.load(recipe, overrides)
    warmup = resume.kept_warmup(run_dir, cfg, overrides) if resuming else []
    if warmup:  # and the warm-up its schedule used, when the launch shortened it
        kept, overrides = [*kept, *warmup], [*warmup, *overrides]
        cfg = recipes.load(recipe, overrides)
    r = checked(cfg, overrides, kept, world_size=world_size, for_training=for_training, recipe=recipe)
    r.launch = {"recipe": recipe, "overrides": list(overrides), "cwd": os.getcwd()}  # cwd: what relative paths meant
    preflight.check_plan(r, recipe, overrides, check_candidate, for_training)
    return r


def checked(cfg: DictConfig, overrides: list[str], kept: list[str], *, world_size, for_training: bool,
            recipe: str | None = None) -> Resolved:
    """The composed ``cfg`` through each checking module of this package, once, in the order their results
    need; the layout's dims written into it, its paths stored absolute. ``kept``: the overrides a resume
    kept from its launch."""
    notes = values.check(cfg, overrides, kept)  # ranges, choices, the schedule's fit
    world = inputs.check(cfg, for_training, world_size)  # the environment, paths, inputs; the ranks
    ctx, grad_accum = context.check(cfg, for_training, world)  # components, facts, layout, every kind's check
    ctx.summary.extend(notes)  # the schedule's notes after the components' lines
    needs.check(cfg, overrides, ctx, recipe)
    layout = ctx.layout
    given_parallel = OmegaConf.to_container(cfg.parallel)
    OmegaConf.set_struct(cfg, False)
    for dim, value in layout.dims.items():
        cfg.parallel[dim] = value
    step = outputs.check(cfg) if for_training else None
    publishing.check(cfg, ctx, layout, for_training)
    paths.absolute_in(cfg)  # stored absolute (framework/resolve/paths.py); every check above read them as given
    OmegaConf.set_struct(cfg, True)
    # a resume: what it loads and what changed since the last launch
    resume_lines = resume.plan(cfg, ctx, step, kept, overrides) if step is not None else []
    if step is None and for_training and cfg.checkpoint.load_path:  # a new run from saved weights says which
        resume_lines = [f"weights: {cfg.checkpoint.load_path} (checkpoint.load_path: the model's weights only; "
                        "a fresh optimizer, schedule and data order)"]
    return Resolved(cfg=cfg, facts=ctx.facts, layout=layout, grad_accum=grad_accum, given_parallel=given_parallel,
                    data_summary="\n".join(ctx.summary), ctx=ctx, resume_lines=resume_lines)


def check_candidate(r: Resolved, dims: dict, choice: dict, world_size: int) -> None:
    """What resolve checks of ``r`` with other layout dims (``parallel.ep=..`` etc.) and other component
    choices (``loss=NAME`` ...: that component's default options), without composing the recipe again:
    the layout's derivation and batch split, every kind's ``check`` and the RL keys, as a print-only
    resolve (``for_training=False``) checks them. A UserError names what the candidate breaks. The
    preflight's and ``apiary plan --search``'s suggestions are checked with it."""
    cfg = copy.deepcopy(r.cfg)
    par = SimpleNamespace(**r.given_parallel)
    for d, v in dims.items():
        setattr(par, d, v)
    OmegaConf.set_struct(cfg, False)
    for kind, name in choice.items():
        section, key = contracts.SELECT[kind]
        if str(cfg[section][key]) != str(name):
            cfg[section] = {key: str(name)}  # another component: its own defaults
    OmegaConf.set_struct(cfg, True)
    ctx, _ = context.check(cfg, False, world_size, parallel=par, facts=r.facts)
    OmegaConf.set_struct(cfg, False)
    for d, v in ctx.layout.dims.items():
        cfg.parallel[d] = v
    OmegaConf.set_struct(cfg, True)
    needs.check_rl_keys(ctx)
