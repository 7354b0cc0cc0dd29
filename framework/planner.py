"""The planner: per-GPU memory and step-time estimate for a resolved recipe, before any launch.

Memory is a list of named terms, each ``count x bytes_per`` (a tensor's element count times the
bytes of one element), for the busiest pipeline stage:

* static state: parameters, gradients, optimizer states (fp32 master + Adam moments), sharded
  as the state backend shards them (``fsdp2``: everything over the data-parallel ranks of each
  parameter's mesh, i.e. dense params over dp_shard x cp (x tp), routed experts over ep x efsdp;
  ``zero1``: params and grads follow PP/EP/TP, optimizer state + master sharded over DP);
* activations for ``none`` / ``selective`` / ``full`` recompute, per layer kind (softmax
  attention, GatedDeltaNet linear attention, MoE with router, dense MLP, norms) on the local
  tokens ``micro_batch x seq_len / cp`` (divided by TP: sequence parallel);
* MoE dispatch/combine buffers, logits/loss temporaries per loss (``ce``, ``chunked``,
  ``linear_ce``), FSDP all-gather/reduce-scatter buffers, CP buffers;
* a reserve for the CUDA context, NCCL and allocator fragmentation.

Step time is a roofline: model FLOPs per part (dense GEMMs, routed experts, attention, linear
attention, LM head) over the GPU's peak times a per-part efficiency, plus recompute, plus the
exposed (not overlapped) part of EP / CP / TP / FSDP / ZeRO-1 traffic over NVLink or IB, times the
pipeline bubble, plus the optimizer step.

Every number the estimate uses lives in ``Constants`` with its reason; a calibration dict
(dotted keys, e.g. ``{"eff_expert": 0.35, "hardware.H100.ib_bw": 40e9}``) overrides any of them.
The constants are engineering estimates: they have not yet been compared with measured GPU
peaks (``estimate_for_run`` writes the estimate next to the measured peak so they can be).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

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
    selective_keep: dict = _c({"attention": 0.5, "linear_attention": 0.5, "moe": 0.5, "mlp": 0.5},
                              "selective recompute: fraction of a layer kind's saved activations kept. "
                              "torchtitan's op-level SAC keeps matmul (every other mm), attention and "
                              "collective outputs and recomputes elementwise ops; 0.5 is a guess.")
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
    linear_ce_tile_bytes: float = _c(64 * MiB, "linear_ce: one [token-tile, vocab-tile] logits tile and its "
                                     "statistics (Cut-CE / Liger style kernels).")
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
    selective_recompute_fraction: float = _c(0.5, "selective: fraction of forward GEMM FLOPs rerun in backward "
                                             "(every other mm); attention outputs are kept.")
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
    fp8_cast_overhead: float = _c(0.20, "precision=fp8 without compile: amax, scale and cast kernels of each FP8 "
                                  "GEMM's operands (forward and backward), as a fraction of the bf16 GEMM time "
                                  "(a guess, to be fitted from benchmarks/fp8_bench.sh).")
    fp8_cast_overhead_compiled: float = _c(0.08, "the same with precision.compile=true (casts fused into "
                                           "neighbouring kernels; a guess).")
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


@dataclass
class Term:
    """One memory term: ``count`` elements (or units) of ``bytes_per`` bytes each."""

    name: str
    count: float
    bytes_per: float
    group: str  # static | activations | loss | buffers | reserve
    formula: str

    @property
    def bytes(self) -> int:
        return int(round(self.count * self.bytes_per))


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

    @property
    def torch_reserved_bytes(self) -> int:
        """What torch.cuda.max_memory_reserved should read: total less the non-torch reserve."""
        return self.total_bytes - self.memory_bytes.get("cuda_context_nccl", 0)

    def to_json(self) -> dict:
        return {
            "dims": self.dims, "memory_bytes": self.memory_bytes, "total_bytes": self.total_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes, "fits": self.fits, "verdict": self.verdict,
            "headroom_bytes": self.headroom_bytes, "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "torch_reserved_bytes": self.torch_reserved_bytes, "choices": self.choices,
            "time_s": self.time_s, "assumptions": self.assumptions, "warnings": self.warnings,
            "terms": [{"name": t.name, "count": t.count, "bytes_per": t.bytes_per, "bytes": t.bytes,
                       "group": t.group, "formula": t.formula} for t in self.terms],
        }


# --------------------------------------------------------------------------------------------
# shapes


def _per_token_saved(f, cp: int) -> dict[str, float]:
    """Activation elements one token saves for backward in one layer of each kind (no recompute),
    before the TP split; ``norms``: the two RMSNorm inputs every layer saves (2 x dim)."""
    d = f.dim
    q, kv = f.n_heads * f.head_dim, f.n_kv_heads * f.head_dim
    out = {
        # q/k/v projection input; q and k before and after q/k-norm + RoPE; v; the K,V of the other
        # CP ranks that attention saves (all-gather CP); attention output and o_proj input
        # (output gate / reshape); fp32 log-sum-exp per head.
        "attention": d + 2 * q + 3 * kv + 2 * kv * (cp - 1) + 2 * q + 2 * f.n_heads,
        # router/expert input; fp32 router logits and probabilities; permuted expert input and
        # combine input [top_k, dim]; w1, w3 outputs and their product [top_k, hidden]; shared
        # expert w1, w3, product; the shared-expert gate.
        "moe": d + 4 * f.num_experts + 2 * f.top_k * d + 3 * f.top_k * f.moe_hidden_dim
        + 3 * f.shared_expert_hidden_dim + 1,
        "mlp": d + 3 * f.ffn_hidden_dim,  # input; w1, w3 outputs and their product (SwiGLU)
        "linear_attention": 0.0,
    }
    la = f.linear_attn or {}
    if la:
        kd, vd, hv = la["key_dim"], la["value_dim"], la["value_heads"]
        # input; q,k,v before and after the causal conv (+SiLU); l2-normed q,k; the output gate z;
        # fp32 beta and decay per value head; core output and gated-norm output (o_proj input).
        out["linear_attention"] = d + 2 * (2 * kd + vd) + 2 * kd + vd + 4 * hv + 2 * vd
    out["norms"] = 2 * d
    return out


def _layer_counts(f, pp: int) -> dict[str, float]:
    """Layers of each kind on one pipeline stage (fractions when pp does not split kinds evenly).
    MoE models are taken as MoE in every layer, dense models as dense MLP in every layer."""
    n = f.n_layers / pp
    moe = f.num_experts > 0
    return {"attention": f.n_attention_layers / pp, "linear_attention": f.n_linear_attention_layers / pp,
            "moe": n if moe else 0.0, "mlp": 0.0 if moe else n, "norms": n}


def _param_split(f, c: Constants) -> dict[str, float]:
    emb = f.vocab_size * f.dim
    head = 0 if c.tied_embeddings else emb
    blocks = max(0.0, f.n_params - emb - head - f.dim)
    experts = min(float(f.n_expert_params), blocks)
    return {"emb": emb, "head": head + f.dim, "dense_blocks": blocks - experts, "experts": experts}


def _fp8(cfg, f, split) -> dict:
    """What precision=fp8 converts: the FP8 share of dense-block and expert parameters (hence
    of their GEMM FLOPs), and whether FSDP2 all-gathers them in FP8."""
    p = cfg.get("precision") if hasattr(cfg, "get") else None
    if p is None or str(getattr(p, "name", "bf16")) != "fp8":
        return {"on": False, "dense_share": 0.0, "experts": False, "fp8_all_gather": False, "compile": False}
    from components.precision.policies import FP8

    # bf16 inside the blocks: the routers (dim x experts per MoE layer); norms are not GEMMs and are
    # counted with the blocks but negligible
    router = f.n_layers * f.dim * f.num_experts if f.num_experts else 0
    dense = split["dense_blocks"]
    return {"on": True, "dense_share": max(0.0, dense - router) / dense if dense else 0.0,
            "experts": bool(f.num_experts) and bool(getattr(p, "experts", True)) and str(p.backend) == "torchao",
            "fp8_all_gather": FP8.fp8_all_gather(p, cfg), "compile": bool(getattr(p, "compile", False)),
            "how": f"fp8 {p.backend} {p.scaling}"}


def _spans(group: int, stride: int, per_node: int) -> bool:
    """Whether a process group of ``group`` ranks spaced ``stride`` apart leaves one node."""
    return group > 1 and group * stride > per_node


# --------------------------------------------------------------------------------------------
# the estimate


def _choices(cfg, loss, state, recompute, moe_chunk) -> dict:
    def name(node, default):
        return str(getattr(node, "name", default)) if node is not None else default
    return {
        "loss": loss or name(cfg.get("loss"), "ce"),
        "state": state or name(cfg.get("state"), "fsdp2"),
        "recompute": recompute or name(cfg.get("recompute"), "selective"),
        "moe_chunk": moe_chunk or str(cfg.moe.chunk),
    }


def plan(resolved, *, gpu_memory_bytes: int | None = None, gpu: str | None = None,
         gpus_per_node: int | None = None, calibration: dict | None = None, constants: Constants | None = None,
         loss: str | None = None, state: str | None = None, recompute: str | None = None,
         moe_chunk: str | None = None) -> Plan:
    """Estimate per-GPU memory and step time for ``resolved`` (framework.resolve.Resolved).

    ``loss`` / ``state`` / ``recompute`` / ``moe_chunk`` override the recipe's choice by name
    (names need not be in registry.yaml yet, e.g. ``linear_ce``, ``zero1``).
    """
    c = constants or Constants()
    if calibration:
        c = c.calibrated(calibration)
    if gpus_per_node is not None:
        if int(gpus_per_node) < 1:
            raise UserError(f"gpus_per_node={gpus_per_node}", "must be >= 1.")
        c = replace(c, gpus_per_node=int(gpus_per_node))
    if gpu is None:
        gpu = "H200" if gpu_memory_bytes is not None and gpu_memory_bytes > 100 * GiB else "H100"
    hw = c.gpu(gpu)
    mem_cap = int(gpu_memory_bytes if gpu_memory_bytes is not None else hw.hbm_bytes)
    cfg, f, lay = resolved.cfg, resolved.facts, resolved.layout
    ch = _choices(cfg, loss, state, recompute, moe_chunk)
    grad_accum = int(getattr(resolved, "grad_accum", 1) or 1)
    W, dpr, dps, cp, ep, pp, tp = lay.world_size, lay.dp_replicate, lay.dp_shard, lay.cp, lay.ep, lay.pp, lay.tp
    seq, lb = int(cfg.training.seq_len), int(cfg.training.local_batch)
    warnings: list[str] = []
    if pp > 1:
        mb = int(getattr(cfg.parallel, "pp_microbatch_size", 1) or 1)
        n_mb = max(1, lb // mb)
        if n_mb < pp:
            warnings.append(f"PP {pp} with {n_mb} microbatch(es) per step (local_batch {lb} / "
                            f"pp_microbatch_size {mb}): the pipeline bubble is {pp - 1}/{n_mb + pp - 1} of the step.")
    else:
        mb, n_mb = lb, 1
    T = mb * seq / cp  # local tokens per microbatch on one rank
    Tt = T / tp  # per rank after the sequence-parallel split
    counts, saved = _layer_counts(f, pp), _per_token_saved(f, cp)
    split = _param_split(f, c)
    fp8 = _fp8(cfg, f, split)
    rc = ch["recompute"]
    if rc not in ("none", "selective", "full"):
        warnings.append(f"recompute {rc!r} is unknown to the planner; estimated as selective.")
        rc = "selective"

    def stage_terms(first: bool, last: bool, in_flight: int) -> list[Term]:
        t: list[Term] = []
        # ---- static state
        dense_stage = split["dense_blocks"] / pp + (split["emb"] if first else 0) + (split["head"] if last else 0)
        exp_stage = split["experts"] / pp
        offload = str(getattr(cfg.get("state"), "offload", "none")) == "all" and ch["state"] == "fsdp2"
        if ch["state"] == "zero1":
            local = dense_stage / tp + exp_stage / ep
            opt_local = dense_stage / (tp * dpr * dps * cp) + exp_stage / (dpr * dps * cp * tp)
            pb, gb, how = c.zero1_param_bytes, c.zero1_grad_bytes, f"dense/{tp} (TP) + experts/{ep} (EP)"
            t += [Term("parameters", local, pb, "static", f"stage params {how} x {pb:g} B"),
                  Term("gradients", local, gb, "static", f"stage params {how} x {gb:g} B")]
            ob = c.master_bytes + c.adam_bytes
            t.append(Term("optimizer_states", opt_local, ob, "static",
                          f"stage params / (DP x CP x TP = {dpr * dps * cp * tp}) x {ob:g} B (master + Adam)"))
        else:
            if ch["state"] != "fsdp2":
                warnings.append(f"state {ch['state']!r} is unknown to the planner; estimated as fsdp2.")
            shard = dps * cp * tp
            local = (dense_stage + exp_stage) / shard
            pb, gb, ob = c.fsdp2_param_bytes, c.fsdp2_grad_bytes, c.master_bytes + c.adam_bytes
            how = f"stage params / {shard} (dp_shard x cp x tp" + (
                f"; experts over ep {ep} x efsdp {shard // ep})" if f.num_experts else ")")
            gone = 0.0 if offload else 1.0
            t += [Term("parameters", local * gone, pb, "static", f"{how} x {pb:g} B"),
                  Term("gradients", local * gone, gb, "static", f"{how} x {gb:g} B"),
                  Term("optimizer_states", local * gone, ob, "static", f"{how} x {ob:g} B (master + Adam)"
                       + (" (offloaded to CPU)" if offload else ""))]
        # ---- activations
        ab = c.act_bytes
        keep = {k: {"none": 1.0, "full": 0.0}.get(rc, float(c.selective_keep.get(k, 0.5))) for k in saved}
        keep["norms"] = 0.0 if rc == "full" else 1.0
        if rc == "full":
            t.append(Term("activations", in_flight * Tt * f.n_layers / pp * f.dim, ab, "activations",
                          f"{in_flight} microbatch(es) x {Tt:,.0f} tokens x {f.n_layers / pp:g} layers x "
                          f"dim {f.dim} (block inputs only)"))
        else:
            # norm inputs are the residual stream: kept under selective too
            per_tok = sum(counts[k] * saved[k] * keep[k] for k in saved)
            t.append(Term("activations", in_flight * Tt * per_tok, ab, "activations",
                          f"{in_flight} microbatch(es) x {Tt:,.0f} tokens x {per_tok:,.0f} saved elements "
                          f"per token per stage ({rc})"))
        # the largest block (mixer + FFN + norms) rerun in backward (the part not kept) + its gradients
        mixer = max((k for k in ("attention", "linear_attention") if counts[k] > 0), key=lambda k: saved[k],
                    default="attention")
        ffn = "moe" if counts["moe"] > 0 else "mlp"
        block_elems = saved[mixer] + saved[ffn] + saved["norms"]
        redo_elems = sum(saved[k] * (1 - keep[k]) for k in (mixer, ffn, "norms"))
        t.append(Term("activation_working_set", Tt * (redo_elems + c.grad_working_factor * block_elems), ab,
                      "activations", f"one {mixer} + {ffn} block: {Tt:,.0f} tokens x ({redo_elems:,.0f} recomputed + "
                      f"{c.grad_working_factor:g} x {block_elems:,.0f} gradient) elements x {ab:g} B"))
        if f.num_experts:
            chunks = _chunks(ch["moe_chunk"])
            t.append(Term("moe_dispatch_combine", Tt * f.top_k * f.dim * c.moe_buffer_copies * c.ep_load_imbalance
                          / chunks, ab, "buffers",
                          f"top_k {f.top_k} x {Tt:,.0f} tokens x dim {f.dim} x {c.moe_buffer_copies:g} buffers x "
                          f"imbalance {c.ep_load_imbalance:g} / {chunks} chunk(s) x {ab:g} B"))
        if fp8["on"]:
            conv = split["dense_blocks"] / f.n_layers / tp * fp8["dense_share"] + \
                (split["experts"] / f.n_layers / max(ep, 1) if fp8["experts"] else 0.0)
            t.append(Term("fp8_weight_copies", conv, c.fp8_copy_bytes, "buffers",
                          f"one block's FP8-converted params {conv / 1e6:,.1f}M x {c.fp8_copy_bytes:g} B "
                          f"(FP8 weight + transposed copy; {fp8['how']})"))
        # ---- loss
        if last:
            t += _loss_terms(ch["loss"], cfg, f, c, T, tp, warnings)
        # ---- FSDP / ZeRO-1 buffers
        block = split["dense_blocks"] / f.n_layers / tp + split["experts"] / f.n_layers / max(ep, 1)
        # the embedding and the lm_head are never gathered together; the prefetched neighbour is a block
        units = [max([block] + ([split["emb"] / tp] if first else []) + ([split["head"] / tp] if last else []))]
        units += [block] * (max(1, int(c.fsdp_allgather_units)) - 1)
        if ch["state"] == "zero1":
            t.append(Term("grad_buckets", 2 * c.zero1_bucket_params, 4.0, "buffers",
                          f"2 buckets x {c.zero1_bucket_params:,.0f} params x 4 B"))
        else:
            k = max(1, int(c.fsdp_allgather_units))
            ag = c.fsdp_allgather_bytes
            if fp8["fp8_all_gather"]:  # the block's converted dense linears arrive in FP8
                dense_block = split["dense_blocks"] / f.n_layers / tp
                ag_block = (block - dense_block * fp8["dense_share"]) * ag + dense_block * fp8["dense_share"] * \
                    c.fp8_allgather_bytes
                units_b = [u * ag if u != block else ag_block for u in units[:k]]
                t.append(Term("fsdp_allgather", 1, sum(units_b), "buffers",
                              f"largest unit + {k - 1} prefetched block(s), converted dense linears in FP8 "
                              f"({c.fp8_allgather_bytes:g} B) and the rest at {ag:g} B"))
            else:
                t.append(Term("fsdp_allgather", sum(units[:k]), c.fsdp_allgather_bytes, "buffers",
                              f"largest unit + {k - 1} prefetched block(s) ({' + '.join(f'{u / 1e6:,.0f}M' for u in units[:k])} "
                              f"params per rank) "
                              f"x {c.fsdp_allgather_bytes:g} B"))
            rb = c.fsdp_unsharded_grad_bytes + c.fsdp_reduce_bytes
            t.append(Term("fsdp_reduce_scatter", units[0], rb, "buffers",
                          f"largest unit {units[0] / 1e6:,.0f}M params x ({c.fsdp_unsharded_grad_bytes:g} B grad + "
                          f"{c.fsdp_reduce_bytes:g} B fp32 reduce input)"))
        # ---- CP
        if cp > 1 and counts["attention"] > 0:
            kvd = f.n_kv_heads * f.head_dim
            t.append(Term("cp_kv_allgather", mb * seq * 2 * kvd / tp * c.cp_kv_copies, ab, "buffers",
                          f"{mb} x seq {seq} x 2 x kv {kvd}/{tp} x {c.cp_kv_copies:g} copies x {ab:g} B (one layer)"))
        la = f.linear_attn or {}
        if cp > 1 and counts["linear_attention"] > 0 and la:
            st = la["value_heads"] * (la["key_dim"] / la["key_heads"]) * (la["value_dim"] / la["value_heads"])
            t.append(Term("cp_state_allgather", mb * cp * st, 4.0, "buffers",
                          f"{mb} x cp {cp} x {st:,.0f} state elements (per-head k x v) x 4 B"))
        # ---- reserve
        allocated = sum(x.bytes for x in t)
        t.append(Term("fragmentation", allocated, c.fragmentation_fraction, "reserve",
                      f"{c.fragmentation_fraction:g} x allocated {allocated / GiB:.2f} GiB"))
        t.append(Term("cuda_context_nccl", 1, c.cuda_context_bytes + c.nccl_bytes, "reserve",
                      f"CUDA context {c.cuda_context_bytes / GiB:g} GiB + NCCL {c.nccl_bytes / GiB:g} GiB"))
        return t

    if pp == 1:
        stages = {"only": stage_terms(True, True, 1)}
    else:
        stages = {"first": stage_terms(True, False, min(pp, n_mb)), "last": stage_terms(False, True, 1)}
    stage, terms = max(stages.items(), key=lambda kv: sum(x.bytes for x in kv[1]))
    warnings[:] = list(dict.fromkeys(warnings))  # each stage may have said the same
    memory = {t.name: t.bytes for t in terms}
    total = sum(memory.values())
    headroom = mem_cap - total
    verdict = "OOM" if headroom < 0 else ("tight" if headroom < c.tight_fraction * mem_cap else "fits")

    time_s, model_flops_gpu, tokens_step, assumptions = _step_time(
        f, c, hw, lay, ch, rc, seq, mb, n_mb, lb, grad_accum, split, counts, fp8)
    step = sum(time_s.values())
    assumptions = [
        f"GPU {hw.name}: {hw.bf16_dense_flops / 1e12:.0f} TFLOP/s bf16 dense, memory {mem_cap / GiB:.1f} GiB, "
        f"HBM {hw.hbm_bw / 1e12:.2f} TB/s; NVLink {hw.nvlink_bw / 1e9:.0f} GB/s collectives, "
        f"{hw.nvlink_alltoall_bw / 1e9:.0f} GB/s all-to-all; IB {hw.ib_bw / 1e9:.0f} / "
        f"{hw.ib_alltoall_bw / 1e9:.0f} GB/s per GPU; {c.gpus_per_node} GPUs per node",
        f"local tokens {T:,.0f} per microbatch (micro batch {mb} x seq {seq} / cp {cp}), {Tt:,.0f} per rank "
        f"after TP {tp}; peak stage: {stage}",
        f"state {ch['state']}, recompute {rc}, loss {ch['loss']}, moe.chunk {ch['moe_chunk']}",
        *assumptions,
        f"reserve: fragmentation {c.fragmentation_fraction:.0%} of allocated, CUDA context + NCCL "
        f"{(c.cuda_context_bytes + c.nccl_bytes) / GiB:.1f} GiB; verdict 'tight' under "
        f"{c.tight_fraction:.0%} headroom",
        "memory constants are engineering estimates not yet compared with measured GPU peaks; the compute "
        "efficiencies carry one factor fitted to a published Megatron point (seed 000 PP1), not to apiary runs",
    ]
    return Plan(dims={"dp_replicate": dpr, "dp_shard": dps, "cp": cp, "ep": ep, "pp": pp, "tp": tp},
                memory_bytes=memory, total_bytes=total, gpu_memory_bytes=mem_cap, fits=verdict != "OOM",
                verdict=verdict, headroom_bytes=headroom, step_time_s=step,
                tflops_per_gpu=model_flops_gpu / step / 1e12 if step else 0.0,
                tokens_per_s_per_gpu=tokens_step / W / step if step else 0.0, assumptions=assumptions,
                terms=terms, time_s=time_s, choices={"gpu": hw.name, **ch, "recompute": rc, "stage": stage,
                                                     "grad_accum": grad_accum, "microbatches": n_mb},
                warnings=warnings)


def _chunks(name: str) -> int:
    if name.startswith("chunk") and name[5:].isdigit():
        return int(name[5:])
    return 2 if name == "auto" else 1


# Losses on the fused LM-head engine (no [tokens, vocab] logits): planned as linear_ce.
FUSED_HEAD_LOSSES = ("linear_ce", "grpo", "dapo", "gspo", "cispo", "ppo", "sft")


def _loss_terms(loss: str, cfg, f, c: Constants, T: float, tp: int, warnings: list[str]) -> list[Term]:
    cols = math.ceil(f.vocab_size / tp)
    if loss in FUSED_HEAD_LOSSES:
        return [Term("loss_tile", 1, c.linear_ce_tile_bytes, "loss", "one logits tile of the fused kernel"),
                Term("loss_hidden_grad", T * f.dim, c.linear_ce_hidden_grad_bytes, "loss",
                     f"{T:,.0f} tokens x dim {f.dim} x {c.linear_ce_hidden_grad_bytes:g} B")]
    if loss == "chunked":
        cfg_loss = cfg.get("loss")
        n = int(getattr(cfg_loss, "num_chunks", 0) or 0) if getattr(cfg_loss, "name", None) == "chunked" else 0
        n = n or int(c.chunked_num_chunks)
        rows, how = math.ceil(T / n), f"{T:,.0f} tokens / {n} chunks"
    else:
        if loss != "ce":
            warnings.append(f"loss {loss!r} is unknown to the planner; estimated as ce (materialised logits).")
        rows, how = int(T), f"{T:,.0f} tokens"
    return [Term("logits_bf16", rows * cols, c.ce_logits_bytes, "loss", f"{how} x vocab/TP {cols:,} x {c.ce_logits_bytes:g} B"),
            Term("logits_fp32", rows * cols, c.ce_fp32_bytes, "loss", f"{how} x vocab/TP {cols:,} x {c.ce_fp32_bytes:g} B"),
            Term("logits_grad", rows * cols, c.ce_grad_bytes, "loss", f"{how} x vocab/TP {cols:,} x {c.ce_grad_bytes:g} B")]


def _step_time(f, c, hw, lay, ch, rc, seq, mb, n_mb, lb, grad_accum, split, counts, fp8=None):
    W, dps, cp, ep, pp, tp = lay.world_size, lay.dp_shard, lay.cp, lay.ep, lay.pp, lay.tp
    g = c.gpus_per_node
    tokens_step = lb * seq * lay.dp_replicate * dps * grad_accum  # global tokens per optimizer step
    # model FLOPs per token (fwd + bwd = 3 x fwd; 2 FLOPs per multiply-add)
    expert_active = split["experts"] * f.top_k / f.num_experts if f.num_experts else 0.0
    q = f.n_heads * f.head_dim
    la = f.linear_attn or {}
    gdn = 0.0
    if la:
        dk, dv = la["key_dim"] / la["key_heads"], la["value_dim"] / la["value_heads"]
        gdn = 3 * la["value_heads"] * (4 * dk * dv + 2 * c.gdn_chunk * (dk + dv)) * f.n_linear_attention_layers
    parts = {  # FLOPs per token
        "dense": 6 * split["dense_blocks"],
        "experts": 6 * expert_active,
        "attention": 6 * seq * q * f.n_attention_layers,  # = 12 x layers x seq x heads x head_dim / 2 (causal)
        "linear_attention": gdn,
        "lm_head": 6 * split["head"],
    }
    eff = {"dense": c.eff_dense, "experts": c.eff_expert, "attention": c.eff_attention,
           "linear_attention": c.eff_linear_attention, "lm_head": c.eff_head}
    T_rank = mb * seq / cp / tp
    T_local = mb * seq / cp
    scale = c.tp_gemm_scale ** math.log2(tp) * min(1.0, T_local / c.efficiency_ref_tokens) ** c.efficiency_short_exponent
    eff = {k: v * scale for k, v in eff.items()}
    extra = {k: 0.0 for k in parts}
    if rc == "full":
        extra.update(dense=1 / 3, experts=1 / 3, attention=1 / 3, linear_attention=1 / 3)
    elif rc == "selective":
        extra.update(dense=c.selective_recompute_fraction / 3, experts=c.selective_recompute_fraction / 3)
    loss_key = "linear_ce" if ch["loss"] in FUSED_HEAD_LOSSES else ch["loss"]
    loss_factor = float(c.loss_time_factor.get(loss_key, c.loss_time_factor.get("ce", 1.65)))
    per_gpu_tokens = tokens_step / W
    fp8 = fp8 or {"on": False}
    share = {"dense": fp8.get("dense_share", 0.0), "experts": 1.0 if fp8.get("experts") else 0.0} \
        if fp8["on"] else {}
    over = c.fp8_cast_overhead_compiled if fp8.get("compile") else c.fp8_cast_overhead
    fp8_factor = 1 / c.fp8_flops_ratio + over  # an FP8 GEMM's time over its bf16 time, casts included
    time_s: dict[str, float] = {}
    for k, fl in parts.items():
        t = fl * per_gpu_tokens * (1 + extra[k]) / (hw.bf16_dense_flops * eff[k])
        s8 = share.get(k, 0.0)
        t *= (1 - s8) + s8 * fp8_factor
        time_s[f"compute_{k}"] = t * (loss_factor if k == "lm_head" else 1.0)
    model_flops_gpu = sum(parts.values()) * per_gpu_tokens

    # communication per optimizer step, per GPU (bytes on the wire; ring/all-to-all fractions)
    micro = grad_accum * n_mb  # microbatches per optimizer step
    comm, overlap = {}, {}
    if f.num_experts and ep > 1:
        passes = 4 + (2 if rc == "full" else 0)  # dispatch + combine, fwd and bwd (+ recompute fwd)
        vol = micro * f.n_layers / pp * passes * f.top_k * T_rank * f.dim * 2 * (ep - 1) / ep * c.ep_load_imbalance
        if ep <= g:
            comm["ep_alltoall"] = vol / hw.nvlink_alltoall_bw
        else:
            inter = (ep - g) / (ep - 1)
            comm["ep_alltoall"] = vol * (1 - inter) / hw.nvlink_alltoall_bw + vol * inter / hw.ib_alltoall_bw
        from components.moe.chunk import AUTO_MIN_EP

        policy = "none" if ch["moe_chunk"] == "auto" and ep < AUTO_MIN_EP else ch["moe_chunk"]  # what auto runs
        overlap["ep_alltoall"] = float(c.ep_overlap.get(policy, 0.0))
    if cp > 1:
        passes = 2 + (1 if rc == "full" else 0)  # K,V all-gather fwd, dK,dV reduce-scatter bwd (+ recompute)
        kvd = f.n_kv_heads * f.head_dim
        vol = micro * counts["attention"] * passes * (cp - 1) * mb * seq / cp * 2 * kvd / tp * 2
        if la:
            st = la["value_heads"] * (la["key_dim"] / la["key_heads"]) * (la["value_dim"] / la["value_heads"])
            vol += micro * counts["linear_attention"] * passes * (cp - 1) * mb * st * 4
        comm["cp"] = vol / (hw.ib_bw if _spans(cp, tp, g) else hw.nvlink_bw)
        overlap["cp"] = c.cp_overlap
    if tp > 1:
        passes = 8 + (4 if rc == "full" else 0)  # AG + RS around attention and FFN, fwd and bwd
        vol = micro * f.n_layers / pp * passes * (tp - 1) / tp * mb * seq / cp * f.dim * 2
        comm["tp"] = vol / (hw.ib_bw if tp > g else hw.nvlink_bw)
        overlap["tp"] = c.tp_overlap
    dense_stage = (split["dense_blocks"] + split["emb"] + split["head"]) / pp
    exp_stage = split["experts"] / pp
    if ch["state"] == "zero1":
        s_d, s_e = lay.dp_replicate * dps * cp, lay.dp_replicate * dps * cp * tp // max(ep, 1)
        vol_d = dense_stage / tp * (4 + 2) * (s_d - 1) / s_d
        vol_e = exp_stage / ep * (4 + 2) * (s_e - 1) / s_e if s_e > 1 else 0.0
        comm["zero1"] = vol_d / (hw.ib_bw if _spans(s_d, tp, g) else hw.nvlink_bw) + \
            vol_e / (hw.ib_bw if _spans(s_e, ep, g) else hw.nvlink_bw)
        overlap["zero1"] = c.zero1_overlap
    else:
        s_d, s_e = dps * cp, dps * cp * tp // max(ep, 1)
        per = 2 * c.fsdp_allgather_bytes + c.fsdp_reduce_bytes  # AG fwd, AG bwd, RS
        per_d = per
        if fp8.get("fp8_all_gather"):  # converted dense linears all-gather 1 B/element
            sh = fp8["dense_share"] * split["dense_blocks"] / pp / dense_stage if dense_stage else 0.0
            per_d = per - 2 * sh * (c.fsdp_allgather_bytes - c.fp8_allgather_bytes)
        vol_d = grad_accum * dense_stage / tp * per_d * (s_d - 1) / s_d if s_d > 1 else 0.0
        vol_e = grad_accum * exp_stage / ep * per * (s_e - 1) / s_e if s_e > 1 else 0.0
        comm["fsdp"] = vol_d / (hw.ib_bw if _spans(s_d, tp, g) else hw.nvlink_bw) + \
            vol_e / (hw.ib_bw if _spans(s_e, ep, g) else hw.nvlink_bw)
        overlap["fsdp"] = c.fsdp_overlap
    for k, v in comm.items():
        time_s[f"exposed_{k}"] = v * (1 - overlap[k])
    if pp > 1:
        bubble = (pp - 1) / n_mb
        time_s["pp_bubble"] = bubble * sum(time_s.values())
    static_local = (dense_stage + exp_stage) / (dps * cp * tp) * (c.master_bytes + c.adam_bytes + 4)
    time_s["optimizer"] = c.optimizer_passes * static_local / hw.hbm_bw

    eff_txt = ", ".join(f"{k} {v:.2f}" for k, v in eff.items())
    where_ep = ("NVLink" if ep <= g else "NVLink + IB") if ep > 1 else "none"
    assumptions = [
        f"FLOPs/token: 6 x active params (dense {split['dense_blocks'] / 1e9:.2f}B + experts "
        f"{expert_active / 1e9:.2f}B + lm_head {split['head'] / 1e9:.2f}B) + attention 12 x {f.n_attention_layers} "
        f"layers x seq x {f.n_heads} heads x {f.head_dim} / 2 (causal) + GatedDeltaNet "
        f"3 x value_heads x (4 dk dv + 2 x chunk x (dk + dv)) per layer = {sum(parts.values()) / 1e9:.1f} GFLOP/token; "
        "TFLOPs/GPU counts model FLOPs (no recompute); torchtitan's logged tflops does not halve causal attention",
        f"recompute {rc}: " + {"full": "+1 forward of every block (+1/3 of block FLOPs)",
                               "selective": f"+{c.selective_recompute_fraction:g} of forward GEMMs",
                               "none": "no extra compute"}[rc]
        + f"; loss layer x {loss_factor:g} of its GEMM time ({ch['loss']})",
        f"efficiency (achieved/peak, after x{scale:.2f} for TP {tp} and {T_local:,.0f} local tokens): {eff_txt}",
        f"EP {ep} all-to-all over {where_ep}, {int(100 * overlap.get('ep_alltoall', 0))}% overlapped "
        f"(moe.chunk {ch['moe_chunk']}); CP {cp} {int(100 * c.cp_overlap)}% overlapped; "
        f"{'ZeRO-1' if ch['state'] == 'zero1' else 'FSDP'} {int(100 * overlap.get('zero1', overlap.get('fsdp', 0)))}% "
        f"overlapped; TP {tp} {int(100 * c.tp_overlap)}% overlapped",
        (f"precision {fp8['how']}: FP8 GEMMs for {share['dense']:.0%} of dense-block and "
         f"{share['experts']:.0%} of expert FLOPs at bf16 time x (1/{c.fp8_flops_ratio:g} + {over:g} casts) = "
         f"x{fp8_factor:.2f}; LM head, attention, GatedDeltaNet in bf16; FSDP all-gather "
         + ("FP8 for the converted linears" if fp8.get("fp8_all_gather") else "bf16")
         if fp8["on"] else "precision bf16: every GEMM at bf16 peak"),
        f"PP {pp}: {n_mb} microbatch(es) per micro-step, 1F1B bubble (pp-1)/microbatches; "
        f"{grad_accum} gradient-accumulation step(s); {tokens_step:,} tokens per optimizer step",
    ]
    return time_s, model_flops_gpu, tokens_step, assumptions


# --------------------------------------------------------------------------------------------
# for the training loop


def detect_gpu() -> tuple[str | None, int | None]:
    """The local GPU's kind (H100/H200 when recognised) and total memory, or (None, None)."""
    from framework import devices

    name, total = devices.accelerator_info()
    if name is None:
        return None, None
    name = name.upper()
    kind = "H200" if "H200" in name else ("H100" if "H100" in name else None)
    return kind, total


