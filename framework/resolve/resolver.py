"""Recipe -> resolved run: typed config, model facts, derived layout, output paths.

Everything here runs before any worker is spawned and turns bad input into UserError. The checks
live beside this module, one file per reason (values, inputs, outputs, publishing, needs).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from framework import contracts
from framework.compose import recipes
from framework.plan.preflight import check_memory, choose_by_budget
from framework.resolve import paths, resume
from framework.resolve.context import Resolved, check_components, context, model_facts
from framework.resolve.inputs import check_environment, check_inputs, check_paths, check_writable, world_size_from
from framework.resolve.layout import Layout, check_batch, derive
from framework.resolve.needs import check_no_effect
from framework.resolve.outputs import check_outputs, check_overlaps, check_resume_load_path, latest_run_dir
from framework.resolve.publishing import check_publish, check_rl_keys
from framework.resolve.values import check_decay, check_values, check_warmup
from framework.train import integrity


def resolve(recipe: str | None, overrides: list[str], *, world_size=None, for_training: bool = True) -> Resolved:
    """The run ``train recipe overrides`` describes, every check done (a UserError: exit 2). ``world_size``:
    the ranks to lay it out for (an int, or a function of the composed config); None: the launcher's."""
    check_environment()
    cfg = recipes.load(recipe, overrides)
    kept = resume.kept_overrides(cfg.output_dir or latest_run_dir(cfg.recipe), overrides) \
        if for_training and cfg.checkpoint.resume else []
    if kept:  # a resume keeps the launch's overrides, unless given again
        overrides = [*kept, *overrides]
        cfg = recipes.load(recipe, overrides)
    check_values(cfg)
    check_paths(cfg)
    ctx = context(cfg, for_training)
    facts = model_facts(cfg, ctx)
    check_inputs(cfg, for_training)
    world = world_size_from(cfg, for_training) if world_size is None else \
        int(world_size(cfg)) if callable(world_size) else world_size
    layout = backend_layout(ctx, derive(cfg.parallel, cfg.training, cfg.layout, facts, world))
    ctx.facts, ctx.layout = facts, layout
    check_components(ctx)
    check_rl_keys(ctx)
    check_warmup(cfg, overrides, ctx)
    check_no_effect(cfg, overrides, ctx)
    check_decay(cfg, overrides, ctx)
    resume.check_tail(cfg)
    grad_accum = check_batch(cfg.training, layout, cfg.parallel)
    given_parallel = OmegaConf.to_container(cfg.parallel)
    OmegaConf.set_struct(cfg, False)
    for dim, value in layout.dims.items():
        cfg.parallel[dim] = value
    resume_lines, step = [], None
    if for_training:
        step = check_outputs(cfg)
        check_writable(cfg)
    check_publish(cfg, ctx, layout, for_training)
    if for_training:
        check_overlaps(cfg)
    paths.absolute_in(cfg)  # stored absolute (framework/resolve/paths.py); every check above read them as given
    OmegaConf.set_struct(cfg, True)
    if for_training and step is not None:  # what this resume loads and what changed since the last launch
        plan = resume.check(cfg, Path(cfg.output_dir), step)
        check_resume_load_path(cfg, ctx, plan)
        plan.verified = (Path(cfg.output_dir) / "checkpoint" / f"step-{step}" / integrity.MANIFEST).is_file()
        resume_lines = plan.lines(cfg.output_dir)
        if kept:
            resume_lines.append(f"resume: keeps the last launch's overrides {' '.join(kept)} (give one again to "
                                "change it)")
    r = Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=grad_accum, given_parallel=given_parallel,
                 data_summary="\n".join(ctx.summary), ctx=ctx, resume_lines=resume_lines,
                 launch={"recipe": recipe, "overrides": list(overrides)})
    choose_by_budget(r, for_training)
    r.data_summary = "\n".join(ctx.summary)
    if for_training:
        check_memory(r, recipe, overrides, check_candidate)
    return r


def backend_layout(ctx: contracts.Context, layout: Layout) -> Layout:
    """``layout`` as the chosen state backend runs it (its optional ``layout`` member): the degrees it
    moves, with its reason as their rule. A backend that changes the world size is a framework bug."""
    runs = contracts.member(ctx.components["state"], "state", "layout")
    if runs is None:
        return layout
    dims, reason = runs(ctx.options["state"], dict(layout.dims))
    changed = {d: int(v) for d, v in dims.items() if int(v) != layout.dims[d]}
    if not changed:
        return layout
    if math.prod(int(v) for v in dims.values()) != math.prod(layout.dims.values()) or set(dims) != set(layout.dims):
        raise ValueError(f"the state backend's layout {dims} does not keep the degrees' product of {layout.dims}")
    return dataclasses.replace(layout, **changed, rules={**layout.rules, **{d: reason for d in changed}})


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
    ctx = context(cfg, for_training=False)
    layout = backend_layout(ctx, derive(par, cfg.training, cfg.layout, r.facts, world_size))
    check_batch(cfg.training, layout, par)
    OmegaConf.set_struct(cfg, False)
    for d, v in layout.dims.items():
        cfg.parallel[d] = v
    OmegaConf.set_struct(cfg, True)
    ctx.facts, ctx.layout = r.facts, layout
    check_components(ctx)
    check_rl_keys(ctx)
