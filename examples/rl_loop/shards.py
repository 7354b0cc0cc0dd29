"""What both example generators share (standard library only): the toy task's reward, the trainer's
newest published folder, and writing a shard the trainer's follow mode reads (written aside, fsync'ed,
renamed, names in write order)."""

from __future__ import annotations

import json
import os
from pathlib import Path

LOWER = range(97, 123)  # 'a'..'z' in the byte tokenizer


def reward(completion: list[int]) -> float:
    """The fraction of the completion's tokens that are lowercase ASCII letters."""
    return sum(t in LOWER for t in completion) / max(len(completion), 1)


def latest(weights: Path) -> Path | None:
    """The folder ``WEIGHTS/latest`` names (None before the trainer's first publication)."""
    try:
        name = (weights / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    return weights / name if name else None


def write_shard(out: Path, index: int, records: list[dict]) -> Path:
    name = f"{index:06d}.jsonl"
    tmp = out / f".{name}.tmp"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, out / name)
    return out / name
