"""FSDP2 (ZeRO-3-like): torchtitan's fully_shard per transformer block; parameters,
gradients and optimizer states sharded over dp_shard x cp, routed experts over their own
(efsdp) mesh. Parameters are all-gathered per block in the compute dtype.

offload: ``none``; ``optimizer`` (Adam states, fp32 master and the update on the host;
components.state.offload); ``all`` (torchtitan's CPUOffloadPolicy: parameters, gradients
and optimizer on the host)."""

from __future__ import annotations

from dataclasses import dataclass

from components.state.common import check_threads


class FSDP2:
    @dataclass
    class Options:
        name: str = "fsdp2"
        reshard_after_forward: str = "default"  # default | always | never
        # none | optimizer (Adam states, fp32 master, update on the host) | all (+ params and grads)
        offload: str = "none"
        offload_threads: int = 0  # CPU threads of the host update with offload=optimizer (0: CPUs / local ranks)

    @staticmethod
    def check(opts: "FSDP2.Options") -> None:
        """ValueError for option values this backend cannot run (resolve calls it before launch)."""
        if opts.reshard_after_forward not in ("default", "always", "never"):
            raise ValueError(
                f"state.reshard_after_forward must be default|always|never, got {opts.reshard_after_forward!r}")
        if opts.offload not in ("none", "optimizer", "all"):
            raise ValueError(f"state.offload must be none|optimizer|all for fsdp2, got {opts.offload!r}")
        check_threads(opts.offload_threads)

    @staticmethod
    def apply(opts: "FSDP2.Options", tt_config) -> None:
        FSDP2.check(opts)
        tt_config.parallelism.fsdp_reshard_after_forward = opts.reshard_after_forward
        tt_config.training.enable_cpu_offload = opts.offload == "all"
        if opts.offload == "optimizer":
            from components.state.offload import HostOptimizers

            o = tt_config.optimizer
            tt_config.optimizer = HostOptimizers.Config(
                param_groups=list(o.param_groups),
                implementation=o.implementation,
                optimizer_factory_kwargs_by_name=dict(o.optimizer_factory_kwargs_by_name),
                threads=int(opts.offload_threads),
            )

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another sharding of the same update changes reduction order).
    NUMERICS = {"": "dtype"}
