"""Activation recompute policies: torchtitan's activation checkpointing per block."""

from __future__ import annotations

from dataclasses import dataclass


class NoRecompute:
    @dataclass(kw_only=True)
    class Options:
        name: str = "none"
        """registry name (recompute=none)"""

    @staticmethod
    def check(options, ctx) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx) -> None:
        tc.activation_checkpoint = None


class SelectiveRecompute:
    """Save expensive op outputs (matmuls, attention, collectives); recompute the rest."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "selective"
        """registry name (recompute=selective)"""

    @staticmethod
    def check(options, ctx) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx) -> None:
        from torchtitan.distributed.activation_checkpoint import SelectiveAC  # reason: after devices.install

        tc.activation_checkpoint = SelectiveAC.Config()


class FullRecompute:
    """Keep only each block's input; rerun the whole block in backward."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "full"
        """registry name (recompute=full)"""

    @staticmethod
    def check(options, ctx) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx) -> None:
        from torchtitan.distributed.activation_checkpoint import FullAC  # reason: after devices.install

        tc.activation_checkpoint = FullAC.Config()