def estimate_for_run(resolved, gpu_memory_bytes: int | None = None, calibration: dict | None = None) -> dict:
    """The planner's estimate as flat keys for metrics.jsonl (next to ``peak_mem_bytes``).

    ``plan_torch_reserved_bytes`` is the number to compare with ``torch.cuda.max_memory_reserved``
    (the measured ``peak_mem_bytes``); ``plan_total_bytes`` adds the CUDA context and NCCL.
    """
    kind, total = detect_gpu()
    p = plan(resolved, gpu_memory_bytes=gpu_memory_bytes or total, gpu=kind, calibration=calibration)
    return {
        "plan_total_bytes": p.total_bytes,
        "plan_torch_reserved_bytes": p.torch_reserved_bytes,
        "plan_gpu_memory_bytes": p.gpu_memory_bytes,
        "plan_verdict": p.verdict,
        "plan_step_time_s": round(p.step_time_s, 6),
        "plan_tflops_per_gpu": round(p.tflops_per_gpu, 3),
        "plan_gpu": p.choices["gpu"],
        "plan_memory_bytes": p.memory_bytes,
    }


def merge_into_last_record(metrics_path, extra: dict) -> bool:
    """Add ``extra``'s keys to the last JSON line of metrics.jsonl; False when there is none."""
    path = Path(metrics_path)
    if not path.is_file():
        return False
    lines = path.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return False
    rec = json.loads(lines[-1])
    rec.update(extra)
    if rec.get("peak_mem_bytes") and extra.get("plan_torch_reserved_bytes"):
        rec["plan_error_fraction"] = round(extra["plan_torch_reserved_bytes"] / rec["peak_mem_bytes"] - 1, 4)
    lines[-1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    return True
