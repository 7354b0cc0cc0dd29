"""Step time: a roofline of FLOPs per part over the GPU's peak x efficiency, the components' time
factors and extra compute, plus the exposed part of EP / CP / TP and the state backend's traffic,
times the pipeline bubble, plus the optimizer step. A mixer kind's context FLOPs count the data's
documents (a packed row of short documents attends within each one: ``context_share``); the model
FLOPs a run logs count the whole causal square. The efficiencies are measured (framework/plan/planner/
constants.py; benchmarks/step_time_check.py holds the estimate to measured steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from framework.contracts import PlanTerms
from framework.plan.planner.constants import Hardware
from framework.plan.planner.memory import Shapes, mixers
from framework.resolve.layout import params_text


@dataclass(kw_only=True)
class StepInputs:
    """What the step-time estimate reads: shapes, the GPU and each chosen component's terms."""

    sh: Shapes
    hw: Hardware
    names: dict[str, str]  # kind -> the name shown (loss, state, recompute, moe_chunk)
    recompute: PlanTerms
    loss: PlanTerms
    state: PlanTerms
    chunking: PlanTerms
    precision: PlanTerms
    adapter: PlanTerms | None = None  # kind adapter: factors of the compute parts, the trained fraction
    data: PlanTerms | None = None  # kind data: facts.document_tokens, the documents a row packs


@dataclass
class StepTime:
    time_s: dict[str, float]
    model_flops_gpu: float
    tokens_step: int
    assumptions: list[str] = field(default_factory=list)


def spans(group: int, stride: int, per_node: int) -> bool:
    """Whether a process group of ``group`` ranks spaced ``stride`` apart leaves one node."""
    return group > 1 and group * stride > per_node


def link_bw(hw: Hardware, per_node: int):
    """(group, stride) -> the per-GPU bandwidth of a ring collective over that group."""
    return lambda group, stride: hw.ib_bw if spans(group, stride, per_node) else hw.nvlink_bw


def flops_per_token(sh: Shapes, adapter: PlanTerms | None = None) -> tuple[dict[str, float], float]:
    """Model FLOPs per token by part (fwd + bwd = 3 x fwd; 2 FLOPs per multiply-add): the dense
    and routed-expert parameters, each mixer layer kind's own FLOPs (its part, ``LayerTerms.
    flops_per_token``; a causal mixer counts only the (query, key) pairs it computes: half of the
    full square's score and value FLOPs), the LM head, each times the
    adapter's ``flops_factor`` (a frozen base: forward and input gradient only, plus the adapters'
    own FLOPs); and the active expert parameters. No recompute: these are the FLOPs the model
    needs, which a run's logged TFLOPs/GPU and MFU count (``model_flops_per_token``)."""
    f, split = sh.f, sh.split
    expert_active = split["experts"] * f.top_k / f.num_experts if f.num_experts else 0.0
    parts = {"dense": 6 * split["dense_blocks"], "experts": 6 * expert_active}
    for k in mixers(sh.layers):
        t = sh.layers[k]
        parts[k] = t.flops_per_token * t.layers
    parts["lm_head"] = 6 * split["head"]
    factor = adapter.flops_factor if adapter is not None else {}
    return {k: v * factor.get(k, 1.0) for k, v in parts.items()}, expert_active


def context_share(sh: Shapes, data: PlanTerms | None) -> float:
    """The fraction of a whole-sequence causal context a token attends: the data's documents
    (``document_tokens``, sum L^2 / sum L: a packed row attends within each document) over the
    sequence, at most 1 (no data fact: documents as long as a row)."""
    n = (data.facts.document_tokens if data is not None else None) or 0
    return min(1.0, float(n) / sh.seq) if n > 0 else 1.0


def time_flops_per_token(sh: Shapes, parts: dict[str, float], share: float) -> dict[str, float]:
    """``parts`` (``flops_per_token``) with each mixer kind's context part (``LayerTerms.
    context_flops_per_token``) scaled by ``share``: the FLOPs the kernels run, which the step time
    counts; the model FLOPs a run logs keep the whole causal square."""
    out = dict(parts)
    for k in mixers(sh.layers):
        t = sh.layers[k]
        if t.context_flops_per_token and t.flops_per_token:
            out[k] = parts[k] * (1 - (1 - share) * t.context_flops_per_token / t.flops_per_token)
    return out


