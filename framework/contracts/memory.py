"""Memory listeners: components that react at run time when the CUDA caching allocator retries.

A retry (``num_alloc_retries``) is an allocation that failed, freed the allocator's cached blocks and
was tried again: slow, and a sign the step's peak is at the GPU's limit. After every step the trainer
counts the retries of that step (the most any rank had: every rank then decides alike) and hands
them to each listener registered on the model; a listener that changes something returns a
``MemoryReaction``: the trainer prints its line, writes its ``learned`` state into the run folder
(``LEARNED_FILE``, under the listener's kind) for a resume to start from, and logs its ``metrics``
in metrics.jsonl from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

MEMORY_LISTENERS_ATTR = "_apiary_memory_listeners"  # on a model part: [listener, ...]
LEARNED_FILE = "learned.json"  # in the run folder: {kind: the kind's learned state}


@dataclass
class MemoryReaction:
    """What a listener changed: ``line`` (one console line: what changed and why), ``learned`` (what
    a resume of the run starts from, read back by the kind's planning at resolve)."""

    line: str
    learned: dict = field(default_factory=dict)


class MemoryListener(Protocol):
    kind: str
    """the registry kind of the component that registered it (its learned state's key)"""
    metrics: dict
    """scalars for each metrics.jsonl record (their current values)"""

    def on_step(self, step: int, steps_run: int, retries: int) -> MemoryReaction | None:
        """After step ``step`` (the ``steps_run``-th of this process; the first ones compile and
        autotune): ``retries`` allocator retries happened in it on the worst rank."""


def add_memory_listener(model: Any, listener: MemoryListener) -> None:
    """Register ``listener`` on a model part (a component does it on the model it wraps, so the
    registration lives and dies with that model)."""
    listeners = getattr(model, MEMORY_LISTENERS_ATTR, None)
    if listeners is None:
        listeners = []
        setattr(model, MEMORY_LISTENERS_ATTR, listeners)
    listeners.append(listener)


def memory_listeners(model_parts: Any) -> list:
    """The listeners registered on ``model_parts``, in order."""
    return [x for part in model_parts for x in (getattr(part, MEMORY_LISTENERS_ATTR, None) or [])]
