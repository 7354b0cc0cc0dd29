"""``plan``: per-GPU memory and step time of a resolved recipe, from the model's shapes and the
chosen components' ``plan_terms`` (framework.plan.planner.parts)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from framework import alloc_conf
from framework.contracts import SELECT, Context, PlanContext, PlanTerms
from framework.errors import UserError
from framework.plan.planner import parts
from framework.plan.planner.constants import Constants, GiB, Hardware
from framework.plan.planner.memory import OUTSIDE, Shapes, Term, stage_terms
from framework.plan.planner.time import StepInputs, flops_per_token, link_bw, step_time


@dataclass
class Plan:
    dims: dict[str, int]
    memory_bytes: dict[str, int]
    total_bytes: int
    gpu_memory_bytes: int
    fits: bool
    verdict: str  # fits | tight | OOM
    headroom_bytes: int
    step_time_s: float
    tflops_per_gpu: float
    tokens_per_s_per_gpu: float
    assumptions: list[str]
    terms: list[Term] = field(default_factory=list)
    time_s: dict[str, float] = field(default_factory=dict)  # compute and exposed comm by part
    choices: dict[str, Any] = field(default_factory=dict)  # gpu, loss, state, recompute, moe_chunk, stage
    warnings: list[str] = field(default_factory=list)
    flops_per_token: float = 0.0  # model FLOPs per trained token (model_flops_per_token)

    @property
    def torch_reserved_bytes(self) -> int:
        """What torch.cuda.max_memory_reserved should read: total less the non-torch reserve and the
        terms outside torch's allocator."""
        outside = sum(t.bytes for t in self.terms if t.group == OUTSIDE)
        return self.total_bytes - self.memory_bytes.get("cuda_context_nccl", 0) - outside

    def to_json(self) -> dict:
        return {
            "dims": self.dims, "memory_bytes": self.memory_bytes, "total_bytes": self.total_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes, "fits": self.fits, "verdict": self.verdict,
            "headroom_bytes": self.headroom_bytes, "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "flops_per_token": self.flops_per_token,
            "torch_reserved_bytes": self.torch_reserved_bytes, "choices": self.choices,
            "time_s": self.time_s, "assumptions": self.assumptions, "warnings": self.warnings,
            "terms": [{"name": t.name, "count": t.count, "bytes_per": t.bytes_per, "bytes": t.bytes,
                       "group": t.group, "formula": t.formula} for t in self.terms],
        }




def constants_for(constants: Constants | None, calibration: dict | None, gpus_per_node: int | None) -> Constants:
    c = constants or Constants()
    if calibration:
        c = c.calibrated(calibration)
    if gpus_per_node is not None:
        if int(gpus_per_node) < 1:
            raise UserError(f"gpus_per_node={gpus_per_node}", "must be >= 1.")
        c = replace(c, gpus_per_node=int(gpus_per_node))
    return c


def for_settings(c: Constants, *, expandable: bool, fp32_combine: bool) -> Constants:
    """The constants for the allocator and MoE combine a run uses: the defaults' fit (expandable
    segments; a MoE combine without fp32 copies), or the earlier fit's constants where a run has
    torch's fixed segments or a combine that keeps fp32 copies (the moe_chunk component's
    ``fp32_combine`` fact)."""
    if expandable and not fp32_combine:
        return c
    c = copy.deepcopy(c)
    if not expandable:
        c.fragmentation_fraction = c.fragmentation_fraction_fixed
    if fp32_combine:
        c.moe_buffer_copies = c.moe_buffer_copies_fp32_combine
        c.components["saved_activation_factor"] = c.components["saved_activation_factor_fp32_combine"]
    return c


def _chosen(resolved) -> dict:
    """The components resolve chose (kind -> object), for plan_terms that read another kind's choice."""
    return dict(resolved.ctx.components) if getattr(resolved, "ctx", None) is not None else {}


def run_constants(resolved, base: Constants, ch: dict[str, str], hw: Hardware) -> Constants:
    """``base`` for the settings this run uses (``for_settings``): the allocator's from the
    environment its ranks start with, the MoE combine's from the moe_chunk component's
    ``fp32_combine`` fact."""
    c = for_settings(base, expandable=alloc_conf.expandable(), fp32_combine=False)
    _, pc = shapes_and_context(resolved, c, hw)
    ctx = Context(resolved.cfg, resolved.facts, resolved.layout, for_training=False, plan=pc,
                  components=_chosen(resolved))
    moe = parts.ask("moe_chunk", ch["moe_chunk"], ctx, [])[1]
    return for_settings(base, expandable=alloc_conf.expandable(), fp32_combine=True) \
        if moe.facts.fp32_combine else c


