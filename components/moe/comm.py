"""Expert-parallel token dispatch/combine backends (names bound in registry.yaml)."""

from __future__ import annotations

from dataclasses import dataclass

from framework.errors import UserError


@dataclass(kw_only=True)
class MoeOptions:
    """The recipe's ``moe:`` section as the ``moe_comm`` and ``moe_chunk`` kinds read it. Its keys,
    their types, defaults and docs are framework/schema.py's MoEConfig, their one definition:
    ``contracts.make_options`` builds this class over it (comm, chunk, load_balance_coeff, ...)."""


class _Comm:
    Options = MoeOptions
    torchtitan_backend = ""

    @staticmethod
    def check(options, ctx=None) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        """Nothing to edit: the model family passes ``torchtitan_backend`` to its model config."""
        return None


class AllToAll(_Comm):
    """torch all_to_all_single with a host sync on the split sizes (torchtitan 'standard')."""

    torchtitan_backend = "standard"

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another dispatch/combine backend).
    NUMERICS = {"": "dtype"}


@dataclass(kw_only=True)
class DeepEPOptions(MoeOptions):
    """``moe:`` with moe.comm=deepep: the package is checked as the options are read, before the
    model is sized (torchtitan's DeepEP dispatcher cannot even be configured without it)."""

    def __post_init__(self):
        DeepEP.check()


class DeepEP(_Comm):
    """DeepEP >= 2 (deep_ep.ElasticBuffer) kernels through torchtitan's 'deepep' backend.

    Needs CUDA and DeepEP built from source (docs/install.md); asking for it without them is a
    user error at resolve time, before any worker starts.
    """

    torchtitan_backend = "deepep"
    Options = DeepEPOptions

    @staticmethod
    def check(options=None, ctx=None) -> None:
        try:
            import deep_ep  # reason: optional dependency (CUDA builds only)
        except ImportError:
            raise UserError("moe.comm=deepep", "the deep_ep package is not installed.",
                            "Build DeepEP >= 2 from source (docs/install.md), or use moe.comm=alltoall.") from None
        if not hasattr(deep_ep, "ElasticBuffer"):
            raise UserError("moe.comm=deepep", f"deep_ep {getattr(deep_ep, '__version__', '?')} has no "
                            "ElasticBuffer; torchtitan's deepep backend needs DeepEP >= 2.",
                            "Rebuild DeepEP from its current source, or use moe.comm=alltoall.")

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another dispatch/combine backend).
    NUMERICS = {"": "dtype"}
