"""Activation recompute policies: torchtitan's activation checkpointing per block."""

from __future__ import annotations

from dataclasses import dataclass


class NoRecompute:
    @dataclass
    class Options:
        name: str = "none"

    @staticmethod
    def ac_config(opts):
        return None

    # apiary compare: how runs differing in this component or its options are held to each other
    # (recompute reruns the same forward ops in backward).
    NUMERICS = {"": "exact"}


class SelectiveRecompute:
    """Save expensive op outputs (matmuls, attention, collectives); recompute the rest."""

    @dataclass
    class Options:
        name: str = "selective"

    @staticmethod
    def ac_config(opts):
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        return SelectiveAC.Config()

    # apiary compare: how runs differing in this component or its options are held to each other
    # (recompute reruns the same forward ops in backward).
    NUMERICS = {"": "exact"}


class FullRecompute:
    """Keep only each block's input; rerun the whole block in backward."""

    @dataclass
    class Options:
        name: str = "full"

    @staticmethod
    def ac_config(opts):
        from torchtitan.distributed.activation_checkpoint import FullAC

        return FullAC.Config()

    # apiary compare: how runs differing in this component or its options are held to each other
    # (recompute reruns the same forward ops in backward).
    NUMERICS = {"": "exact"}