def gpu_for(c: Constants, gpu: str | None, gpu_memory_bytes: int | None) -> tuple[Hardware, int]:
    """The GPU kind (by memory when not named: above 100 GiB an H200) and the memory to fit."""
    if gpu is None:
        gpu = "H200" if gpu_memory_bytes is not None and gpu_memory_bytes > 100 * GiB else "H100"
    hw = c.gpu(gpu)
    return hw, int(gpu_memory_bytes if gpu_memory_bytes is not None else hw.hbm_bytes)


def choices(cfg, **chosen: str | None) -> dict[str, str]:
    """kind -> name: the argument when given, else the recipe's choice (where contracts.SELECT puts
    it), else the defaults'."""
    def name(kind):
        section, key = SELECT[kind]
        node = cfg.get(section) if hasattr(cfg, "get") else None
        value = node.get(key) if node is not None and hasattr(node, "get") else getattr(node, key, None)
        return str(value) if value is not None else parts.defaults()[kind]
    return {k: v or name(k) for k, v in chosen.items()}


def shapes_and_context(resolved, c: Constants, hw: Hardware) -> tuple[Shapes, PlanContext]:
    """The model's shapes on this layout, and what plan_terms get as ``ctx.plan`` (stage: the only one)."""
    sh = Shapes.of(resolved, c)
    return sh, PlanContext(constants=c, hw=hw, tokens=sh.T, micro_batch=sh.mb, split=sh.split, counts=sh.counts,
                           grad_accum=sh.grad_accum, link_bw=link_bw(hw, c.gpus_per_node), saved=sh.saved,
                           layers=sh.layers)


@dataclass
class Asked:
    """The planned name and terms of each kind (for the memory of each stage and the step time)."""

    names: dict[str, str]
    terms: dict[str, Any] = field(default_factory=dict)


def ask_components(resolved, ch: dict[str, str], pc: PlanContext, warnings: list[str]) -> Asked:
    """precision, recompute and moe_chunk once; the state backend per stage (see stage_memory)."""
    ctx = Context(resolved.cfg, resolved.facts, resolved.layout, for_training=False, plan=pc,
                  components=_chosen(resolved))
    prec_name = str(getattr(resolved.cfg.get("precision"), "name", parts.defaults()["precision"]))
    asked = Asked(names=dict(ch))
    asked.names["precision"], asked.terms["precision"] = parts.ask("precision", prec_name, ctx, warnings)
    asked.names["recompute"], asked.terms["recompute"] = parts.ask("recompute", ch["recompute"], ctx, warnings)
    asked.terms["moe_chunk"] = parts.ask("moe_chunk", ch["moe_chunk"], ctx, warnings)[1]
    asked.names["moe_comm"], asked.terms["moe_comm"] = parts.ask("moe_comm", choices(resolved.cfg, moe_comm=None)
                                                                 ["moe_comm"], ctx, warnings)
    asked.names["adapter"], asked.terms["adapter"] = ask_adapter(resolved, ctx, warnings)
    asked.terms["data"] = ask_data(resolved, ctx)
    publish = resolved.cfg.get("publish")
    if publish is not None and int(publish.get("interval") or 0) > 0:  # the weight hand-off's buffers
        asked.names["transport"], asked.terms["transport"] = parts.ask("transport", str(publish.transport), ctx,
                                                                       warnings)
    return asked


def ask_adapter(resolved, ctx: Context, warnings: list[str]) -> tuple[str, PlanTerms]:
    adapter_name = str(getattr(resolved.cfg.get("adapter"), "name", parts.defaults()["adapter"]))
    return parts.ask("adapter", adapter_name, ctx, warnings)


def ask_data(resolved, ctx: Context) -> PlanTerms:
    """The data component's terms (the documents of its rows); a format without ``plan_terms``
    adds none (documents as long as a row), with no warning: its rows are what the time assumes."""
    section = resolved.cfg.get("data") if hasattr(resolved.cfg, "get") else None
    name = choices(resolved.cfg, data=None)["data"]
    obj = parts.component("data", name)
    return obj.plan_terms(section, ctx) if obj is not None and section is not None else PlanTerms()


