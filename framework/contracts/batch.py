"""Batch consumers: per-token model inputs that are not forward arguments.
"""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------------------------------------
# Batch consumers: per-token model inputs that are not forward arguments
# ---------------------------------------------------------------------------------------------

BATCH_CONSUMERS_ATTR = "_apiary_batch_consumers"  # on a model part: {batch key: consumer}


def add_batch_consumer(model: Any, key: str, consumer: Any) -> None:
    """Register ``consumer(tensor | None)`` on a model part (a component does it on the model it
    builds, e.g. in a wrapped ``parallelize_fn``, so the registration lives and dies with that
    model). Before every micro-batch's forward the trainer calls it with the batch's ``key`` tensor
    (one of the data component's ``BATCH_KEYS``: on the device, context-parallel sharded like the
    tokens along dim 1, trailing dims kept), or with None when the batch has no such key; the
    consumer keeps what it needs on the model's modules for that forward and its recompute."""
    consumers = getattr(model, BATCH_CONSUMERS_ATTR, None)
    if consumers is None:
        consumers = {}
        setattr(model, BATCH_CONSUMERS_ATTR, consumers)
    consumers[key] = consumer


def batch_consumers(model_parts: Any) -> dict[str, list]:
    """The consumers registered on ``model_parts``: batch key -> [consumer, ...]."""
    out: dict[str, list] = {}
    for part in model_parts:
        for key, consumer in (getattr(part, BATCH_CONSUMERS_ATTR, None) or {}).items():
            out.setdefault(key, []).append(consumer)
    return out
