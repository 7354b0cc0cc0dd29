"""ZeRO-1 (Megatron distributed-optimizer semantics) on torchtitan.

Parameters and gradients follow the model-parallel layout only (EP / TP / PP) and are
replicated across data parallel; the fp32 master weights and the optimizer states are
sharded across the data-parallel group. One optimizer step:

    backward          every rank accumulates fp32 gradients of its full local parameters
                      into flat "main_grad" buckets (post-accumulate-grad hooks);
    clip              the buckets are reduce-scattered (SUM; the loss is already divided
                      by the global token count) so each rank holds the reduced gradient of
                      the rows it owns; the global norm is summed over all ranks; clipping
                      scales the owned rows;
    step              torch's Adam/AdamW updates the owned fp32 master rows (on the device,
                      or on the host with ``offload=optimizer``), which are cast to the
                      compute dtype and all-gathered back into every rank's parameters.

Sharding is per parameter along dim 0 of its local (after EP/TP) tensor, ``ceil(d0 / W)``
rows per rank, laid out rank-major in each bucket (as FSDP2 lays out its flat buffers) so
that one reduce-scatter and one all-gather move a whole bucket in place. Because a rank
owns whole rows, each owned chunk is a box of the global tensor and the checkpoint is
written FQN-keyed with global offsets (DCP ``CheckpointableTensor``): the same files as
FSDP2's, so a checkpoint of either backend loads into the other at any world size.

Parameters are stored in ``training.mixed_precision_param``. In bfloat16 the fp32 master
is a separate sharded buffer and the model section of a checkpoint holds the fp32 master
(global shapes), never the bf16 copy. In float32 the owned rows of the parameters are the
master (no extra copy).

This module is the component (Options, checks, plan terms); the machinery is in zero1_optimizer.py,
imported when the component is applied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from components.state.common import check_threads, stage_params, step_params
from framework.contracts import PlanConstant, PlanFacts, PlanTerms, Term, check_choices

# the planner's constants of this backend; calibrate as `apiary plan calib.NAME=VALUE` (docs/skills/planner.md)
PLAN_CONSTANTS = {
    "zero1_param_bytes": PlanConstant(2.0, "zero1: bf16 model parameters replicated over data parallel "
                                           "(Megatron distributed-optimizer semantics)."),
    "zero1_grad_bytes": PlanConstant(4.0, "zero1: fp32 main gradients replicated over data parallel (Megatron)."),
    "zero1_bucket_params": PlanConstant(40e6, "zero1: gradient-reduction bucket size in parameters (Megatron "
                                              "default ~40M); two buckets in flight, fp32."),
    "zero1_overlap": PlanConstant(0.5, "fraction of ZeRO-1 grad reduce-scatter / param all-gather hidden."),
}

_REDUCE = ("reduce_scatter", "all_reduce")


class Zero1:
    PLAN_CONSTANTS = PLAN_CONSTANTS

    @dataclass(kw_only=True)
    class Options:
        name: str = "zero1"
        """registry name (state=zero1)"""
        offload: Literal["none", "optimizer"] = "none"
        """none | optimizer (master weights, optimizer states and the update on the host)"""
        offload_threads: int = 0
        """CPU threads of the host update with offload=optimizer (0: CPUs / local ranks)"""
        grad_reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
        """how fp32 gradient buckets are reduced over data parallel"""
        bucket_mb: float = 256.0
        """fp32 gradient bucket size; bounds the all-gather buffer too"""

        def __post_init__(self):
            check_choices(self, "state.", " for zero1")
            if not self.bucket_mb > 0:
                raise ValueError(f"state.bucket_mb must be > 0, got {self.bucket_mb}")
            check_threads(self.offload_threads, self.offload)

    @staticmethod
    def check(options: "Zero1.Options", ctx=None) -> None:
        """Nothing beyond the Options' own value checks (``__post_init__``, run as resolve builds them)."""

    @staticmethod
    def layout(options: "Zero1.Options", dims: dict) -> tuple[dict, str]:
        """ZeRO-1 has no replicate/shard split: every data-parallel rank holds the parameters and the
        optimizer is sharded over all of them. dp_replicate folds into dp_shard, so the dense "fsdp"
        mesh (dp_shard x cp) is the whole data-parallel group and EP is still carved out of it."""
        if dims["dp_replicate"] > 1:
            dims = {**dims, "dp_shard": dims["dp_shard"] * dims["dp_replicate"], "dp_replicate": 1}
        return dims, ("state=zero1 runs one data-parallel group: dp_replicate x dp_shard folded into dp_shard "
                      "(components/state/zero1.py)")

    @staticmethod
    def apply(options: "Zero1.Options", tc, ctx=None) -> None:
        opts, tt_config = options, tc
        par = tt_config.parallelism
        if par.data_parallel_replicate_degree > 1:  # resolve ran Zero1.layout: never for a resolved run
            raise ValueError(f"state=zero1 runs no replicated data parallel, got dp_replicate="
                             f"{par.data_parallel_replicate_degree} (the layout was not resolved with state=zero1)")
        # DTensors for the model-parallel axes only (EP experts stay DTensors on the ep mesh,
        # so checkpoints keep global shapes); data parallel is this module's business.
        par.spmd_backend = "partial_dtensor"
        tt_config.training.enable_cpu_offload = False
        from components.state.zero1_optimizer import Zero1Optimizers, without_fsdp  # reason: start-up time (torch)

        spec = tt_config.model_spec
        tt_config.model_spec = replace(spec, parallelize_fn=without_fsdp(spec.parallelize_fn))
        o = tt_config.optimizer
        tt_config.optimizer = Zero1Optimizers.Config(
            param_groups=list(o.param_groups),
            implementation=o.implementation,
            optimizer_factory_kwargs_by_name=dict(o.optimizer_factory_kwargs_by_name),
            offload=opts.offload == "optimizer",
            offload_threads=int(opts.offload_threads),
            grad_reduce=opts.grad_reduce,
            bucket_mb=float(opts.bucket_mb),
            param_dtype=tt_config.training.mixed_precision_param,
            reduce_dtype=tt_config.training.mixed_precision_reduce,
        )

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """bf16 parameters and fp32 gradients at the EP/TP layout (``zero1_*_bytes``), master +
        Adam sharded over DP x CP x TP, two gradient buckets; reduce-scatter + all-gather of the
        gradients / parameters over the whole data-parallel group per step."""
        c, lay, pc = ctx.plan.constants, ctx.layout, ctx.plan
        dpr, dps, cp, ep, tp = lay.dp_replicate, lay.dp_shard, lay.cp, lay.ep, lay.tp
        dense_stage, exp_stage = stage_params(ctx)
        local = dense_stage / tp + exp_stage / ep
        opt_local = dense_stage / (tp * dpr * dps * cp) + exp_stage / (dpr * dps * cp * tp)
        pb, gb, how = c.zero1_param_bytes, c.zero1_grad_bytes, f"dense/{tp} (TP) + experts/{ep} (EP)"
        ob = c.master_bytes + c.adam_bytes
        mem = [Term("parameters", local, pb, "static", f"stage params {how} x {pb:g} B"),
               Term("gradients", local, gb, "static", f"stage params {how} x {gb:g} B"),
               Term("optimizer_states", opt_local, ob, "static",
                    f"stage params / (DP x CP x TP = {dpr * dps * cp * tp}) x {ob:g} B (master + Adam)"),
               Term("grad_buckets", 2 * c.zero1_bucket_params, 4.0, "buffers",
                    f"2 buckets x {c.zero1_bucket_params:,.0f} params x 4 B")]
        dense_t, exp_t = step_params(ctx)
        s_d, s_e = dpr * dps * cp, dpr * dps * cp * tp // max(ep, 1)
        vol_d = dense_t / tp * (4 + 2) * (s_d - 1) / s_d
        vol_e = exp_t / ep * (4 + 2) * (s_e - 1) / s_e if s_e > 1 else 0.0
        comm = vol_d / pc.link_bw(s_d, tp) + vol_e / pc.link_bw(s_e, ep)
        return PlanTerms(memory=mem, facts=PlanFacts(comm={"zero1": comm}, overlap={"zero1": c.zero1_overlap},
                                                     label="ZeRO-1"))

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another sharding of the same update changes reduction order).
    NUMERICS = {"": "dtype"}
