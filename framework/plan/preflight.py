"""Memory preflight: the planner's per-GPU estimate against the GPU, before any worker starts.

``preflight.memory=refuse`` (default): an estimate above the GPU's memory by more than the planner's
measured error (``measured_band``: one band with context parallelism, one without) stops the launch (exit 2)
naming the largest memory terms and the cheapest changes that fit (from the planner's search); one within
that error is a warning. ``warn`` only warns; ``off`` skips the check. The GPU is ``preflight.gpu``
(``gpu=H200`` on the command line) when set, else the local accelerator. A CPU run on this machine (local
launcher, no accelerator, no ``preflight.gpu``) is checked against the host's available memory instead: every
rank's planned terms (activations at the run's dtype, no CUDA reserve) plus one process's fixed resident
size, times the ranks, against MemAvailable (and a cgroup limit, when one is set).

    check_plan(r, recipe, overrides, check, for_training)

is what resolve asks of the planner once the run is resolved: the choices components leave to the memory budget
(``choose_by_budget``), then, for a launch, the GPU-only settings and the memory preflight (``check_memory``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

from rich.console import Console

from framework import contracts
from framework.compose import registry
from framework.errors import UserError
from framework.plan import planner, static_fit
from framework.plan.planner import Constants
from framework.plan.planner.search import search
from framework.resolve.layout import check_batch

GiB = 2**30
# The planner's measured error on memory, as a fraction of the estimate, each way, per layout kind
# (``measured_band``): (under, over). MEASURED_UNDER: how far below the peak a plan may be: a plan
# within this fraction of the GPU's memory passes silently, and recompute=auto leaves the same margin
# (components/recompute/policies.MARGIN; a test holds them equal). MEASURED_ERROR: how far above: a plan
# above the memory by more than this is refused; between the two, a warning.
# cp 1, one H200, 2026-11-28 (docs/benchmarks.md, `benchmarks/planner_accuracy.sh`; qwen35_35b_128k, 4
# layers): with the defaults (expandable segments, the lean MoE combine) every recompute=auto candidate from
# full recompute to every block kept at 32K-128K within +0.3%..+3.4%; with torch's fixed segments or
# torchtitan's fp32 combine -4.2%..+5.6%; optimizer offload -2.6%, many short RL sequences per row +0.5%
# (2026-11-27), LoRA up to +9.3% (the planner above the peak): 7% below (largest 4.2%, with room), 10% above.
# cp > 1, two H200s, 2026-11-28 (qwen35_35b_128k at 8 layers and qwen35_35b_lora_128k, CP 2 x EP 2): before
# the planner's cp_activation_overhead, -2.8%..-6.0% (+0.8% LoRA); with it, the two fitted points +0.4% and
# -0.0%, auto at 128K +1.4% over the floor its retrying allocator left, LoRA +6.5%. Below: 7% (the largest
# under-estimate before the refit, 6.0%, with room: one factor fitted on two points); above: 8% (largest +6.5%).
MEASURED_BANDS = {"cp 1": (0.07, 0.10), "cp > 1": (0.07, 0.08)}
MEASURED_UNDER, MEASURED_ERROR = MEASURED_BANDS["cp 1"]


def measured_band(cp: int) -> tuple[float, float, str]:
    """(under, over, the layout kind) of the planner's measured memory error for a layout with this CP."""
    kind = "cp > 1" if int(cp) > 1 else "cp 1"
    under, over = MEASURED_BANDS[kind]
    return under, over, kind


# One CPU rank's resident size beyond the planner's terms: the interpreter with torch, torchtitan and
# datasets loaded, the model's build. Measured with debug_moe on the 2-core CI box (2026-11-27):
# max RSS 1.04 GiB at local_batch=32 and 1.42 GiB at 128, where the CPU estimate (activations at 4
# bytes, no CUDA reserve) is about 0.1 and 0.5 GiB: about 0.9 GiB on top, the same at both sizes.
CPU_PROCESS_BYTES = int(0.9 * GiB)


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


def cheapest_fits(r, overrides, kind, memory: int, check, n: int = 3) -> list[str]:
    """Up to ``n`` override sets from the planner's search that fit with the measured error to spare,
    fewest changed settings first, then fastest; each checked by ``check`` (framework.resolve's
    check_candidate: the candidate's layout and component checks, without resolving again)."""
    ovr = [o for o in overrides if not o.startswith(("preflight.", "output_dir=", "checkpoint.resume"))]
    try:
        res = search(r, ovr, r.layout.world_size, top=10**6, plan_kwargs=dict(gpu=kind, gpu_memory_bytes=memory))
    except UserError:
        return []
    rows = list(res["rows"])
    rows.sort(key=lambda row: (len(_changes(row, r)), -row["tokens_per_s_per_gpu"]))
    out = []
    for row in rows:
        if row["total_bytes"] > memory * (1 - measured_band(row["dims"]["cp"])[0]):  # what the preflight passes silently
            continue
        change = _changes(row, r)
        if not change:
            continue
        dims = {d: row["dims"][d] for d in ("ep", "cp", "pp", "tp")}
        try:
            check(r, dims, {k: row[k] for k in ("recompute", "loss", "state")}, r.layout.world_size)
        except UserError:
            continue
        out.append(f"{' '.join(change)} ({row['total_bytes'] / GiB:,.1f} GiB, "
                   f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU est.)")
        if len(out) >= n:
            break
    return out


