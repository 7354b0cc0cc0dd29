"""Memory preflight: the planner's per-GPU estimate against the GPU, before any worker starts.

``preflight.memory=refuse`` (default): an estimate above the GPU's memory by more than the planner's
measured error stops the launch (exit 2) naming the largest memory terms and the cheapest changes
that fit (from the planner's search); an estimate within that error of the memory is a warning.
``warn`` only warns; ``off`` skips the check. The GPU is ``preflight.gpu`` (``gpu=H200`` on the
command line) when set, else the local accelerator, else there is nothing to check (a CPU run has
no GPU memory to run out of).
"""

from __future__ import annotations

import os

from rich.console import Console

from framework import planner, registry
from framework.errors import UserError
from framework.planner import Constants, search

GiB = 2**30
# The planner's measured error on memory, as a fraction of the estimate. Measured on one H200,
# 2026-11-24 (../shared/FACTS.md, qwen35_35b_128k 4 layers, one GPU): planned 93.8 GiB vs 97-103
# GiB measured peak at 32K (up to 9.8% low), 108.6 vs 112.1 GiB at 64K (3.2% low).
MEASURED_ERROR = 0.10


def target_gpu(cfg) -> tuple[str, int | None, str] | None:
    """(kind, memory bytes or None for the kind's, where it came from), or None: no GPU to check."""
    if cfg.preflight.gpu:
        kind = str(cfg.preflight.gpu).upper()
        if kind not in Constants().hardware:
            known = ", ".join(Constants().hardware)
            raise UserError(f"preflight.gpu={cfg.preflight.gpu}", f"unknown GPU kind; the planner knows {known}.",
                            "Set gpu=H100 or gpu=H200 (or preflight.memory=off to skip the check).")
        return kind, None, "preflight.gpu"
    if not registry.resolve("launcher", str(cfg.launcher.name)).RUNS_HERE:
        return None  # the job runs elsewhere; this machine's GPU says nothing about it
    kind, total = _local_gpu()
    if total is None:
        return None
    return kind or ("H200" if total > 100 * GiB else "H100"), total, "this machine's GPU"


def _local_gpu() -> tuple[str | None, int | None]:
    """This process's own GPU (LOCAL_RANK's under torchrun, so no rank touches another's device)."""
    import torch  # reason: start-up time (only a launch checks the GPU's memory)

    from framework import devices  # reason: as above (it imports torch)

    if not devices.has_accelerator():
        return None, None
    props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    name = props.name.upper()
    return ("H200" if "H200" in name else "H100" if "H100" in name else None), int(props.total_memory)


def _changes(p, r) -> list[str]:
    cur = {"loss": str(r.cfg.loss.name), "state": str(r.cfg.state.name), "recompute": str(r.cfg.recompute.name)}
    out = [f"parallel.{d}={v}" for d, v in p["dims"].items() if v != r.layout.dims.get(d)
           and d not in ("dp_shard", "dp_replicate")]
    out += [f"{k}={p[k]}" for k in ("loss", "state", "recompute") if p[k] != cur[k]]
    return out


def cheapest_fits(r, recipe, overrides, kind, memory: int, resolve, n: int = 3) -> list[str]:
    """Up to ``n`` override sets from the planner's search that fit with the measured error to spare,
    fewest changed settings first, then fastest; each checked by ``resolve`` (framework.resolve's,
    passed in by its caller so that preflight does not import resolve back)."""
    ovr = [o for o in overrides if not o.startswith(("preflight.", "output_dir=", "checkpoint.resume"))]
    try:
        res = search(recipe, ovr, r.layout.world_size, r, top=10**6,
                     plan_kwargs=dict(gpu=kind, gpu_memory_bytes=memory), validate=None)
    except UserError:
        return []
    rows = list(res["rows"])
    rows.sort(key=lambda row: (len(_changes(row, r)), -row["tokens_per_s_per_gpu"]))
    out = []
    for row in rows:
        if row["total_bytes"] * (1 + MEASURED_ERROR) > memory:
            continue
        change = _changes(row, r)
        if not change:
            continue
        try:
            resolve(recipe, ovr + change, world_size=r.layout.world_size, for_training=False)
        except UserError:
            continue
        out.append(f"{' '.join(change)} ({row['total_bytes'] / GiB:,.1f} GiB, "
                   f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU est.)")
        if len(out) >= n:
            break
    return out


def check_memory(r, recipe, overrides, resolve) -> None:
    """Refuse (or warn about) a launch whose estimated per-GPU memory does not fit the GPU;
    ``resolve`` checks the changes it suggests (framework.resolve.resolve)."""
    mode = r.cfg.preflight.memory
    if mode == "off":
        return
    target = target_gpu(r.cfg)
    if target is None:
        return
    kind, memory, source = target
    p = planner.plan(r, gpu=kind, gpu_memory_bytes=memory)
    cap, total = p.gpu_memory_bytes, p.total_bytes
    if total <= cap * (1 - MEASURED_ERROR):
        return
    terms = sorted(p.terms, key=lambda t: -t.bytes)[:3]
    named = ", ".join(f"{t.name} {t.bytes / GiB:,.1f}" for t in terms)
    head = (f"the planner estimates {total / GiB:,.1f} GiB per GPU on {kind} ({cap / GiB:,.1f} GiB, {source}); "
            f"largest terms (GiB): {named}")
    if total > cap * (1 + MEASURED_ERROR) and mode == "refuse":
        fits = cheapest_fits(r, recipe, overrides, kind, cap, resolve)
        fix = ("Changes that fit, fewest first: " + "; ".join(fits) + ". " if fits else
               "The planner's search found no layout that fits this world size; use more GPUs or a shorter "
               "training.seq_len. ")
        raise UserError("preflight.memory=refuse", f"{head}. That is more than the GPU's memory by more than "
                        f"the planner's measured error ({MEASURED_ERROR:.0%}), so the run would die of OOM in "
                        "step 1, after minutes of compiling.",
                        fix + "`apiary plan ... --search` lists more; preflight.memory=warn launches anyway.")
    if int(os.environ.get("RANK", "0")) == 0:
        verdict = "above" if total > cap else "within " + f"{MEASURED_ERROR:.0%} of"
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[yellow]warning[/yellow] memory: {head}; that is {verdict} the GPU's memory (the planner's measured "
            f"error is {MEASURED_ERROR:.0%}), so step 1 may run out of memory. `apiary plan` shows the terms.",
            markup=True)
