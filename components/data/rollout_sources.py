"""Where rollout records come from: the .jsonl / .parquet files of a path, each record with its file
and line (``located_records``, ``record_where``), and the digest that tells a changed file.
Shared by the static reader (rollouts.py), the followed folder (follow.py) and `apiary logprobs`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_FORMATS = (".jsonl", ".parquet")


def rollout_files(path: str | Path) -> list[Path]:
    """The rollout files of ``path`` (a file, or a folder read recursively), in name order; ValueError
    for an entry with a rollout suffix that cannot be read as a file (a folder, a device, a dangling
    link): it would otherwise be skipped, or read forever (a link to /dev/zero)."""
    p = Path(path)
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.suffix in _FORMATS)
        for f in found:
            why = not_a_file(f)
            if why:
                raise ValueError(f"{f}: {why}; a rollout file is a regular .jsonl or .parquet file")
        return found
    if p.suffix in _FORMATS and (p.exists() or p.is_symlink()):
        why = not_a_file(p)
        if why:
            raise ValueError(f"{p}: {why}; a rollout file is a regular .jsonl or .parquet file")
    if p.is_file() and p.suffix in _FORMATS:
        return [p]
    return []


def not_a_file(p: Path) -> str:
    """Why ``p`` is not a regular file to read records from ("" when it is one; links are followed)."""
    if p.is_symlink() and not p.exists():
        return f"a link to {os.readlink(p)}, which does not exist"
    if p.is_dir():
        return "a folder, not a file"
    if p.exists() and not p.is_file():
        return "not a regular file (a device, a pipe or a socket)"
    return ""


def file_digest(path: Path) -> bytes:
    """A digest of the file's bytes (a shard copied under another name has the same one)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


def record_where(path: Path, line: int) -> str:
    return f"{path}:{line}" if path.suffix == ".jsonl" else f"{path}[{line}]"


def located_records(path: Path):
    """(line, (a, b), record). jsonl: line number, (byte offset, 0); parquet: row number,
    (row group, row in it), read a batch of rows at a time."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            offset, i = 0, 0
            for line in f:
                i += 1
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{record_where(path, i)}: not a JSON object ({e})") from None
                    yield i, (offset, 0), rec
                offset += len(line)
    else:
        import pyarrow.parquet as pq  # optional dependency: pyarrow (parquet files only)

        pf, n = pq.ParquetFile(path), 0
        for g in range(pf.num_row_groups):
            j = 0
            for batch in pf.iter_batches(batch_size=256, row_groups=[g]):
                for rec in batch.to_pylist():
                    yield n, (g, j), rec
                    n += 1
                    j += 1
