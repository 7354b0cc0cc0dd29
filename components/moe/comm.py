"""Expert-parallel token dispatch/combine backends (names bound in registry.yaml)."""

from __future__ import annotations

from framework.errors import UserError


class AllToAll:
    """torch all_to_all_single with a host sync on the split sizes (torchtitan 'standard')."""

    torchtitan_backend = "standard"

    @staticmethod
    def check() -> None:
        return None

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another dispatch/combine backend).
    NUMERICS = {"": "dtype"}


class DeepEP:
    """DeepEP >= 2 (deep_ep.ElasticBuffer) kernels through torchtitan's 'deepep' backend.

    Needs CUDA and DeepEP built from source (docs/install.md); asking for it without them is a
    user error at resolve time, before any worker starts.
    """

    torchtitan_backend = "deepep"

    @staticmethod
    def check() -> None:
        try:
            import deep_ep  # optional dependency: DeepEP (CUDA, built from source)
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
