"""FSDP2 (ZeRO-3-like): torchtitan's fully_shard per transformer block; parameters,
gradients and optimizer states sharded over dp_shard x cp, routed experts over their own
(efsdp) mesh. Parameters are all-gathered per block in the compute dtype."""

from __future__ import annotations

from dataclasses import dataclass


class FSDP2:
    @dataclass
    class Options:
        name: str = "fsdp2"
        reshard_after_forward: str = "default"  # default | always | never
        offload: str = "none"  # none | all (parameters, gradients and optimizer on CPU)

    @staticmethod
    def apply(opts: "FSDP2.Options", tt_config) -> None:
        if opts.reshard_after_forward not in ("default", "always", "never"):
            raise ValueError(
                f"state.reshard_after_forward must be default|always|never, got {opts.reshard_after_forward!r}")
        if opts.offload not in ("none", "all"):
            raise ValueError(f"state.offload must be none|all for fsdp2, got {opts.offload!r}")
        tt_config.parallelism.fsdp_reshard_after_forward = opts.reshard_after_forward
        tt_config.training.enable_cpu_offload = opts.offload == "all"
