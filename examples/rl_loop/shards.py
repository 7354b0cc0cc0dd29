"""What both example generators share (standard library only): the toy task's reward, the trainer's
newest published folder, and writing a shard the trainer's follow mode reads (written aside, fsync'ed,
renamed, names in write order)."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

LOWER = range(97, 123)  # 'a'..'z' in the byte tokenizer


def reward(completion: list[int]) -> float:
    """The fraction of the completion's tokens that are lowercase ASCII letters."""
    return sum(t in LOWER for t in completion) / max(len(completion), 1)


def grpo_advantages(rewards: list[float]) -> list[float]:
    """Each reward normalised within its group: (r - mean) / (std + 1e-4)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-4) for r in rewards]


def add_task_args(p: argparse.ArgumentParser) -> None:
    """The sampling task's options both generators take."""
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def latest(weights: Path) -> Path | None:
    """The folder ``WEIGHTS/latest`` names (None before the trainer's first publication)."""
    try:
        name = (weights / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    return weights / name if name else None


ADAPTER_CONFIG = "adapter_config.json"  # a LoRA run publishes its adapters alone, in PEFT's format


def adapter_base(folder: Path) -> Path | None:
    """The base folder a published adapter version applies to (None for a whole-model folder)."""
    f = folder / ADAPTER_CONFIG
    if not f.is_file():
        return None
    return Path(json.loads(f.read_text())["base_model_name_or_path"])


def version_of(folder: Path) -> int:
    """The ``policy_version`` of a published folder (-1 for a folder publication did not write)."""
    f = folder / "apiary_version.json"
    return int(json.loads(f.read_text())["version"]) if f.is_file() else -1


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
