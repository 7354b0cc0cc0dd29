"""Expert-parallel token dispatch/combine backends (names bound in registry.yaml)."""

from __future__ import annotations


class AllToAll:
    """torch all_to_all_single with a host sync on the split sizes (torchtitan 'standard')."""

    torchtitan_backend = "standard"

    @staticmethod
    def check() -> None:
        return None
