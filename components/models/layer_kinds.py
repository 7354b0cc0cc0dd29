"""The layer kinds of apiary's model families, as the planner counts them (framework/contracts/plan.py
``LayerKind``): softmax attention, GatedDeltaNet linear attention, a routed MoE and a dense SwiGLU
MLP. Each says, per layer and token, the activation elements it saves for backward, the FLOPs
beyond 6 x its parameters, what recompute keeps of it and what context parallelism adds; the
planner sums them over ``ModelFacts.layer_kinds`` without knowing any by name.

``PLAN_CONSTANTS`` are their calibrated constants (a family module exposes them as its own, so
``apiary plan calib.NAME=VALUE`` reaches them; docs/skills/planner.md lists them). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.contracts import LayerShape, LayerTerms, PlanConstant, Term

ATTENTION, LINEAR_ATTENTION, MOE, MLP = "attention", "linear_attention", "moe", "mlp"

PLAN_CONSTANTS = {
    "selective_keep": PlanConstant(
        {ATTENTION: 0.1, LINEAR_ATTENTION: 0.1, MOE: 0.1, MLP: 0.1},
        "selective recompute: fraction of a layer kind's saved activations kept (0.5 for a kind not listed). "
        "torchtitan's op-level SAC keeps matmul (every other mm), attention and collective outputs and "
        "recomputes elementwise ops and custom kernels' saves. Fitted to one H200 measurement (4-layer "
        "Qwen3.5-35B-A3B, 32K tokens: 98.7 GiB torch reserved against 97.2 with full recompute); 0.1 plans 99.7"),
    "saved_activation_factor": PlanConstant(
        {f"{ATTENTION}+{MOE}": 1.42, f"{LINEAR_ATTENTION}+{MOE}": 1.56, MOE: 1.14},
        "saved_activation_factor_fp32_combine's meaning where the MoE combine keeps no fp32 copies "
        "(components/moe/lean_combine.py; the planner's fp32_combine fact false). Fitted on one H200 "
        "(2026-11-28; 4-layer Qwen3.5-35B-A3B at full width, expandable segments, 11 measured runs from full "
        "recompute to every block kept at 32K, 64K and 128K): planned +0.3%..+3.4% over torch's reserved "
        "peak. The kept saves count about 1.4x the first fit here because the reserve's growth with kept "
        "blocks (allocated 87 -> 106 GiB, reserved 95 -> 124 GiB at 64K) is folded into them."),
    "saved_activation_factor_fp32_combine": PlanConstant(
        {f"{ATTENTION}+{MOE}": 1.85, f"{LINEAR_ATTENTION}+{MOE}": 2.0, MOE: 1.54},
        "what autograd really saves in a block kept whole (no recompute), over the elements counted for the "
        "block (mixer + FFN + norms), by the block's mixer + FFN kind (1.0 for a kind not listed; a number: "
        "every kind). Measured on one H200 (2026-11-27; 4-layer Qwen3.5-35B-A3B at full width, 32K tokens, "
        "recompute none; benchmarks/step_profile.py --parts): a GatedDeltaNet block leaves 9.9 GiB allocated "
        "in forward (mixer 4.0, MoE 4.7, two norms 1.25; fla's kernels save fp32 chunk states), an attention "
        "block 8.3 GiB (mixer 2.3, MoE 4.7, norms 1.25); counted, they are 5.4 and 4.5 GiB. Keeping the "
        "stage's last block costs almost nothing over full recompute, which reruns it first in backward (the "
        "4-layer proxy's attention block: +2.0 GiB measured): the planner places kept blocks last and counts "
        "a rerun net of the saves already freed (framework.contracts.stage_activation_elements). An FFN kind "
        "alone (key without '+'): its own part, for a block that keeps its mixer and reruns the FFN (the MoE: "
        "4.67 GiB measured over 3.03 counted). Dense blocks are not measured (1.0, the count as it is)"),
    "eff_attention": PlanConstant(
        0.49, "achieved/peak FLOPs of causal flash/flex attention fwd+bwd over long documents. apiary's measured "
              "runs train packed documents of about 1.3K tokens (the packaged corpus), whose attention is ~1% of "
              "the step, so no apiary run measures it; the one measurement over long documents is seed 000's PP1 "
              "point (180.18 TFLOPs/GPU, Megatron, 32 x H100, 128K, CP 4: attention two thirds of its FLOPs), "
              "which the planner reproduces with 0.49 and the other parts at their measured efficiencies "
              "(eff_dense, eff_expert, eff_head: framework/plan/planner/constants.py)."),
    "eff_linear_attention": PlanConstant(
        0.05, "achieved/peak FLOPs of GatedDeltaNet's own part (fla's chunked gated delta rule, the causal conv, "
              "l2 norms, gates; largely memory bound), per FLOP of its count: a GatedDeltaNet mixer's forward "
              "less its projections at the attention mixer's rate, one H200 (block_parts_32k_recompute_none.txt: "
              "13.5 ms against 8.4 ms, 0.033; block_parts_64k_recompute_full.txt: 22.9 against 16.8, 0.10; "
              "docs/bench_data/h200_20261127c)."),
    "gdn_chunk": PlanConstant(64, "GatedDeltaNet chunk length of fla's chunked kernels (FLOPs of the intra-chunk "
                                  "part)."),
    "cp_kv_copies": PlanConstant(2.0, "CP: all-gathered K,V of one attention layer plus their gradients."),
}


def _factors(c, mixer: str) -> dict[str, float]:
    """``saved_activation_factor`` of a mixer kind, by FFN kind ("*": a number for every kind)."""
    fit = c.saved_activation_factor
    if not isinstance(fit, dict):
        return {"*": float(fit)}
    return {k.split("+", 1)[1]: float(v) for k, v in fit.items() if k.split("+", 1)[0] == mixer and "+" in k}


def _ffn_factor(c, ffn: str) -> dict[str, float]:
    """``saved_activation_factor`` of an FFN kind's own part of a block ({"*": factor})."""
    fit = c.saved_activation_factor
    return {"*": float(fit.get(ffn, 1.0) if isinstance(fit, dict) else fit)}