def model_flops_per_token(resolved) -> float:
    """Model FLOPs per trained token of ``resolved`` (framework.resolve.resolver.Resolved), the planner's
    convention (``time.flops_per_token``): 6 x active parameters without the embedding, each
    mixer layer kind's own (a causal one at half the full score and value FLOPs), an adapter's
    frozen base at forward + input gradient (no weight gradient) plus the adapters; no recompute.
    What a run's logged ``tflops_per_gpu`` and ``mfu_pct`` count (framework/train/build.py computes it
    once per rank for framework/report/metrics.py). FLOPs depend on no GPU and no calibrated efficiency:
    the default constants' shapes."""
    c = Constants()
    sh, pc = shapes_and_context(resolved, c, c.gpu("H100"))
    ctx = Context(resolved.cfg, resolved.facts, resolved.layout, for_training=False, plan=pc,
                  components=_chosen(resolved))
    per_part, _ = flops_per_token(sh, ask_adapter(resolved, ctx, [])[1])
    return float(sum(per_part.values()))


def with_adapter(state: PlanTerms, adapter: PlanTerms | None) -> PlanTerms:
    """The state backend's terms under an adapter (kind ``adapter``): its static terms named in the
    adapter's ``facts.replace`` replaced (a frozen base has no gradient or optimizer state), its
    buffers scaled by ``facts.buffer_scale`` and its traffic by ``facts.comm_scale``, the
    adapter's own memory terms added."""
    if adapter is None or not (adapter.memory or adapter.facts.replace):
        return state
    repl = adapter.facts.replace
    scale = adapter.facts.buffer_scale
    memory = []
    for t in state.memory:
        if t.name in repl:
            t = repl[t.name]
        elif t.name in scale:
            t = replace(t, count=t.count * scale[t.name], how=f"{t.how} x {scale[t.name]:.3g} (adapters' share)")
        memory.append(t)
    comm = {k: v * adapter.facts.comm_scale.get(k, 1.0) for k, v in state.facts.comm.items()}
    return replace(state, memory=memory + list(adapter.memory), facts=replace(state.facts, comm=comm))


def stage_memory(resolved, sh: Shapes, asked: Asked, pc: PlanContext, warnings: list[str]):
    """(peak stage's name, its terms, the last stage's state and loss terms)."""
    pp = sh.lay.pp
    specs = {"only": (True, True, 1)} if pp == 1 else \
        {"first": (True, False, min(pp, sh.n_mb)), "last": (False, True, 1)}
    stages, last = {}, {}
    for stage, (first, is_last, in_flight) in specs.items():
        spc = replace(pc, first=first, last=is_last, earlier={"precision": asked.terms["precision"]})
        ctx = Context(resolved.cfg, resolved.facts, resolved.layout, for_training=False, plan=spc)
        state = with_adapter(parts.ask("state", asked.names["state"], ctx, warnings)[1], asked.terms.get("adapter"))
        loss = parts.ask("loss", asked.names["loss"], ctx, warnings)[1] if is_last else None
        drop = set(asked.terms["adapter"].facts.drop_loss_terms) if asked.terms.get("adapter") else set()
        if loss is not None and drop:  # e.g. a frozen LM head: the fused head allocates no dW accumulator
            loss = replace(loss, memory=[t for t in loss.memory if t.name not in drop])
        stages[stage] = stage_terms(sh, state=state, recompute=asked.names["recompute"],
                                    rec=asked.terms["recompute"], chunking=asked.terms["moe_chunk"],
                                    precision=asked.terms["precision"], loss=loss, in_flight=in_flight,
                                    transport=asked.terms.get("transport") if first else None,
                                    comm=asked.terms.get("moe_comm"))
        if is_last:
            last = {"state": state, "loss": loss}
    stage, terms = max(stages.items(), key=lambda kv: sum(x.bytes for x in kv[1]))
    return stage, terms, last