def _budget_target(r, for_training: bool) -> tuple[str, int | None, str] | None:
    """The GPU a budget-planned component chooses for: ``preflight.gpu``; under torchrun this
    rank's own GPU (whichever launcher started the job); for a launch from here the target of the
    memory preflight; a print-only command (--cfg job) asks no GPU (no torch)."""
    if r.cfg.preflight.gpu:
        return target_gpu(r.cfg)
    if not for_training:
        return None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        kind, total = _local_gpu()
        return (kind or ("H200" if total > 100 * GiB else "H100"), total, "this rank's GPU") if total else None
    return target_gpu(r.cfg)


NO_GPU_RESERVE = {"cuda_context_bytes": 0.0, "nccl_bytes": 0.0}


def _cpu_run(cfg) -> bool:
    """The run trains on this machine's CPU: no GPU here, none named (preflight.gpu), a launcher that runs here."""
    if cfg.preflight.gpu or not registry.resolve("launcher", str(cfg.launcher.name)).RUNS_HERE:
        return False
    return _local_gpu() == (None, None)


def choose_by_budget(r, for_training: bool) -> None:
    """Components whose plan terms list candidates by memory (recompute=auto) choose one now, from
    the planner's estimate on the run's GPU (the budget its ``memory_budget`` gives instead when set); the choice
    goes to ``r.ctx.derived[kind]`` for their ``apply``, to the run's first lines and layout.json.
    No GPU known: nothing is chosen (the component's fallback: full recompute)."""
    comp, opts = r.ctx.components["recompute"], r.ctx.options["recompute"]
    memory_budget = contracts.member(comp, "recompute", "memory_budget")
    if memory_budget is None:
        return
    budget = memory_budget(opts)
    target = ("H200" if budget > 100 else "H100", int(budget * GiB), "recompute.budget_gib") if budget else \
        _budget_target(r, for_training)
    cpu = bool(budget) and _cpu_run(r.cfg)
    if target is None:
        r.ctx.derived["recompute"] = {"blocks": None, "reason": "no GPU known here, so every block is recomputed "
                                      "(set gpu=H100 or gpu=H200, or recompute.budget_gib, to choose per block)"}
    else:
        kind, memory, source = target
        # a CPU run's budget is its own memory: no CUDA context or NCCL buffers (the GPU kind only sets constants
        # the memory choice does not read), and the reason names no GPU
        p = planner.plan(r, gpu=kind, gpu_memory_bytes=memory, calibration=NO_GPU_RESERVE if cpu else None)
        where = f"on this CPU run ({source}; no CUDA context or NCCL counted)" if cpu else f"on {kind} ({source})"
        r.ctx.derived["recompute"] = {"blocks": p.choices.get("recompute_blocks"),
                                      "reason": f"{p.choices.get('recompute_reason', '')} {where}",
                                      "fallbacks": p.choices.get("recompute_fallbacks", [])}
        learned_choice(r, "recompute")
    blocks = r.ctx.derived["recompute"]["blocks"]
    what = "; ".join(f"{m} blocks: " + ", ".join(f"{n} {how.replace('_', ' ')}" for how, n in v.items() if n)
                     for m, v in blocks.items()) if blocks else "every block recomputed"
    r.ctx.summary.append(f"recompute per block: {what} ({r.ctx.derived['recompute']['reason']})")


def read_learned(output_dir) -> dict:
    """The run folder's learned state ({kind: state}, framework.contracts.LEARNED_FILE), {} without one."""
    if not output_dir:  # a print-only resolve names no run folder
        return {}
    path = Path(output_dir) / contracts.LEARNED_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def learned_choice(r, kind: str) -> None:
    """A run whose choice stepped back at run time (the allocator retried: framework.train.trainer and
    the component's memory listener) starts its resume from the choice it learned, when the plan is
    still the one it learned from; another plan (changed settings) starts afresh, said."""
    derived = r.ctx.derived[kind]
    got = read_learned(r.cfg.output_dir).get(kind)
    if not isinstance(got, dict) or not got.get("fallbacks"):
        return
    n = int(got["fallbacks"])
    if got.get("planned") != derived["blocks"] or n > len(derived["fallbacks"]):
        r.ctx.summary.append(f"{kind}: {contracts.LEARNED_FILE} in the run folder stepped back from another plan; "
                             "planned afresh")
        return
    derived.update(planned=derived["blocks"], blocks=derived["fallbacks"][n - 1], fallbacks=derived["fallbacks"][n:],
                   fallbacks_taken=n,
                   reason=f"{derived['reason']}; learned in this run: the allocator retried {got.get('retries')} "
                          f"time(s) in step {got.get('step')}, so it starts {n} candidate(s) back "
                          f"({contracts.LEARNED_FILE})")