def efficiencies(sh: Shapes) -> tuple[dict[str, float], float]:
    """Achieved/peak per part after the TP and short-sequence scale, and that scale."""
    c, tp = sh.c, sh.lay.tp
    eff = {"dense": c.eff_dense, "experts": c.eff_expert,
           **{k: sh.layers[k].efficiency for k in mixers(sh.layers)}, "lm_head": c.eff_head}
    T_local = sh.mb * sh.seq / sh.lay.cp
    scale = c.tp_gemm_scale ** math.log2(tp) * min(1.0, T_local / c.efficiency_ref_tokens) ** c.efficiency_short_exponent
    return {k: v * scale for k, v in eff.items()}, scale


def compute_times(inp: StepInputs, parts: dict[str, float], eff: dict[str, float], per_gpu_tokens: float) -> dict:
    """Seconds per part: FLOPs (``flops_per_token``, the adapter's factor in) x (1 + recompute's
    extra) / (peak x efficiency), times the precision's, the adapter's and then the loss's time
    factor of that part."""
    extra = inp.recompute.extra_compute
    out = {}
    for k, fl in parts.items():
        t = fl * per_gpu_tokens * (1 + extra.get(k, 0.0)) / (inp.hw.bf16_dense_flops * eff[k])
        t *= inp.precision.time_factor.get(k, 1.0)
        t *= inp.adapter.time_factor.get(k, 1.0) if inp.adapter is not None else 1.0
        out[f"compute_{k}"] = t * inp.loss.time_factor.get(k, 1.0)
    return out


def comm_times(inp: StepInputs, overlap: dict[str, float]) -> dict[str, float]:
    """Bytes on the wire per optimizer step and GPU over the link's bandwidth, by collective;
    ``overlap`` gets the fraction of each hidden under compute."""
    sh, hw = inp.sh, inp.hw
    f, c, lay, mb, seq = sh.f, sh.c, sh.lay, sh.mb, sh.seq
    cp, ep, pp, tp, g = lay.cp, lay.ep, lay.pp, lay.tp, c.gpus_per_node
    reruns = float(inp.recompute.facts.forward_reruns)  # a fraction under a per-block mix
    micro = sh.grad_accum * sh.n_mb  # microbatches per optimizer step
    T_rank = mb * seq / cp / tp
    comm = {}
    if f.num_experts and ep > 1:
        passes = 4 + 2 * reruns  # dispatch + combine, fwd and bwd (+ recompute fwd)
        vol = micro * f.n_layers / pp * passes * f.top_k * T_rank * f.dim * 2 * (ep - 1) / ep * c.ep_load_imbalance
        if ep <= g:
            comm["ep_alltoall"] = vol / hw.nvlink_alltoall_bw
        else:
            inter = (ep - g) / (ep - 1)
            comm["ep_alltoall"] = vol * (1 - inter) / hw.nvlink_alltoall_bw + vol * inter / hw.ib_alltoall_bw
        overlap["ep_alltoall"] = float(inp.chunking.facts.ep_overlap)
    if cp > 1:
        passes = 2 + reruns  # fwd and bwd (+ recompute): each layer kind's CP traffic per pass
        vol = sum(micro * sh.counts[k] * passes * t.cp_comm_bytes for k, t in sh.layers.items())
        comm["cp"] = vol / (hw.ib_bw if spans(cp, tp, g) else hw.nvlink_bw)
        overlap["cp"] = c.cp_overlap
    if tp > 1:
        passes = 8 + 4 * reruns  # AG + RS around attention and FFN, fwd and bwd
        vol = micro * f.n_layers / pp * passes * (tp - 1) / tp * mb * seq / cp * f.dim * 2
        comm["tp"] = vol / (hw.ib_bw if tp > g else hw.nvlink_bw)
        overlap["tp"] = c.tp_overlap
    comm.update(inp.state.facts.comm)
    overlap.update(inp.state.facts.overlap)
    return comm