def choose_candidate(resolved, sh: Shapes, asked: Asked, pc: PlanContext, mem_cap: int,
                     warnings: list[str]) -> None:
    """A recompute component that plans by memory budget lists ``facts.candidates`` in increasing
    memory (decreasing step time): take the last whose total fits ``mem_cap`` (or the component's
    ``facts.budget_bytes``) less its ``facts.fit_margin`` (binary search: totals only grow along
    the list), the first when none does.
    The chosen candidate replaces the component's terms; its facts get ``reason`` and ``fallbacks``."""
    rec = asked.terms["recompute"]
    cands = rec.facts.candidates
    if not cands:
        return
    mem_cap = int(rec.facts.budget_bytes or mem_cap)
    budget = mem_cap * (1 - float(rec.facts.fit_margin))

    def items(i):
        trial = Asked(names=asked.names, terms={**asked.terms, "recompute": cands[i]})
        return stage_memory(resolved, sh, trial, pc, [])[1]

    def total(i):
        return sum(x.bytes for x in items(i))

    lo, hi = 0, len(cands) - 1
    if total(lo) > budget:
        best, fits = 0, False
    else:
        while lo < hi:  # the last index whose total fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid - 1)
        best, fits = lo, True
    chosen = cands[best]
    outside = sum(x.bytes for x in items(best) if x.name == "cuda_context_nccl" or x.group == OUTSIDE)  # not torch's
    def gib(b: float) -> str:  # a small budget (a CPU run's) keeps its digits
        return f"{b / GiB:,.1f}" if b >= 0.1 * GiB or not b else f"{b / GiB:.2g}"
    split = (f" (torch reserved {gib(total(best) - outside)} + CUDA context and NCCL {gib(outside)})"
             if outside else "")  # none counted: a CPU run's budget
    why = (f"planned {gib(total(best))} GiB{split} of {gib(mem_cap)} GiB less the {rec.facts.fit_margin:.0%} "
           f"margin ({gib(budget)} GiB)" + ("" if fits else "; even the least memory does not fit"))
    # the cheaper candidates, nearest first: where the run steps back to if the allocator retries
    fallbacks = [cands[j].facts.blocks for j in range(best - 1, -1, -1)]
    asked.terms["recompute"] = replace(chosen, facts=replace(chosen.facts, reason=why, fallbacks=fallbacks),
                                       notes=[*chosen.notes, why])
    if not fits:
        warnings.append(f"recompute: no per-block choice fits {budget / GiB:,.1f} GiB; planned with full recompute.")