def _keep(c, kind: str) -> float:
    return float(c.selective_keep.get(kind, 0.5))


@dataclass(frozen=True)
class Attention:
    """Softmax attention (GQA, q/k norms, RoPE; Qwen3.5's output gate counted in its saves)."""

    layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    name: str = ATTENTION

    def plan_terms(self, s: LayerShape) -> LayerTerms:
        c, d = s.constants, self.dim
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        cp_memory = []
        if s.cp > 1:
            cp_memory.append(Term("cp_kv_allgather", s.micro_batch * s.seq * 2 * kv / s.tp * c.cp_kv_copies,
                                  c.act_bytes, "buffers",
                                  f"{s.micro_batch} x seq {s.seq} x 2 x kv {kv}/{s.tp} x {c.cp_kv_copies:g} copies x "
                                  f"{c.act_bytes:g} B (one layer)"))
        return LayerTerms(
            name=self.name, role="mixer", layers=self.layers,
            # q/k/v projection input; q and k before and after q/k-norm + RoPE; v; the K,V of the other
            # CP ranks that attention saves (all-gather CP); attention output and o_proj input
            # (output gate / reshape); fp32 log-sum-exp per head.
            saved_per_token=d + 2 * q + 3 * kv + 2 * kv * (s.cp - 1) + 2 * q + 2 * self.n_heads,
            partial_keep=_keep(c, self.name), saved_factor=_factors(c, self.name),
            flops_per_token=6 * s.seq * q,  # = 12 x seq x heads x head_dim / 2 (causal)
            flops_how=f"12 x seq x {self.n_heads} heads x {self.head_dim} / 2 (causal; torchtitan's count, "
                      "logged as tflops_per_gpu_torchtitan, does not halve it)",
            efficiency=float(c.eff_attention),
            context_flops_per_token=6 * s.seq * q,  # all of it: QK^T and PV grow with the context attended
            # projections (q with its gate), then QK^T and PV over a causal context
            forward_flops_per_token=2 * (d * (2 * q + 2 * kv) + q * d) + 2 * s.seq * q,
            # torchtitan's selective save list holds flex attention's and SDPA's outputs: none reruns
            partial_rerun=0.0,
            # K,V all-gather fwd, dK,dV reduce-scatter bwd: the other ranks' K,V in bf16
            cp_comm_bytes=(s.cp - 1) * s.micro_batch * s.seq / s.cp * 2 * kv / s.tp * 2,
            cp_memory=cp_memory)


