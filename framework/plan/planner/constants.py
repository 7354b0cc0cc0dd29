"""The planner's constants: GPU peaks (``HARDWARE``) and every number the estimate assumes
(``Constants``), each with its reason; ``Constants().calibrated({...})`` overrides any of them.

The fields are the planner's own numbers. A component's numbers (bytes per parameter of a state
backend, a loss's time factor, a chunk policy's overlap) and a model family's layer kinds' live
with them, in their ``PLAN_CONSTANTS`` (framework.contracts.PlanConstant): ``Constants()`` gathers
those of every registered component into ``components``, so one calibration (by name, as for the
fields) covers the whole estimate and ``plan_terms`` read them as ``ctx.plan.constants.NAME``.
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, asdict, dataclass, field, fields

from framework import contracts
from framework.compose import registry
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


@dataclass(init=False)
class Constants:
    """Everything the estimate assumes. Override with ``Constants().calibrated({...})``.

    ``Constants(NAME=value)`` (and ``dataclasses.replace``) set a field or a component's constant;
    a component's constant reads as an attribute (``c.NAME``) like a field."""

    # ---- static state, bytes per parameter --------------------------------------------------
    master_bytes: float = _c(4.0, "fp32 master weights, sharded over all data-parallel ranks (both backends).")
    adam_bytes: float = _c(8.0, "AdamW exp_avg + exp_avg_sq in fp32, sharded like the master.")
    tied_embeddings: bool = _c(False, "whether tok_embeddings and lm_head share a matrix (ModelFacts does "
                               "not say; apiary's large flavors are untied).")

    # ---- activations --------------------------------------------------------------------------
    act_bytes: float = _c(2.0, "bytes per saved activation element (bf16 compute).")
    grad_working_factor: float = _c(0.5, "backward working set of one block (activation gradients alive while "
                                    "a layer's backward runs), as a fraction of that layer's saved activations.")
    moe_buffer_copies: float = _c(1.0, "transient [top_k x tokens, dim] bf16 tensors alive at a MoE layer's "
                                  "peak beyond autograd's saves, with the lean combine (moe.lean_combine, "
                                  "components/moe/lean_combine.py): its scored rows. Fitted on one H200 "
                                  "(2026-11-28; 4-layer Qwen3.5-35B-A3B, full recompute 32K/64K/128K: +3.4%, "
                                  "+1.9%, +0.3% with fragmentation_fraction 0).")
    moe_buffer_copies_fp32_combine: float = _c(4.0, "the same with torchtitan's combine (moe.lean_combine=false, "
                                               "or where the lean one does not run): its fp32 copy and product of "
                                               "the expert outputs on top (the earlier fit).")
    cp_activation_overhead: float = _c(0.16, "with context parallelism (cp > 1): the saved activations and the backward "
                                       "working set take this fraction more than counted (the head-tail shard's two "
                                       "parts copied around each layer kind, fla's CP kernels' states, and the routed "
                                       "tokens each EP rank saves, which follow the routing's imbalance); 0 at cp 1. "
                                       "Fitted on two H200s (2026-11-28; qwen35_35b_128k, 8 layers, CP 2 x EP 2, torch "
                                       "max reserved against planned): full recompute at 128K 90.3 GiB against 87.75, "
                                       "auto at 256K 129.3 against 121.5; least squares over those two, where the "
                                       "activation terms were 18.2 and 48.6 GiB. auto at 128K (130.2 against 123.4) "
                                       "is left out: its allocator retried every step, so 130.2 is a floor, not the "
                                       "peak. Residuals: +0.4%, -0.0%; auto 128K planned +1.4% over its floor; the "
                                       "40-layer LoRA run (124.7 against 125.65) +6.5%. Every point had EP 2 with CP 2, "
                                       "so the fit does not tell the two apart.")
    ep_load_imbalance: float = _c(1.2, "tokens received by the busiest EP rank over the mean (no token "
                                  "dropping in torchtitan, so the busiest rank sizes buffers and time).")
    # ---- reserve ------------------------------------------------------------------------------
    cuda_context_bytes: float = _c(1.0 * GiB, "CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator.")
    nccl_bytes: float = _c(1.5 * GiB, "NCCL communicator buffers for the PP/DP/CP/EP/TP groups: outside "
                           "torch's allocator.")
    fragmentation_fraction: float = _c(0.0, "torch caching-allocator reserve over the allocated terms with "
                                       "expandable segments (framework/alloc_conf.py, the default): 0 because "
                                       "the allocated terms already exceed the measured allocated peak by about "
                                       "what the reserve adds (one H200, 2026-11-28: reserved / allocated 1.08-1.20, "
                                       "planned / reserved +0.3%..+3.4% for full recompute).")
    fragmentation_fraction_fixed: float = _c(0.08, "the same with torch's fixed segments "
                                             "(expandable_segments:False): the earlier fit, with the fp32 combine.")
    tight_fraction: float = _c(0.07, "verdict 'tight' when headroom is below this fraction of GPU memory "
                                      "(the preflight's MEASURED_UNDER).")

    # ---- step time ----------------------------------------------------------------------------
    gpus_per_node: int = _c(8, "GPUs behind one NVLink domain; groups spanning more use IB.")
    # The step time's efficiencies (achieved / peak bf16 FLOPs per compute part, fwd + bwd) are
    # measured on one H200 with the 4-layer Qwen3.5-35B-A3B at full width (docs/benchmarks.md "The
    # planner's step time against measured steps"; benchmarks/step_time_check.py holds the planner to
    # the measured steps). The layer kinds' own (attention, GatedDeltaNet) live with them
    # (components/models/layer_kinds.py).
    eff_dense: float = _c(0.17, "achieved/peak FLOPs of the blocks' dense GEMMs (mixer projections, shared "
                          "expert, router), with what runs around them per block (norms, convolutions, gates, "
                          "rotary embeddings), per FLOP of 6 x the dense parameters. Measured part by part on one "
                          "H200 (4-layer Qwen3.5-35B-A3B, 64K tokens, each block part's forward between device "
                          "syncs; docs/bench_data/h200_20261127c/block_parts_64k_recompute_full.txt): the 4 mixers "
                          "22.9, 22.7, 22.9 and 16.8 ms, 8 norms 1.8 ms each, the shared expert and router's FLOP "
                          "share of the MoE forward: 0.170 (0.152 at 32K, block_parts_32k_recompute_none.txt).")
    eff_expert: float = _c(0.17, "achieved/peak FLOPs of the routed experts (grouped GEMMs of hidden 512, with "
                           "the permutation and the combine). Measured as eff_dense: the MoE forward (22.2 ms at "
                           "64K) less the shared expert's FLOP share: 0.172 (0.164 at 32K).")
    eff_head: float = _c(0.69, "achieved/peak FLOPs of the lm_head's three GEMMs (before the loss's "
                         "loss_time_factor). Measured on one H200: 146.2 ms for 32K tokens x vocab 248,320 x dim "
                         "2048, 36.0 ms for 8K (docs/bench_data/h200_20261127c/loss_bench_fwdgrad_sweep_32k.txt, "
                         "row gemms): 0.69 and 0.70.")
    tp_gemm_scale: float = _c(0.9, "efficiency multiplier per doubling of TP (narrower GEMMs, more launches); "
                              "a guess, so that TP is not free in --search.")
    efficiency_ref_tokens: int = _c(16384, "per-rank tokens per microbatch at and above which the efficiencies "
                                    "hold; below it they shrink (seed 000: local seq under 16K fragments compute "
                                    "and exposes launch/CPU overhead).")
    efficiency_short_exponent: float = _c(0.25, "efficiency x (tokens / efficiency_ref_tokens) ** this, below the "
                                          "reference (a guess).")
    cp_overlap: float = _c(0.3, "fraction of CP K/V all-gather traffic hidden under compute.")
    tp_overlap: float = _c(0.0, "fraction of TP traffic hidden (async TP off).")
    optimizer_passes: float = _c(6.0, "HBM passes over the local static state (fp32 master + Adam + grads, 16 B "
                                 "per parameter) a step makes outside the blocks: the optimizer's read and write (2; "
                                 "AdamW measured 32 ms a step for 4.4B parameters on one H200, "
                                 "docs/bench_data/h200_20261127d/profile_64k_a_g2kept_top.txt) and FSDP2's bf16 "
                                 "casts before the forward and the rerun, the fp32 gradient copies and the clip "
                                 "norm's read. 6 fits the fixed part of the measured steps (one H200, 4-layer "
                                 "Qwen3.5-35B-A3B, full recompute: 0.642 / 1.168 / 2.252 s at 32K / 64K / 128K, "
                                 "0.106 s + 16.4 us per token; docs/bench_data/h200_20261128/s5_*.txt), and the "
                                 "6-layer model's 16K step (0.529 s, pf_6layers_16k.txt) within 3%.")

    hardware: dict = _c({k: asdict(v) for k, v in HARDWARE.items()}, "GPU peak numbers by name (see HARDWARE).")
    components: dict = _c({}, "the registered components' and model families' own constants (their PLAN_CONSTANTS), "
                          "by name: calibrate them as calib.NAME=VALUE like the others; each one's reason is on "
                          "its component's docs/skills page (docs/skills/planner.md lists them).")

    def __init__(self, **kw):
        for f in fields(self):
            if f.name == "components":
                continue
            value = kw.pop(f.name) if f.name in kw else \
                f.default if f.default is not MISSING else f.default_factory()
            setattr(self, f.name, value)
        comp = {name: copy.deepcopy(const.value) for name, const in declared().items()}
        comp.update(kw.pop("components", None) or {})
        unknown = [k for k in kw if k not in comp]
        if unknown:
            raise TypeError(f"Constants() got unknown constant(s) {', '.join(unknown)}")
        comp.update(kw)
        self.components = comp

    def __getattr__(self, name: str):
        """A component's constant (``c.NAME``), as a field reads."""
        comp = self.__dict__.get("components")
        if name.startswith("__") or comp is None or name not in comp:
            raise AttributeError(f"planner constants have no {name!r}")
        return comp[name]

    @classmethod
    def doc(cls, name: str) -> str:
        own = next((f.metadata.get("doc", "") for f in fields(cls) if f.name == name), None)
        return own if own is not None else declared()[name].doc

    def names(self) -> list[str]:
        """Every constant a calibration may name: the fields, then the components'."""
        return [f.name for f in fields(self) if f.name != "components"] + list(self.components)

    def calibrated(self, overrides: dict | None) -> "Constants":
        """A copy with ``{"name": value, "dict_name.key": value, "hardware.H100.ib_bw": value}`` applied
        (``name``: a field or a component's constant)."""
        new = copy.deepcopy(self)
        names = new.names()
        for key, value in (overrides or {}).items():
            head, _, rest = str(key).partition(".")
            if head not in names:
                raise UserError(f"calibration {key}", "unknown planner constant.",
                                did_you_mean(head, names) or f"Known: {', '.join(names)}.")
            holder = new.components if head in new.components else None
            if not rest:
                old = holder[head] if holder is not None else getattr(new, head)
                value = type(old)(value) if isinstance(old, (int, float, bool)) and \
                    not isinstance(value, (dict, list)) else value
                if holder is not None:
                    holder[head] = value
                else:
                    setattr(new, head, value)
                continue
            node = holder[head] if holder is not None else getattr(new, head)
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


