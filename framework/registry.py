"""registry.yaml: kind -> name -> "module:attr". Loads lazily; knows no component by name."""

from __future__ import annotations

import importlib
from functools import lru_cache
from pathlib import Path

import yaml

from framework.errors import UserError, did_you_mean

ROOT = Path(__file__).resolve().parents[1]
REGISTRY_PATH = ROOT / "registry.yaml"
# Kinds whose chosen option is a config group: `loss=chunked loss.num_chunks=4`.
GROUP_KINDS = ("loss", "state", "recompute", "launcher", "precision")


@lru_cache(maxsize=None)
def entries() -> dict[str, dict[str, dict[str, str]]]:
    with open(REGISTRY_PATH) as f:
        return yaml.safe_load(f)


def names(kind: str) -> list[str]:
    return list(entries()[kind])


def doc(kind: str, name: str) -> str:
    return entries()[kind][name]["doc"]


def check(kind: str, name: str, where: str | None = None) -> None:
    known = entries().get(kind)
    if known is None:
        raise UserError(where or kind, f"unknown component kind {kind!r}.", did_you_mean(kind, entries()))
    if name not in known:
        raise UserError(
            where or kind,
            f"unknown {kind} {name!r}; registry.yaml lists {', '.join(known)}.",
            did_you_mean(name, known),
        )


def resolve(kind: str, name: str, where: str | None = None):
    """Import the object bound to kind/name."""
    check(kind, name, where)
    target = entries()[kind][name]["target"]
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj
