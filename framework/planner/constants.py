"""The planner's constants: GPU peaks (``HARDWARE``) and every number the estimate assumes
(``Constants``), each with its reason; ``Constants().calibrated({...})`` overrides any of them.

Some constants are facts of one component (bytes per parameter of a state backend, a loss's time
factor, a chunk policy's overlap); the components read them from here through their
``plan_terms`` (``ctx.plan.constants``) so that one calibration file covers the whole estimate.
Dict-valued constants are keyed by what the component's ``plan_terms`` return.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields

from framework.errors import UserError, did_you_mean

GiB = 2**30
MiB = 2**20


def _c(default, doc: str):
    """A documented constant: ``Constants.doc(name)`` returns the reason for its value."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class Hardware:
    """Peak numbers of one GPU kind (vendor datasheets; effective bandwidths are busbw-style)."""

    name: str
    bf16_dense_flops: float  # bf16 tensor-core FLOP/s, dense (no 2:4 sparsity)
    hbm_bytes: int  # memory the allocator can use, roughly
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # effective per-GPU bandwidth of ring all-gather / reduce-scatter inside a node
    nvlink_alltoall_bw: float  # effective per-GPU all-to-all bandwidth inside a node
    ib_bw: float  # effective per-GPU bandwidth of collectives across nodes (one 400 Gb/s NIC per GPU)
    ib_alltoall_bw: float  # effective per-GPU all-to-all bandwidth across nodes


HARDWARE = {
    # H100 SXM: 989 TFLOP/s bf16 dense, 80 GiB HBM3 at 3.35 TB/s, NVLink 4 (450 GB/s per direction;
    # NCCL ring busbw ~360 GB/s), ConnectX-7 400 Gb/s = 50 GB/s per GPU (~45 achievable). All-to-all
    # inside a node ~150 GB/s (DeepEP v1 intranode EP8 measured 153/158 GB/s on H800; ../shared/FACTS.md).
    "H100": Hardware("H100", 989e12, 80 * GiB, 3.35e12, 360e9, 150e9, 45e9, 40e9),
    # H200: the H100 die with 141 GB HBM3e (about 140 GiB usable) at 4.8 TB/s; same links.
    "H200": Hardware("H200", 989e12, 140 * GiB, 4.8e12, 360e9, 150e9, 45e9, 40e9),
}