# the registry kinds whose components may declare PLAN_CONSTANTS
CALIBRATED_KINDS = tuple(k for k in contracts.KINDS if "PLAN_CONSTANTS" in contracts.declared_members(k))


def declared() -> dict[str, contracts.PlanConstant]:
    """Every registered component's ``PLAN_CONSTANTS``, merged by name: one name declared twice must
    be the same constant, or two dicts with disjoint keys (merged; their reasons joined)."""
    out: dict[str, contracts.PlanConstant] = {}
    where: dict[str, str] = {}
    for kind in CALIBRATED_KINDS:
        for name in registry.names(kind):
            consts = contracts.member(registry.resolve(kind, name), kind, "PLAN_CONSTANTS")
            for cname, const in consts.items():
                here = f"{kind} {name}"
                if cname not in out or out[cname] == const:
                    out.setdefault(cname, const)
                    where.setdefault(cname, here)
                    continue
                old = out[cname]
                clash = [k for k in const.value if k in old.value and old.value[k] != const.value[k]] \
                    if isinstance(old.value, dict) and isinstance(const.value, dict) else None
                if clash is None or clash:
                    raise UserError(f"{kind} {name}", f"declares the planner constant {cname!r}, which "
                                    f"{where[cname]} declares too with another value"
                                    + (f" (entries {', '.join(map(repr, clash))} differ)" if clash else "")
                                    + "; the planner's constants share one name space (calib.NAME=VALUE).",
                                    f"Rename the constant in {name}'s PLAN_CONSTANTS (e.g. prefix it with "
                                    f"{name!r}), or declare the same value.")
                docs = old.doc if const.doc in old.doc else f"{old.doc} {const.doc}"
                out[cname] = contracts.PlanConstant({**old.value, **const.value}, docs)
    return out
