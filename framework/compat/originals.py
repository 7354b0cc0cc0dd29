"""What a patch replaced: the first value each patched target had (``original(target)``), so that
a patch is applied once and tests/test_compat.py can check the library's own signature.
"""

from __future__ import annotations

import importlib

_ORIGINALS: dict[str, object] = {}  # "module:attribute.path" -> what a patch replaced (first patch only)


def _keep_original(target: str, value) -> None:
    _ORIGINALS.setdefault(target, value)


def original(target: str):
    """The third-party object at ``target`` ("module:attribute.path") as the library defines it:
    what a patch replaced, or the current value where nothing replaced it."""
    if target in _ORIGINALS:
        return _ORIGINALS[target]
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