@dataclass(frozen=True)
class GatedDeltaNet:
    """Qwen3.5's GatedDeltaNet linear attention (fla's chunked gated delta rule)."""

    layers: int
    dim: int
    key_dim: int
    value_dim: int
    key_heads: int
    value_heads: int
    name: str = LINEAR_ATTENTION

    def plan_terms(self, s: LayerShape) -> LayerTerms:
        c, d = s.constants, self.dim
        kd, vd, hv = self.key_dim, self.value_dim, self.value_heads
        dk, dv = kd / self.key_heads, vd / hv
        state = hv * dk * dv  # per-head k x v state elements
        cp_memory = []
        if s.cp > 1:
            cp_memory.append(Term("cp_state_allgather", s.micro_batch * s.cp * state, 4.0, "buffers",
                                  f"{s.micro_batch} x cp {s.cp} x {state:,.0f} state elements (per-head k x v) x 4 B"))
        return LayerTerms(
            name=self.name, role="mixer", layers=self.layers,
            # input; q,k,v before and after the causal conv (+SiLU); l2-normed q,k; the output gate z;
            # fp32 beta and decay per value head; core output and gated-norm output (o_proj input).
            saved_per_token=d + 2 * (2 * kd + vd) + 2 * kd + vd + 4 * hv + 2 * vd,
            partial_keep=_keep(c, self.name), saved_factor=_factors(c, self.name),
            flops_per_token=3 * hv * (4 * dk * dv + 2 * c.gdn_chunk * (dk + dv)),
            flops_how="GatedDeltaNet 3 x value_heads x (4 dk dv + 2 x chunk x (dk + dv))",
            efficiency=float(c.eff_linear_attention),
            forward_flops_per_token=2 * (d * (2 * kd + 2 * vd) + vd * d) + 4 * (kd / max(1, self.key_heads)) * vd,
            # fla's triton kernels are on no selective save list (not aten ops): they rerun whole in backward
            partial_rerun=1.0,
            cp_comm_bytes=(s.cp - 1) * s.micro_batch * state * 4,  # fp32 states passed along the chain
            cp_memory=cp_memory)


@dataclass(frozen=True)
class MoE:
    """Routed experts (top-k of num_experts) with an optional shared expert."""

    layers: int
    dim: int
    num_experts: int
    top_k: int
    moe_hidden_dim: int
    shared_expert_hidden_dim: int = 0
    name: str = MOE

    def plan_terms(self, s: LayerShape) -> LayerTerms:
        d, k, h, sh = self.dim, self.top_k, self.moe_hidden_dim, self.shared_expert_hidden_dim
        return LayerTerms(
            name=self.name, role="ffn", layers=self.layers,
            # router/expert input; fp32 router logits and probabilities; permuted expert input and
            # combine input [top_k, dim]; w1, w3 outputs and their product [top_k, hidden]; shared
            # expert w1, w3, product; the shared-expert gate.
            saved_per_token=d + 4 * self.num_experts + 2 * k * d + 3 * k * h + 3 * sh + 1,
            partial_keep=_keep(s.constants, self.name), saved_factor=_ffn_factor(s.constants, self.name),
            forward_flops_per_token=2 * (k * 3 * d * h + 3 * d * sh))


@dataclass(frozen=True)
class MLP:
    """Dense SwiGLU MLP."""

    layers: int
    dim: int
    ffn_hidden_dim: int
    name: str = MLP

    def plan_terms(self, s: LayerShape) -> LayerTerms:
        return LayerTerms(name=self.name, role="ffn", layers=self.layers,
                          saved_per_token=self.dim + 3 * self.ffn_hidden_dim,  # input; w1, w3 outputs, product
                          partial_keep=_keep(s.constants, self.name), saved_factor=_ffn_factor(s.constants, self.name),
                          forward_flops_per_token=2 * 3 * self.dim * self.ffn_hidden_dim)


def standard_kinds(f) -> tuple:
    """The layer kinds of a ModelFacts that names none: its attention layers, GatedDeltaNet layers
    (``linear_attn`` shapes) and, in every layer, the MoE (``num_experts`` > 0) or the dense MLP."""
    kinds = [Attention(f.n_attention_layers, f.dim, f.n_heads, f.n_kv_heads, f.head_dim)] \
        if f.n_attention_layers else []
    la = f.linear_attn or {}
    if f.n_linear_attention_layers and la:
        kinds.append(GatedDeltaNet(f.n_linear_attention_layers, f.dim, la["key_dim"], la["value_dim"],
                                   la["key_heads"], la["value_heads"]))
    if f.num_experts:
        kinds.append(MoE(f.n_layers, f.dim, f.num_experts, f.top_k, f.moe_hidden_dim, f.shared_expert_hidden_dim))
    else:
        kinds.append(MLP(f.n_layers, f.dim, f.ffn_hidden_dim))
    return tuple(kinds)