def check_memory(r, recipe, overrides, check) -> None:
    """Refuse (or warn about) a launch whose estimated per-GPU memory does not fit the GPU; ``check``
    checks the changes it suggests (framework.resolve.resolver.check_candidate; ``recipe`` is the recipe's name)."""
    mode = r.cfg.preflight.memory
    if mode == "off":
        return
    target = target_gpu(r.cfg)
    if target is None:
        if not r.cfg.preflight.gpu and registry.resolve("launcher", str(r.cfg.launcher.name)).RUNS_HERE:
            check_host_memory(r, recipe, overrides, check)  # no accelerator here: the ranks run on the CPU
        return
    kind, memory, source = target
    p = planner.plan(r, gpu=kind, gpu_memory_bytes=memory)
    cap, total = p.gpu_memory_bytes, p.total_bytes
    under, over, layout_kind = measured_band(r.layout.cp)
    if total <= cap * (1 - under):
        return
    terms = sorted(p.terms, key=lambda t: -t.bytes)[:3]
    named = ", ".join(f"{t.name} {t.bytes / GiB:,.1f}" for t in terms)
    head = (f"the planner estimates {total / GiB:,.1f} GiB per GPU on {kind} ({cap / GiB:,.1f} GiB, {source}); "
            f"largest terms (GiB): {named}")
    if total > cap * (1 + over) and mode == "refuse":
        fits = cheapest_fits(r, overrides, kind, cap, check)
        static = None if fits else static_fit.gpu_verdict(r, p, cap, over)
        fix = ("Changes that fit, fewest first: " + "; ".join(fits) + ". " if fits else f"{static}. " if static else
               "The planner's search found no layout that fits this world size; use more GPUs or a shorter "
               "training.seq_len. ")
        raise UserError("preflight.memory=refuse", f"{head}. That is more than the GPU's memory by more than "
                        f"the planner's measured error at {layout_kind} ({over:.0%}), so the run would die of OOM in "
                        "step 1, after minutes of compiling.",
                        fix + "`apiary plan ... --search` lists more; preflight.memory=warn launches anyway.")
    if int(os.environ.get("RANK", "0")) == 0:
        verdict = "above" if total > cap else "within " + f"{under:.0%} of"
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[yellow]warning[/yellow] memory: {head}; that is {verdict} the GPU's memory (at {layout_kind} the planner "
            f"has measured up to {under:.0%} below the peak and {over:.0%} above it), so step 1 may run out of "
            "memory. `apiary plan` shows the terms.",
            markup=True)


# ----------------------------------------------------------------------------- CPU runs: host memory

def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: str, key: str) -> int:
    try:
        for line in open(path):
            k, _, v = line.partition(" ")
            if k == key and v.strip().isdigit():
                return int(v)
    except OSError:
        pass
    return 0


