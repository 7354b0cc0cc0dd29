"""FSDP2 (ZeRO-3-like): torchtitan's fully_shard per transformer block; parameters,
gradients and optimizer states sharded over dp_shard x cp, routed experts over their own
(efsdp) mesh. Parameters are all-gathered per block in the compute dtype.

offload: ``none``; ``optimizer`` (Adam states, fp32 master and the update on the host;
components.state.offload); ``all`` (torchtitan's CPUOffloadPolicy: parameters, gradients
and optimizer on the host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from components.state.common import check_threads, stage_params, step_params
from framework.contracts import PlanConstant, PlanFacts, PlanTerms, Term, check_choices

# the planner's constants of this backend; calibrate as `apiary plan calib.NAME=VALUE` (docs/skills/planner.md)
PLAN_CONSTANTS = {
    "fsdp2_param_bytes": PlanConstant(0.0, "fsdp2: persistent low-precision parameter copy besides the fp32 "
                                           "shard. torchtitan keeps only the fp32 shard (counted as the master in "
                                           "optimizer_states) and casts to bf16 when it all-gathers (fsdp buffers), "
                                           "so 0. Seed 000's accounting (params + grads = 6 B/param) corresponds to 2."),
    "fsdp2_grad_bytes": PlanConstant(4.0, "fsdp2: sharded gradient in the fp32 reduce dtype (torchtitan "
                                          "mixed_precision_reduce=float32)."),
    "fsdp_allgather_units": PlanConstant(2, "FSDP2 keeps the current unit's all-gathered params and prefetches "
                                            "the next: the largest unit (often the lm_head) plus this many minus one "
                                            "transformer blocks are counted (embedding and lm_head are never "
                                            "gathered together)."),
    "fsdp_allgather_bytes": PlanConstant(2.0, "bytes per element of an all-gathered parameter (bf16 param_dtype)."),
    "fsdp_unsharded_grad_bytes": PlanConstant(2.0, "unsharded gradient of one unit in the param dtype (bf16)."),
    "fsdp_reduce_bytes": PlanConstant(4.0, "reduce-scatter input of one unit in the fp32 reduce dtype."),
    "fsdp_overlap": PlanConstant(0.85, "fraction of FSDP all-gather/reduce-scatter hidden by prefetching."),
    "offload_device_window_chunks": PlanConstant(3, "state.offload_update=device: chunks whose Adam moments are on "
                                                    "the device at once (the one updating, the next arriving, the "
                                                    "last leaving)."),
}
DEVICE_UPDATE_CHUNK_BYTES = 256 << 20  # state.offload_update=device: fp32 parameter bytes per chunk


def _grad_accum(tc, ctx) -> int:
    """Micro-batches per optimizer step, as torchtitan's trainer derives them (global batch over local
    batch x data-parallel ranks; 1 without a global batch). The overlapped host optimizer copies a
    gradient after this many accumulations; a wrong count costs overlap, not correctness (its step
    copies again any gradient that changed after its copy)."""
    gb, lb = int(tc.training.global_batch_size), int(tc.training.local_batch_size)
    dp = int(ctx.layout.dp) if ctx is not None and ctx.layout is not None else 1
    return max(1, gb // (lb * dp)) if gb > 0 and lb > 0 else 1


class FSDP2:
    PLAN_CONSTANTS = PLAN_CONSTANTS

    @dataclass(kw_only=True)
    class Options:
        name: str = "fsdp2"
        """registry name (state=fsdp2)"""
        reshard_after_forward: Literal["default", "always", "never"] = "default"
        """free each block's all-gathered parameters after its forward (torchtitan's policy)"""
        offload: Literal["none", "optimizer", "all"] = "none"
        """none | optimizer (Adam states, fp32 master, update on the host) | all (+ params and grads)"""
        offload_threads: int = 0
        """CPU threads of the host update with offload=optimizer (0: CPUs / local ranks)"""
        offload_overlap: bool = False
        """offload=optimizer only: gradients leave the device during the backward, the host update runs
        in chunks whose shards travel back while the next chunk updates (not yet measured on a GPU)"""
        offload_update: Literal["host", "device"] = "host"
        """offload=optimizer only: where the update runs. host: Adam on the CPU (fp32 master, gradient
        staging and moments in host memory); device: only the moments live on the host and stream to the
        device in chunks after the backward, the update is offload=none's"""

        def __post_init__(self):
            check_choices(self, "state.", " for fsdp2")
            check_threads(self.offload_threads, self.offload)
            if self.offload_overlap and self.offload != "optimizer":
                raise ValueError(
                    f"state.offload_overlap=true overlaps the host optimizer update of state.offload=optimizer "
                    f"with the device's work, but this run has state.offload={self.offload}: with offload=none "
                    f"the optimizer runs on the device and there is nothing to overlap, and with offload=all "
                    f"FSDP2 itself moves the gradients to the host. Set state.offload=optimizer, or drop "
                    f"state.offload_overlap.")
            if self.offload_update == "device":
                if self.offload != "optimizer":
                    raise ValueError(
                        f"state.offload_update=device runs the update of state.offload=optimizer on the device "
                        f"with the Adam moments kept on the host, but this run has state.offload={self.offload}, "
                        f"which has no offloaded moments to stream. Set state.offload=optimizer, or drop "
                        f"state.offload_update.")
                if self.offload_overlap or int(self.offload_threads):
                    raise ValueError(
                        "state.offload_update=device updates on the device, so state.offload_overlap and "
                        "state.offload_threads (settings of the host update) would do nothing. Drop them, or "
                        "use state.offload_update=host.")

    @staticmethod
    def check(options: "FSDP2.Options", ctx=None) -> None:
        """Nothing beyond the Options' own value checks (``__post_init__``, run as resolve builds them)."""

    @staticmethod
    def apply(options: "FSDP2.Options", tc, ctx=None) -> None:
        opts, tt_config = options, tc
        tt_config.parallelism.fsdp_reshard_after_forward = opts.reshard_after_forward
        tt_config.training.enable_cpu_offload = opts.offload == "all"
        if opts.offload == "optimizer" and opts.offload_update == "device":
            from components.state.device_update import DeviceUpdateOptimizers  # reason: start-up time (torch, torchtitan)

            o = tt_config.optimizer
            tt_config.optimizer = DeviceUpdateOptimizers.Config(
                param_groups=list(o.param_groups),
                implementation=o.implementation,
                optimizer_factory_kwargs_by_name=dict(o.optimizer_factory_kwargs_by_name),
                chunk_bytes=DEVICE_UPDATE_CHUNK_BYTES,
            )
        elif opts.offload == "optimizer":
            from components.state.offload import HostOptimizers  # reason: start-up time (torch, torchtitan)

            o = tt_config.optimizer
            tt_config.optimizer = HostOptimizers.Config(
                param_groups=list(o.param_groups),
                implementation=o.implementation,
                optimizer_factory_kwargs_by_name=dict(o.optimizer_factory_kwargs_by_name),
                threads=int(opts.offload_threads),
                overlap=bool(opts.offload_overlap),
                grad_accum=_grad_accum(tt_config, ctx),
            )

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Parameters (``fsdp2_param_bytes``), fp32 gradients and optimizer states sharded over
        dp_shard x cp x tp (none on the GPU with offload=all); the all-gather buffers of the
        largest unit plus prefetched blocks (converted linears in FP8 where precision says so),
        the reduce-scatter buffer; all-gather fwd + bwd and reduce-scatter traffic per step."""
        c, f, lay, pc = ctx.plan.constants, ctx.facts, ctx.layout, ctx.plan
        dps, cp, ep, tp = lay.dp_shard, lay.cp, lay.ep, lay.tp
        fp8 = pc.earlier["precision"].facts if "precision" in pc.earlier else PlanFacts()
        dense_stage, exp_stage = stage_params(ctx)
        offload = opts is not None and str(opts.offload) == "all"
        shard = dps * cp * tp
        local = (dense_stage + exp_stage) / shard
        pb, gb, ob = c.fsdp2_param_bytes, c.fsdp2_grad_bytes, c.master_bytes + c.adam_bytes
        how = f"stage params / {shard} (dp_shard x cp x tp" + (
            f"; experts over ep {ep} x efsdp {shard // ep})" if f.num_experts else ")")
        gone = 0.0 if offload else 1.0
        host_adam = opts is not None and str(opts.offload) == "optimizer"  # the moments live on the host
        ob_here = c.master_bytes if host_adam else ob
        mem = [Term("parameters", local * gone, pb, "static", f"{how} x {pb:g} B"),
               Term("gradients", local * gone, gb, "static", f"{how} x {gb:g} B"),
               Term("optimizer_states", local * gone, ob_here, "static",
                    f"{how} x {ob_here:g} B ("
                    + ("fp32 master; the Adam moments on the host: state.offload=optimizer)" if host_adam else
                       "master + Adam)" + (" (offloaded to CPU)" if offload else "")))]
        if host_adam and str(getattr(opts, "offload_update", "host")) == "device":
            # a chunk never splits a parameter: the one holding the largest (the embedding or the LM head
            # shard) is that big, and the window holds it with its neighbours
            chunk = DEVICE_UPDATE_CHUNK_BYTES / 4  # fp32 parameters per chunk
            big = max([pc.split["emb"]] * pc.first + [pc.split["head"]] * pc.last + [0.0]) / shard
            w = int(c.offload_device_window_chunks)
            window = min(local, max(big, chunk) + (w - 1) * chunk)  # parameters whose moments are on the device
            mem.append(Term("offload_moment_window", window, c.adam_bytes, "buffers",
                            f"state.offload_update=device: {w} chunks of {DEVICE_UPDATE_CHUNK_BYTES >> 20} MiB of "
                            f"fp32 parameters (the largest parameter's chunk among them) x {c.adam_bytes:g} B of "
                            f"Adam moments on the device at once"))
        # buffers: the embedding and the lm_head are never gathered together; the prefetched neighbour is a block
        split = pc.split
        block = split["dense_blocks"] / f.n_layers / tp + split["experts"] / f.n_layers / max(ep, 1)
        units = [max([block] + ([split["emb"] / tp] if pc.first else []) + ([split["head"] / tp] if pc.last else []))]
        units += [block] * (max(1, int(c.fsdp_allgather_units)) - 1)
        k = max(1, int(c.fsdp_allgather_units))
        ag = c.fsdp_allgather_bytes
        if fp8.fp8_all_gather:  # the block's converted dense linears arrive in FP8
            dense_block = split["dense_blocks"] / f.n_layers / tp
            ag_block = (block - dense_block * fp8.dense_share) * ag + dense_block * fp8.dense_share * \
                c.fp8_allgather_bytes
            units_b = [u * ag if u != block else ag_block for u in units[:k]]
            mem.append(Term("fsdp_allgather", 1, sum(units_b), "buffers",
                            f"largest unit + {k - 1} prefetched block(s), converted dense linears in FP8 "
                            f"({c.fp8_allgather_bytes:g} B) and the rest at {ag:g} B"))
        else:
            mem.append(Term("fsdp_allgather", sum(units[:k]), c.fsdp_allgather_bytes, "buffers",
                            f"largest unit + {k - 1} prefetched block(s) ({' + '.join(f'{u / 1e6:,.0f}M' for u in units[:k])} "
                            f"params per rank) "
                            f"x {c.fsdp_allgather_bytes:g} B"))
        rb = c.fsdp_unsharded_grad_bytes + c.fsdp_reduce_bytes
        mem.append(Term("fsdp_reduce_scatter", units[0], rb, "buffers",
                        f"largest unit {units[0] / 1e6:,.0f}M params x ({c.fsdp_unsharded_grad_bytes:g} B grad + "
                        f"{c.fsdp_reduce_bytes:g} B fp32 reduce input)"))
        # traffic per optimizer step: all-gather fwd, all-gather bwd, reduce-scatter
        dense_t, exp_t = step_params(ctx)
        s_d, s_e = dps * cp, dps * cp * tp // max(ep, 1)
        per = 2 * c.fsdp_allgather_bytes + c.fsdp_reduce_bytes
        per_d = per
        if fp8.fp8_all_gather:  # converted dense linears all-gather 1 B/element
            sh = fp8.dense_share * split["dense_blocks"] / lay.pp / dense_t if dense_t else 0.0
            per_d = per - 2 * sh * (c.fsdp_allgather_bytes - c.fp8_allgather_bytes)
        vol_d = pc.grad_accum * dense_t / tp * per_d * (s_d - 1) / s_d if s_d > 1 else 0.0
        vol_e = pc.grad_accum * exp_t / ep * per * (s_e - 1) / s_e if s_e > 1 else 0.0
        comm = vol_d / pc.link_bw(s_d, tp) + vol_e / pc.link_bw(s_e, ep)
        return PlanTerms(memory=mem, facts=PlanFacts(comm={"fsdp": comm}, overlap={"fsdp": c.fsdp_overlap},
                                                     label="FSDP"))

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another sharding of the same update changes reduction order).
    NUMERICS = {"": "dtype"}
