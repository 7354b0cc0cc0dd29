"""``search``: the layouts and component choices around a resolved recipe that fit, fastest first.

The dims vary around the derived layout (those not set on the command line); the components vary
over every registered name of the recompute and state kinds that has ``plan_terms``, and over the
registered losses with ``plan_terms`` that optimise the same objective as the recipe's loss (the
``objective`` their PlanTerms name): search changes how the loss is computed, never what it is.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from framework.contracts import Context
from framework.errors import UserError
from framework.plan.planner import parts
from framework.plan.planner.constants import Constants
from framework.plan.planner.estimate import gpu_for, plan, shapes_and_context
from framework.resolve.layout import check_batch, derive

SEARCH_KINDS = ("recompute", "loss", "state")  # the order of a row's choices


def _around(base: int, lo_factor: int, hi_factor: int) -> list[int]:
    vals, v = [], max(1, base // lo_factor)
    while v <= base * hi_factor:
        vals.append(v)
        v *= 2
    return sorted(set(vals + [base]))


def _objective(name: str, ctx):
    """The ``objective`` fact of a loss's PlanTerms (None when it names none or is not plannable)."""
    obj = parts.component("loss", name)
    if obj is None:
        return None
    return obj.plan_terms(parts.options(ctx.cfg, "loss", name), ctx).facts.objective


def candidates(resolved, c: Constants, gpu: str | None = None, gpu_memory_bytes: int | None = None) -> dict:
    """kind -> the names search tries."""
    hw, _ = gpu_for(c, gpu, gpu_memory_bytes)
    ctx = Context(resolved.cfg, resolved.facts, resolved.layout, for_training=False,
                  plan=shapes_and_context(resolved, c, hw)[1])
    out = {k: parts.names(k) for k in SEARCH_KINDS}
    want = _objective(str(getattr(resolved.cfg.get("loss"), "name", parts.defaults()["loss"])), ctx)
    out["loss"] = [n for n in out["loss"] if _objective(n, ctx) == want]
    return out


def _space(f, base: dict, fixed: set[str]) -> dict[str, list[int]]:
    space = {
        "ep": [e for e in _around(base["ep"], 4, 4) if not f.num_experts or f.num_experts % e == 0]
        if f.num_experts else [1],
        "cp": _around(base["cp"], 2, 2),
        "pp": sorted({1, 2, base["pp"]}),
        "tp": sorted({1, 2, base["tp"]}),
    }
    for d in fixed & set(space):
        space[d] = [base[d]]
    return space


def _layouts(raw, resolved, space, gpus, counts):
    """Every (dims, Resolved) of the space that framework.resolve.layout accepts."""
    f = resolved.facts
    for ep in space["ep"]:
        for cp in space["cp"]:
            for pp in space["pp"]:
                for tp in space["tp"]:
                    counts["layouts"] += 1
                    par = SimpleNamespace(**{k: raw.parallel[k] for k in raw.parallel})
                    par.ep, par.cp, par.pp, par.tp = ep, cp, pp, tp
                    try:
                        layout = derive(par, raw.training, raw.layout, f, gpus)
                        ga = check_batch(raw.training, layout)
                    except UserError:
                        counts["invalid_layouts"] += 1
                        continue
                    yield dict(ep=ep, cp=cp, pp=pp, tp=tp), replace(resolved, layout=layout, grad_accum=ga)


def _fitting(raw, resolved, space, gpus, names, plan_kwargs, counts) -> list:
    rows = []
    for dims, r in _layouts(raw, resolved, space, gpus, counts):
        for rc in names["recompute"]:
            for loss in names["loss"]:
                for state in names["state"]:
                    counts["plans"] += 1
                    p = plan(r, loss=loss, state=state, recompute=rc, **plan_kwargs)
                    if not p.fits:
                        counts["oom"] += 1
                        continue
                    rows.append((p, dims, dict(recompute=rc, loss=loss, state=state)))
    rows.sort(key=lambda x: (-x[0].tokens_per_s_per_gpu, x[0].total_bytes))
    return rows


def search(r, overrides, gpus, *, top=10, plan_kwargs=None, check=None) -> dict:
    """Enumerate (ep, cp, pp, tp, recompute, loss, state) around ``r``'s layout, fastest first among
    those that fit, without composing the recipe again: the dims it varies start from
    ``r.given_parallel`` (the parallel section as composed), each layout derived as resolve derives
    it (framework.resolve.layout). Each row it returns is checked by ``check(r, dims, choice, gpus)``
    (framework.resolve.resolver.check_candidate, passed in so that the planner does not import resolve; None:
    rows are not checked); a row it refuses is dropped. Returns {"rows", "counts"}."""
    plan_kwargs = dict(plan_kwargs or {})
    raw = SimpleNamespace(parallel=dict(r.given_parallel), training=r.cfg.training, layout=r.cfg.layout)
    fixed = {k.split("=", 1)[0].split(".", 1)[1] for k in overrides if k.startswith("parallel.") and "=" in k}
    space = _space(r.facts, r.layout.dims, fixed)
    constants = Constants()
    if plan_kwargs.get("calibration"):
        constants = constants.calibrated(plan_kwargs.pop("calibration"))
    plan_kwargs.pop("calibration", None)
    plan_kwargs["constants"] = constants
    names = candidates(r, constants, plan_kwargs.get("gpu"), plan_kwargs.get("gpu_memory_bytes"))
    counts = {"layouts": 0, "invalid_layouts": 0, "plans": 0, "oom": 0, "rejected_by_resolve": 0}
    rows = _fitting(raw, r, space, gpus, names, plan_kwargs, counts)
    out = []
    for p, dims, choice in rows:
        if len(out) >= top:
            break
        set_keys = {f"parallel.{d}" for d in dims} | set(choice)
        ovr = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in set_keys]
        ovr += [f"parallel.{d}={v}" for d, v in dims.items() if d not in fixed]
        ovr += [f"{k}={v}" for k, v in choice.items()]
        if check is not None:
            try:
                check(r, dims, choice, gpus)
            except UserError:
                counts["rejected_by_resolve"] += 1
                continue
        out.append({
            "rank": len(out) + 1, "dims": p.dims, **choice, "local_seq": int(r.cfg.training.seq_len) // dims["cp"],
            "total_bytes": p.total_bytes, "verdict": p.verdict, "step_time_s": p.step_time_s,
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "tflops_per_gpu": p.tflops_per_gpu,
            "overrides": ovr,
        })
    counts["fit"] = len(rows)
    return {"rows": out, "counts": counts}
