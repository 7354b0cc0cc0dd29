"""The run folder's disk filled up while the run trained (was: a 105-line ``[rank0]:`` traceback ending in
torch.save's ``unexpected pos 704 vs 598``, exit 1, no summary, ``checkpoint/.partial-N`` left behind).

A save that fails on a full disk (framework/train/atomic_save.py) and any other write of the run that
raises ENOSPC or EDQUOT (metrics.jsonl, a manifest: framework/train/run.py) stop training with one
paragraph (``DiskFull``, exit ``EXIT_DISK_FULL``, 74): the folder and how much is free there, the size of
a checkpoint of this run, what is kept (the complete checkpoints, metrics.jsonl; the half-written
``.partial-N`` is removed first, which also makes room for summary.json) and what to do. A full disk at
launch is refused before anything starts (exit 2: framework/resolve/disk.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from framework.errors import EXIT_DISK_FULL, DiskFull
from framework.resolve import disk
from framework.train import integrity

EXIT_CODE = EXIT_DISK_FULL


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def drop_partials(checkpoint_dir: Path) -> list[str]:
    """Remove every half-written save (``.partial-N``: never visible to a resume); their names."""
    gone = []
    for p in sorted(Path(checkpoint_dir).glob(f"{integrity.PARTIAL}*")):
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            gone.append(f"checkpoint/{p.name}")
    return gone


def _logged_steps(out: Path) -> str:
    """``metrics.jsonl (steps 1-6)`` from its first and last records; ``metrics.jsonl`` when unreadable."""
    path = out / "metrics.jsonl"
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        first, last = json.loads(lines[0]).get("step"), json.loads(lines[-1]).get("step")
    except (OSError, ValueError, IndexError, AttributeError):
        return "metrics.jsonl" if path.is_file() else ""
    return f"metrics.jsonl (steps {first}-{last})" if first != last else f"metrics.jsonl (step {last})"


def error(output_dir, *, step: int | None, saving: int | None = None, written: int | None = None,
          removed: list[str] | None = None, err: OSError | None = None, room: str | None = None) -> DiskFull:
    """The paragraph: ``step`` the last step trained, ``saving`` the step whose checkpoint did not fit
    (None: another write failed), ``written`` the bytes of it on disk when the disk filled, ``removed`` the
    half-written saves removed since, ``room`` the disk's free space when it filled (``disk.room_text``,
    taken before anything was removed; default: now)."""
    out = Path(output_dir)
    ck = out / "checkpoint"
    steps = integrity.complete_steps(ck) if ck.is_dir() else []
    why = f" ({err.strerror})" if err is not None and err.strerror else ""
    what = (f"saving checkpoint step-{saving} into {ck} failed" if saving is not None
            else "writing the run's files failed")
    size = ""
    if steps:
        size = f"; a checkpoint of this run takes {disk.size_text(folder_bytes(ck / f'step-{steps[-1]}'))} (step-{steps[-1]})"
    elif written:
        size = f"; a checkpoint of this run takes more than the {disk.size_text(written)} of it written by then"
    trained = f"Training stopped after step {step}" if step else "Nothing was trained"
    kept = [f"the complete checkpoint{'s' if len(steps) > 1 else ''} "
            f"{', '.join(f'step-{n}' for n in steps)}" if steps else "no complete checkpoint (none was saved yet)"]
    if logged := _logged_steps(out):
        kept.append(logged)
    gone = f"; the half-written {', '.join(removed)} removed" if removed else ""
    free = f"Free space there (`du -sh {disk.existing(out)}/*`: older runs, or a lower checkpoint.keep_latest_k for this one)"
    fix = (f"{free} or copy the run folder to a bigger disk, then resume from step-{steps[-1]}: the same command with "
           f"checkpoint.resume=true output_dir={out} (or the copy)" if steps else
           f"{free} or choose an output_dir on a bigger disk, then run the same command again (no step was saved, so "
           "there is nothing to resume)")
    return DiskFull(f"output_dir={output_dir}",
                    f"the disk is full{why}: {what}; {room or disk.room_text(out, has='had')} then{size}. {trained}; "
                    f"kept: {', '.join(kept)}{gone}.", f"{fix}. Exit code {EXIT_CODE}.")