def host_memory_available() -> tuple[int, str] | None:
    """(bytes this machine can still give, where that came from), or None where unknown: the kernel's
    MemAvailable (/proc/meminfo), lowered to a cgroup's limit less its usage (page cache it can drop
    counted as free) when the process runs under one (a container, a Slurm job)."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            import psutil  # reason: optional; only where /proc/meminfo is missing (not Linux)
        except ImportError:
            return None
        avail, source = int(psutil.virtual_memory().available), "psutil.virtual_memory().available"
    for limit_f, usage_f, stat_f, cache_key in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
             "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is not None and usage is not None and limit < 2**60:  # a real limit, not "max"
            free = max(0, limit - usage + _stat_value(stat_f, cache_key))
            if free < avail:
                avail, source = free, f"the cgroup limit {limit / GiB:,.1f} GiB less its usage ({limit_f})"
            break
    return avail, source


def cpu_estimate(r) -> tuple[int, int, object]:
    """(host bytes for all ranks, bytes per rank, the plan): the planner's terms with activations at
    the run's dtype and no CUDA context/NCCL reserve, plus ``CPU_PROCESS_BYTES`` per rank; every rank of
    the local launcher runs on this machine."""
    act = 4.0 if str(r.cfg.training.dtype) == "float32" else 2.0
    p = planner.plan(r, calibration={"act_bytes": act, "cuda_context_bytes": 0.0, "nccl_bytes": 0.0})
    per_rank = p.total_bytes + CPU_PROCESS_BYTES
    return per_rank * r.layout.world_size, per_rank, p


def _batch_that_fits(r, check, avail: int) -> str:
    """``training.local_batch=N (X GiB)``: the largest local batch (halving from the run's) whose
    estimate fits with the measured error to spare, checked by ``check`` (the candidate's batch split and
    component checks, without resolving again); "" when none does."""
    lb = int(r.cfg.training.local_batch)
    while lb > 1:
        lb //= 2
        cfg = copy.deepcopy(r.cfg)
        cfg.training.local_batch = lb
        cand = dataclasses.replace(r, cfg=cfg, ctx=dataclasses.replace(r.ctx, cfg=cfg) if r.ctx is not None else None)
        try:
            cand.grad_accum = check_batch(cfg.training, r.layout)
            check(cand, {d: r.layout.dims[d] for d in ("ep", "cp", "pp", "tp")}, {}, r.layout.world_size)
        except UserError:
            continue
        total = cpu_estimate(cand)[0]
        if total * (1 + MEASURED_ERROR) <= avail:
            return f"training.local_batch={lb} ({total / GiB:,.1f} GiB)"
    return ""


def check_host_memory(r, recipe, overrides, check) -> None:
    """A CPU run on this machine: the estimate for all its ranks against the host's available memory,
    with ``preflight.memory``'s rules and the planner's measured error, as for a GPU. Checked by the
    launching process only (the ranks it starts would see each other's memory as taken)."""
    if "RANK" in os.environ:
        return
    have = host_memory_available()
    if have is None:
        return
    avail, source = have
    total, per_rank, p = cpu_estimate(r)
    if total <= avail * (1 - MEASURED_ERROR):
        return
    n = r.layout.world_size
    terms = sorted(p.terms, key=lambda t: -t.bytes)[:3]
    named = ", ".join(f"{t.name} {t.bytes / GiB:,.1f}" for t in terms)
    head = (f"the planner estimates {total / GiB:,.1f} GiB of host memory for this CPU run ({n} rank(s) x "
            f"({(per_rank - CPU_PROCESS_BYTES) / GiB:,.1f} GiB planned + {CPU_PROCESS_BYTES / GiB:.1f} GiB per "
            f"process)), and this machine has {avail / GiB:,.1f} GiB available ({source}); largest terms (GiB): "
            f"{named}")
    if total > avail * (1 + MEASURED_ERROR) and r.cfg.preflight.memory == "refuse":
        static = static_fit.host_verdict(r, p, n, CPU_PROCESS_BYTES, int(avail * (1 + MEASURED_ERROR)))
        fit = "" if static else _batch_that_fits(r, check, avail)
        fix = (static if static else f"A local batch that fits: {fit}; or a shorter training.seq_len" if fit else
               "No local batch fits at this training.seq_len; shorten it, or use fewer ranks (nproc)")
        raise UserError("preflight.memory=refuse", f"{head}. That is more than the available memory by more than "
                        f"the planner's measured error ({MEASURED_ERROR:.0%}), so the ranks would run out of memory "
                        "(killed by the kernel, or an allocator error) in step 1.",
                        f"{fix}. `apiary plan` shows the terms; preflight.memory=warn launches anyway.")
    verdict = "above" if total > avail else "within " + f"{MEASURED_ERROR:.0%} of"
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[yellow]warning[/yellow] memory: {head}; that is {verdict} the available memory (the planner's "
        f"measured error is {MEASURED_ERROR:.0%}), so step 1 may run out of memory.", markup=True)


def check_gpu_only_settings(cfg) -> None:
    """A GPU-only setting in a run that trains on this machine's CPU: refused (a launch, and `train --cfg job`)."""
    if cfg.training.autotune_configs != "recorded" and _cpu_run(cfg):  # not the default
        raise UserError(f"training.autotune_configs={cfg.training.autotune_configs}", "chooses the configs Triton autotunes "
                        "on a GPU, and this run trains on the CPU, where Triton does not autotune (docs/skills/kernel_cache.md), "
                        "so the setting would be ignored.", "Drop it, or run it on a GPU.")


def check_plan(r, recipe, overrides, check, for_training: bool) -> None:
    """The planner's part of resolving ``r``: the components' choices by memory budget (said on the run's
    first lines, ``r.data_summary``), then for a launch the memory preflight, whose suggestions ``check``
    checks (framework.resolve.resolver.check_candidate)."""
    choose_by_budget(r, for_training)
    r.data_summary = "\n".join(r.ctx.summary)
    if for_training:
        check_gpu_only_settings(r.cfg)
        check_memory(r, recipe, overrides, check)