def step_time(inp: StepInputs) -> StepTime:
    sh, hw = inp.sh, inp.hw
    c, lay, split = sh.c, sh.lay, sh.split
    W, dps, cp, pp, tp = lay.world_size, lay.dp_shard, lay.cp, lay.pp, lay.tp
    tokens_step = sh.local_batch * sh.seq * lay.dp_replicate * dps * sh.grad_accum  # global tokens per optimizer step
    parts, expert_active = flops_per_token(sh, inp.adapter)
    eff, scale = efficiencies(sh)
    per_gpu_tokens = tokens_step / W
    share = context_share(sh, inp.data)
    time_s = compute_times(inp, time_flops_per_token(sh, parts, share), eff, per_gpu_tokens)
    model_flops_gpu = sum(parts.values()) * per_gpu_tokens
    overlap: dict[str, float] = {}
    for k, v in comm_times(inp, overlap).items():
        time_s[f"exposed_{k}"] = v * (1 - overlap[k])
    if pp > 1:
        bubble = (pp - 1) / sh.n_mb
        time_s["pp_bubble"] = bubble * sum(time_s.values())
    dense_stage = (split["dense_blocks"] + split["emb"] + split["head"]) / pp
    exp_stage = split["experts"] / pp
    static_local = (dense_stage + exp_stage) / (dps * cp * tp) * (c.master_bytes + c.adam_bytes + 4)
    trained = inp.adapter.facts.trainable_fraction if inp.adapter is not None else 1.0
    time_s["optimizer"] = c.optimizer_passes * static_local * trained / hw.hbm_bw
    return StepTime(time_s, model_flops_gpu, tokens_step,
                    assumptions(inp, parts, expert_active, eff, scale, overlap, tokens_step))


def assumptions(inp: StepInputs, parts, expert_active, eff, scale, overlap, tokens_step) -> list[str]:
    sh, names = inp.sh, inp.names
    c, lay, split = sh.c, sh.lay, sh.split
    ep, tp, g = lay.ep, lay.tp, c.gpus_per_node
    eff_txt = ", ".join(f"{k} {v:.2f}" for k, v in eff.items())
    where_ep = ("NVLink" if ep <= g else "NVLink + IB") if ep > 1 else "none"
    state_overlap = next(iter(inp.state.facts.overlap.values()), 0)
    loss_factor = inp.loss.time_factor.get("lm_head", 1.0)
    T_local = sh.mb * sh.seq / lay.cp
    share = context_share(sh, inp.data)
    docs = (f"context FLOPs over the data's documents of {share * sh.seq:,.0f} tokens, x{share:.3g} of the causal "
            "square's" if share < 1 else "context FLOPs over the whole causal square (documents as long as a row)")
    return [
        f"FLOPs/token: 6 x active params (dense {params_text(split['dense_blocks'])} + experts "
        f"{params_text(expert_active)} + lm_head {params_text(split['head'])})"
        + "".join(f" + {k} {t.layers} layers x {t.flops_how or f'{t.flops_per_token:,.0f}'}"
                  for k, t in sh.layers.items() if k in parts)
        + (" (" + ", ".join(f"{k} x {v:.3g}" for k, v in inp.adapter.flops_factor.items())
           + ": the adapter's frozen GEMMs without weight gradients, plus the adapters)"
           if inp.adapter is not None and inp.adapter.flops_factor else "")
        + f" = {sum(parts.values()) / 1e9:.1f} GFLOP/token; TFLOPs/GPU counts model FLOPs (no recompute), "
        "as a run's logged tflops_per_gpu and MFU do",
        f"recompute {names['recompute']}: " + "; ".join(inp.recompute.notes)
        + f"; loss layer x {loss_factor:g} of its GEMM time ({names['loss']})",
        f"efficiency (achieved/peak, after x{scale:.2f} for TP {tp} and {T_local:,.0f} local tokens): {eff_txt}; "
        + docs,
        f"EP {ep} all-to-all over {where_ep}, {int(100 * overlap.get('ep_alltoall', 0))}% overlapped "
        f"(moe.chunk {names['moe_chunk']}); CP {lay.cp} {int(100 * c.cp_overlap)}% overlapped; "
        f"{names['state'] if inp.state.facts.label is None else inp.state.facts.label} {int(100 * state_overlap)}% "
        f"overlapped; TP {tp} {int(100 * c.tp_overlap)}% overlapped",
        "; ".join(inp.precision.notes),
        f"PP {lay.pp}: {sh.n_mb} microbatch(es) per micro-step, 1F1B bubble (pp-1)/microbatches; "
        f"{sh.grad_accum} gradient-accumulation step(s); {tokens_step:,} tokens per optimizer step",
    ]
