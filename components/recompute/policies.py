"""Activation recompute policies: torchtitan's activation checkpointing per block."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC


class NoRecompute:
    @dataclass
    class Options:
        name: str = "none"

    @staticmethod
    def ac_config(opts):
        return None


class SelectiveRecompute:
    """Save expensive op outputs (matmuls, attention, collectives); recompute the rest."""

    @dataclass
    class Options:
        name: str = "selective"

    @staticmethod
    def ac_config(opts):
        return SelectiveAC.Config()


class FullRecompute:
    """Keep only each block's input; rerun the whole block in backward."""

    @dataclass
    class Options:
        name: str = "full"

    @staticmethod
    def ac_config(opts):
        return FullAC.Config()