@dataclass
class Constants:
    """Everything the estimate assumes. Override with ``Constants().calibrated({...})``."""

    # ---- static state, bytes per parameter --------------------------------------------------
    fsdp2_param_bytes: float = _c(0.0, "fsdp2: persistent low-precision parameter copy besides the fp32 "
                                  "shard. torchtitan keeps only the fp32 shard (counted as the master in "
                                  "optimizer_states) and casts to bf16 when it all-gathers (fsdp buffers), so 0. "
                                  "Seed 000's accounting (params + grads = 6 B/param) corresponds to 2.")
    fsdp2_grad_bytes: float = _c(4.0, "fsdp2: sharded gradient in the fp32 reduce dtype (torchtitan "
                                 "mixed_precision_reduce=float32).")
    zero1_param_bytes: float = _c(2.0, "zero1: bf16 model parameters replicated over data parallel "
                                  "(Megatron distributed-optimizer semantics).")
    zero1_grad_bytes: float = _c(4.0, "zero1: fp32 main gradients replicated over data parallel (Megatron).")
    master_bytes: float = _c(4.0, "fp32 master weights, sharded over all data-parallel ranks (both backends).")
    adam_bytes: float = _c(8.0, "AdamW exp_avg + exp_avg_sq in fp32, sharded like the master.")
    tied_embeddings: bool = _c(False, "whether tok_embeddings and lm_head share a matrix (ModelFacts does "
                               "not say; apiary's large flavors are untied).")

    # ---- communication buffers ----------------------------------------------------------------
    fsdp_allgather_units: int = _c(2, "FSDP2 keeps the current unit's all-gathered params and prefetches "
                                   "the next: the largest unit (often the lm_head) plus this many minus one "
                                   "transformer blocks are counted (embedding and lm_head are never gathered together).")
    fsdp_allgather_bytes: float = _c(2.0, "bytes per element of an all-gathered parameter (bf16 param_dtype).")
    fsdp_unsharded_grad_bytes: float = _c(2.0, "unsharded gradient of one unit in the param dtype (bf16).")
    fsdp_reduce_bytes: float = _c(4.0, "reduce-scatter input of one unit in the fp32 reduce dtype.")
    zero1_bucket_params: float = _c(40e6, "zero1: gradient-reduction bucket size in parameters (Megatron "
                                    "default ~40M); two buckets in flight, fp32.")

    # ---- activations --------------------------------------------------------------------------
    act_bytes: float = _c(2.0, "bytes per saved activation element (bf16 compute).")
    selective_keep: dict = _c({"attention": 0.1, "linear_attention": 0.1, "moe": 0.1, "mlp": 0.1},
                              "selective recompute: fraction of a layer kind's saved activations kept. "
                              "torchtitan's op-level SAC keeps matmul (every other mm), attention and "
                              "collective outputs and recomputes elementwise ops and custom kernels' saves. "
                              "Fitted to one H200 measurement (4-layer Qwen3.5-35B-A3B, 32K tokens: 98.7 GiB "
                              "torch reserved against 97.2 with full recompute); 0.1 plans 99.7")
    saved_activation_factor: dict = _c({"attention+moe": 0.2, "linear_attention+moe": 2.0},
                                       "what autograd really saves in a block kept whole (no recompute), over "
                                       "per_token_saved's count of the block (mixer + FFN + norms), by the block's "
                                       "mixer + FFN kind (1.0 for a kind not listed). Fitted to one H200 sitting "
                                       "(2026-11-27; 4-layer Qwen3.5-35B-A3B at full width, 32K tokens; "
                                       "benchmarks/planner_accuracy.sh): keeping the attention block added 2.0 GiB, "
                                       "each GatedDeltaNet block 9.8 GiB (fla's kernels save "
                                       "fp32 chunk states); full, selective, none and two per-block mixes all plan "
                                       "within 1.0% of their measured peaks with these. Dense blocks are not measured "
                                       "(1.0, the count as it is)")
    grad_working_factor: float = _c(0.5, "backward working set of one block (activation gradients alive while "
                                    "a layer's backward runs), as a fraction of that layer's saved activations.")
    moe_buffer_copies: float = _c(4.0, "transient [top_k x tokens, dim] bf16 tensors alive at a MoE layer's "
                                  "peak beyond autograd's saves: dispatch send, dispatch receive, unpermuted "
                                  "expert output, combine receive.")
    ep_load_imbalance: float = _c(1.2, "tokens received by the busiest EP rank over the mean (no token "
                                  "dropping in torchtitan, so the busiest rank sizes buffers and time).")
    cp_kv_copies: float = _c(2.0, "CP: all-gathered K,V of one attention layer plus their gradients.")
    gdn_chunk: int = _c(64, "GatedDeltaNet chunk length of fla's chunked kernels (FLOPs of the intra-chunk part).")

    # ---- loss ---------------------------------------------------------------------------------
    ce_logits_bytes: float = _c(2.0, "ce: bf16 lm_head output [tokens, vocab/TP].")
    ce_fp32_bytes: float = _c(4.0, "ce: fp32 logits (or log-softmax output) [tokens, vocab/TP] (seed 000: "
                              "65,536 x 124,160 x 4 = 32.55 GB).")
    ce_grad_bytes: float = _c(4.0, "ce: fp32 gradient of the logits [tokens, vocab/TP] in backward.")
    chunked_num_chunks: int = _c(8, "chunked: chunks when the recipe's loss does not say (torchtitan default 8).")
    linear_ce_hidden_grad_bytes: float = _c(4.0, "linear_ce: gradient of the lm_head input [tokens, dim] "
                                            "(FACTS: Liger +0.36 GiB, Cut-CE +0.13 GiB at 32K tokens beyond "
                                            "the lm_head weight gradient).")
    loss_time_factor: dict = _c({"ce": 1.65, "chunked": 1.70, "linear_ce": 1.25},
                                "loss layer time over its 3 GEMMs alone (FACTS, one H200, V=248,320, 32K "
                                "tokens: naive 1.68x, torch chunked 1.66x, Liger/Cut-CE 1.24-1.25x).")

    # ---- reserve ------------------------------------------------------------------------------
    cuda_context_bytes: float = _c(1.0 * GiB, "CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator.")
    nccl_bytes: float = _c(1.5 * GiB, "NCCL communicator buffers for the PP/DP/CP/EP/TP groups: outside "
                           "torch's allocator.")
    fragmentation_fraction: float = _c(0.08, "torch caching-allocator reserve over allocated bytes (MoE's "
                                       "variable shapes fragment; expandable_segments lowers it).")
    tight_fraction: float = _c(0.10, "verdict 'tight' when headroom is below this fraction of GPU memory.")

    # ---- step time ----------------------------------------------------------------------------
    gpus_per_node: int = _c(8, "GPUs behind one NVLink domain; groups spanning more use IB.")
    eff_dense: float = _c(0.40, "achieved/peak FLOPs of dense GEMMs (attention projections, shared "
                          "expert, dense MLP) at 16K-32K local tokens. The five eff_* values are one guess "
                          "(0.60/0.40/0.45/0.25/0.60) times 0.66, the factor that reproduces seed 000's PP1 anchor "
                          "(180.18 TFLOPs/GPU, Megatron, 32 x H100); see docs/skills/planner.md.")
    eff_expert: float = _c(0.26, "achieved/peak FLOPs of routed-expert grouped GEMMs (small expert hidden "
                           "sizes such as 512 run far from peak).")
    eff_attention: float = _c(0.30, "achieved/peak FLOPs of causal flash/flex attention fwd+bwd.")
    eff_linear_attention: float = _c(0.17, "achieved/peak FLOPs of fla's chunked gated-delta-rule kernels "
                                     "(largely memory bound).")
    eff_head: float = _c(0.40, "achieved/peak FLOPs of the lm_head GEMMs before loss_time_factor.")
    tp_gemm_scale: float = _c(0.9, "efficiency multiplier per doubling of TP (narrower GEMMs, more launches); "
                              "a guess, so that TP is not free in --search.")
    efficiency_ref_tokens: int = _c(16384, "per-rank tokens per microbatch at and above which the efficiencies "
                                    "hold; below it they shrink (seed 000: local seq under 16K fragments compute "
                                    "and exposes launch/CPU overhead).")
    efficiency_short_exponent: float = _c(0.25, "efficiency x (tokens / efficiency_ref_tokens) ** this, below the "
                                          "reference (a guess).")
    selective_recompute_fraction: float = _c(0.9, "selective: the share of full recompute's extra time it still "
                                             "pays. Fitted to one H200 measurement (4-layer Qwen3.5-35B-A3B, 32K "
                                             "tokens: 52,773 tok/s against 52,197 full and 60,443 none): the custom "
                                             "kernels (GatedDeltaNet, flex attention) rerun whole under op-level SAC")
    ep_overlap: dict = _c({"none": 0.0, "chunk2": 0.25, "chunk3": 0.3, "chunk4": 0.3, "auto": 0.3},
                          "fraction of EP all-to-all hidden under expert compute, by moe.chunk (0.25 for chunk2 "
                          "gives seed 000's single-MoE-layer proxy gain at 32K, +18%, in this model).")
    cp_overlap: float = _c(0.3, "fraction of CP K/V all-gather traffic hidden under compute.")
    tp_overlap: float = _c(0.0, "fraction of TP traffic hidden (async TP off).")
    fsdp_overlap: float = _c(0.85, "fraction of FSDP all-gather/reduce-scatter hidden by prefetching.")
    zero1_overlap: float = _c(0.5, "fraction of ZeRO-1 grad reduce-scatter / param all-gather hidden.")
    optimizer_passes: float = _c(2.0, "HBM passes over the local static state in the optimizer step (read+write).")

    # ---- precision=fp8 ------------------------------------------------------------------------
    fp8_flops_ratio: float = _c(2.0, "FP8 over bf16 tensor-core peak on Hopper (H100/H200 SXM: 1,979 vs 989 "
                                "TFLOP/s dense, datasheets): the FP8 GEMMs' time is the bf16 time / this.")
    fp8_cast_overhead: float = _c(1.29, "precision=fp8 without compile: amax, scale and cast kernels of each FP8 "
                                  "GEMM's operands (forward and backward), as a fraction of the bf16 GEMM time. "
                                  "Fitted on an H200 (benchmarks/fp8_experts_bench.py, 2026-11-24): torchao's FP8 "
                                  "expert layer took 1.79x bf16's time at 1024 tokens per expert (Qwen3-30B-A3B, "
                                  "16K); its dense linears measured more (3.72x, fp8_linear_bench.py at 16K tokens).")
    fp8_cast_overhead_compiled: float = _c(1.09, "the same with precision.compile=true: the compiled FP8 expert "
                                           "layer took 1.59x bf16's time on the same H200 benchmark (the casts are "
                                           "torchao's own kernels, which compile does not fuse).")
    fp8_copy_bytes: float = _c(2.0, "precision=fp8: bytes per converted parameter of a block in compute: its FP8 "
                               "weight (1 B) and the transposed / column-scaled FP8 copy the input-gradient GEMM "
                               "uses (1 B), plus per-row or per-tensor scales (negligible).")
    fp8_allgather_bytes: float = _c(1.0, "precision=fp8 with FP8 all-gather (torchao tensorwise): bytes per "
                                    "all-gathered element of a converted linear (its scale is one fp32 per tensor).")

    hardware: dict = _c({k: asdict(v) for k, v in HARDWARE.items()}, "GPU peak numbers by name (see HARDWARE).")

    @classmethod
    def doc(cls, name: str) -> str:
        return next(f.metadata.get("doc", "") for f in fields(cls) if f.name == name)

    def calibrated(self, overrides: dict | None) -> "Constants":
        """A copy with ``{"name": value, "dict_name.key": value, "hardware.H100.ib_bw": value}`` applied."""
        new = copy.deepcopy(self)
        names = [f.name for f in fields(self)]
        for key, value in (overrides or {}).items():
            head, _, rest = str(key).partition(".")
            if head not in names:
                raise UserError(f"calibration {key}", "unknown planner constant.",
                                did_you_mean(head, names) or f"Known: {', '.join(names)}.")
            if not rest:
                old = getattr(new, head)
                setattr(new, head, type(old)(value) if isinstance(old, (int, float, bool)) and
                        not isinstance(value, (dict, list)) else value)
                continue
            node = getattr(new, head)
            parts = rest.split(".")
            for p in parts[:-1]:
                if not isinstance(node, dict) or p not in node:
                    raise UserError(f"calibration {key}", f"no entry {p!r} under {head}.",
                                    did_you_mean(p, node) if isinstance(node, dict) else "")
                node = node[p]
            if not isinstance(node, dict):
                raise UserError(f"calibration {key}", f"{head} is a scalar; set it as {head}=VALUE.")
            node[parts[-1]] = float(value) if isinstance(value, (int, float, str)) and \
                _is_number(value) else value
        return new

    def gpu(self, name: str) -> Hardware:
        if name not in self.hardware:
            raise UserError(f"gpu={name}", "unknown GPU kind.",
                            did_you_mean(name, self.hardware) or f"Known: {', '.join(self.hardware)}.")
        return Hardware(**self.hardware[name])


def _is_number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False
