"""FSDP2 (ZeRO-3-like): torchtitan's fully_shard per transformer block; parameters,
gradients and optimizer states sharded over dp_shard x cp, routed experts over their own
(efsdp) mesh. Parameters are all-gathered per block in the compute dtype.

offload: ``none``; ``optimizer`` (Adam states, fp32 master and the update on the host;
components.state.offload); ``all`` (torchtitan's CPUOffloadPolicy: parameters, gradients
and optimizer on the host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from components.state.common import check_threads
from framework.contracts import check_choices


class FSDP2:
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

        def __post_init__(self):
            check_choices(self, "state.", " for fsdp2")
            check_threads(self.offload_threads)

    @staticmethod
    def check(options: "FSDP2.Options", ctx=None) -> None:
        """ValueError for option values this backend cannot run (resolve calls it before launch)."""
        type(options).__post_init__(options)

    @staticmethod
    def apply(options: "FSDP2.Options", tc, ctx=None) -> None:
        opts, tt_config = options, tc
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