def plan(resolved, *, gpu_memory_bytes: int | None = None, gpu: str | None = None,
         gpus_per_node: int | None = None, calibration: dict | None = None, constants: Constants | None = None,
         loss: str | None = None, state: str | None = None, recompute: str | None = None,
         moe_chunk: str | None = None) -> Plan:
    """Estimate per-GPU memory and step time for ``resolved`` (framework.resolve.resolver.Resolved).

    ``loss`` / ``state`` / ``recompute`` / ``moe_chunk`` override the recipe's choice by registry
    name; a name that is not registered (or has no ``plan_terms``) is planned as the defaults'
    choice of its kind, with a warning.
    """
    cfg, lay = resolved.cfg, resolved.layout
    base = constants_for(constants, calibration, gpus_per_node)
    hw, mem_cap = gpu_for(base, gpu, gpu_memory_bytes)
    ch = choices(cfg, loss=loss, state=state, recompute=recompute, moe_chunk=moe_chunk)
    c = run_constants(resolved, base, ch, hw)
    sh, pc = shapes_and_context(resolved, c, hw)
    warnings = list(sh.warnings)
    asked = ask_components(resolved, ch, pc, warnings)
    choose_candidate(resolved, sh, asked, pc, mem_cap, warnings)
    rc = asked.names["recompute"]
    stage, terms, last = stage_memory(resolved, sh, asked, pc, warnings)
    warnings[:] = list(dict.fromkeys(warnings))  # each stage may have said the same
    memory = {t.name: t.bytes for t in terms}
    total = sum(memory.values())
    headroom = mem_cap - total
    verdict = "OOM" if headroom < 0 else ("tight" if headroom < c.tight_fraction * mem_cap else "fits")

    st = step_time(StepInputs(sh=sh, hw=hw, names={**ch, "recompute": rc}, recompute=asked.terms["recompute"],
                              loss=last["loss"], state=last["state"], chunking=asked.terms["moe_chunk"],
                              precision=asked.terms["precision"], adapter=asked.terms.get("adapter"),
                              data=asked.terms.get("data")))
    step = sum(st.time_s.values())
    W, dpr, dps, cp, ep, pp, tp = lay.world_size, lay.dp_replicate, lay.dp_shard, lay.cp, lay.ep, lay.pp, lay.tp
    assumptions = [
        f"GPU {hw.name}: {hw.bf16_dense_flops / 1e12:.0f} TFLOP/s bf16 dense, memory {mem_cap / GiB:.1f} GiB, "
        f"HBM {hw.hbm_bw / 1e12:.2f} TB/s; NVLink {hw.nvlink_bw / 1e9:.0f} GB/s collectives, "
        f"{hw.nvlink_alltoall_bw / 1e9:.0f} GB/s all-to-all; IB {hw.ib_bw / 1e9:.0f} / "
        f"{hw.ib_alltoall_bw / 1e9:.0f} GB/s per GPU; {c.gpus_per_node} GPUs per node",
        f"local tokens {sh.T:,.0f} per microbatch (micro batch {sh.mb} x seq {sh.seq} / cp {cp}), {sh.Tt:,.0f} per rank "
        f"after TP {tp}; " + ("one pipeline stage" if stage == "only" else f"peak pipeline stage: {stage}"),
        f"state {ch['state']}, recompute {rc}, loss {ch['loss']}, moe.chunk {ch['moe_chunk']}"
        + (f", adapter {asked.names['adapter']}" if asked.names["adapter"] != parts.defaults()["adapter"] else ""),
        *(asked.terms["adapter"].notes if "adapter" in asked.terms else []),
        *st.assumptions,
        f"reserve: fragmentation {c.fragmentation_fraction:.0%} of allocated, CUDA context + NCCL "
        f"{(c.cuda_context_bytes + c.nccl_bytes) / GiB:.1f} GiB; verdict 'tight' under "
        f"{c.tight_fraction:.0%} headroom",
        "memory: compared with measured peaks on one H200 (torch max reserved): +0.3%..+3.4% for the defaults "
        "(expandable segments, the lean MoE combine) from full recompute to every block kept at 32K-128K, "
        "-4.2%..+5.6% with torch's fixed segments or torchtitan's fp32 combine, -2.6% with the optimizer "
        "offloaded, +0.5% for many short RL "
        "sequences per row; the preflight allows 7% below and 10% above (docs/benchmarks.md, "
        "docs/skills/preflight.md); with CP > 1 (two H200s, CP 2 x EP 2) the activation terms are "
        f"{c.cp_activation_overhead:.0%} larger than counted (cp_activation_overhead): -0.0%..+1.4% (+6.5% LoRA) "
        "with it, and the preflight allows 7% below and 8% above; step time: the efficiencies are measured on one "
        "H200 (the 4-layer Qwen3.5-35B-A3B part by part), the context FLOPs' over long documents from seed 000's "
        "PP1 point; planned -6%..+8% against 26 measured steps at 16K-256K on one and two H200s "
        "(benchmarks/step_time_check.py)",
    ]
    return Plan(dims={"dp_replicate": dpr, "dp_shard": dps, "cp": cp, "ep": ep, "pp": pp, "tp": tp},
                memory_bytes=memory, total_bytes=total, gpu_memory_bytes=mem_cap, fits=verdict != "OOM",
                verdict=verdict, headroom_bytes=headroom, step_time_s=step,
                tflops_per_gpu=st.model_flops_gpu / step / 1e12 if step else 0.0,
                tokens_per_s_per_gpu=st.tokens_step / W / step if step else 0.0, assumptions=assumptions,
                flops_per_token=st.model_flops_gpu * W / st.tokens_step if st.tokens_step else 0.0,
                terms=terms, time_s=st.time_s, choices={"gpu": hw.name, **ch, "recompute": rc, "stage": stage,
                                                        **({"recompute_blocks": asked.terms["recompute"].facts.blocks,
                                                            "recompute_reason": asked.terms["recompute"].facts.reason,
                                                            "recompute_fallbacks": asked.terms["recompute"].facts.fallbacks}
                                                           if asked.terms["recompute"].facts.blocks is not None else {}),
                                                        "adapter": asked.names["adapter"],
                                                        "grad_accum": sh.grad_accum, "microbatches": sh.n_mb},
                warnings=warnings)
