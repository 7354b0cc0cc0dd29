"""A full disk, said in one paragraph: how much is free where, from an error or before a launch.

* ``full_errno(exc)``: the ENOSPC / EDQUOT ``OSError`` behind an exception, found through its chain
  (``__cause__``, ``__context__``: torch.save's ``RuntimeError: [enforce fail at inline_container.cc]
  unexpected pos`` keeps the file's OSError there) and DCP's per-rank ``failures`` (a
  ``CheckpointException``, a BaseException; another rank's arrives pickled, without its chain: a save
  that fails with less than ``NEARLY_FULL`` free is taken for a full disk too).
* ``room(path)``: the free and total bytes of the file system holding ``path`` (its nearest existing
  folder) and that file system's mount point, for a message.
* ``full_at_launch(key, path, what)``: the launch's refusal (a UserError, exit 2, before anything
  starts) when the folder a run or a tool would write is on a full disk (``LAUNCH_MIN_FREE``).
* ``checkpoint_room_warning(r)``: a launch's warning when the disk has less room than one checkpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from framework.errors import UserError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
LAUNCH_MIN_FREE = 2**20  # bytes: below this a launch is refused (its config, metrics and lock alone need some)
NEARLY_FULL = 16 * 2**20  # bytes: a failed save with less free than this is taken for a full disk (its errno lost)


def size_text(n: int | float | None) -> str:
    """Bytes for a message: ``512 bytes``, ``3.62 MiB``, ``1.50 TiB``."""
    if n is None:
        return "?"
    n = float(n)
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.2f} {unit}"
    return f"{n:.2f} PiB"


def existing(path) -> Path:
    """``path`` or its nearest existing parent (absolute)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_point(path) -> Path:
    p = existing(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def room(path) -> tuple[int, int, Path] | None:
    """(free bytes this user may write, total bytes, mount point) of the disk holding ``path``; None when
    the file system cannot say."""
    try:
        usage = shutil.disk_usage(existing(path))
        return int(usage.free), int(usage.total), mount_point(path)
    except OSError:
        return None


def room_text(path, has: str = "has") -> str:
    """``the disk of /mnt/x (mounted at /mnt) has 4.00 KiB free of 2.00 MiB`` (``has``: the verb)."""
    r = room(path)
    if r is None:
        return f"the disk of {existing(path)} cannot say how much is free"
    free, total, mount = r
    where = existing(path)
    at = "" if where == mount else f" (mounted at {mount})"
    return f"the disk of {where}{at} {has} {size_text(free)} free of {size_text(total)}"


def full_errno(exc: BaseException | None) -> OSError | None:
    """The OSError with errno ENOSPC or EDQUOT in ``exc`` or what it was raised from (see the module
    docstring); None when there is none."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e
        if isinstance(e, BaseException):
            todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            for f in failures.values():
                todo += list(f) if isinstance(f, tuple) else [f]
    return None


def stops_here(exc: BaseException) -> bool:
    """An exception that is a stop, not a failure to look into (Ctrl-C, an exit): never a full disk."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def nearly_full(path) -> bool:
    r = room(path)
    return r is not None and r[0] < NEARLY_FULL


def full_at_launch(key: str, path, what: str, err: OSError | None = None, nearly: bool = False) -> UserError:
    """The refusal of a launch (or a tool's output folder) on a full disk: where, how much is free,
    what could not be written, and what to do (``nearly``: not full yet, below ``LAUNCH_MIN_FREE``)."""
    why = f" ({err.strerror})" if err is not None and err.strerror else ""
    where = existing(path)
    name = key.split("=")[0]
    other = f"point {name} at another disk" if "=" in key and " " not in name else "choose a folder on another disk"
    state = (f"the disk is nearly full: {room_text(path)}, less than the {size_text(LAUNCH_MIN_FREE)} apiary asks "
             "for before it writes there" if nearly else f"the disk is full{why}: {room_text(path)}, so {what}")
    return UserError(key, f"{state}.", f"Free space there (`du -sh {where}/*` shows what takes it: old runs, old "
                     f"checkpoints), or {other}.")


def check_room(path, key: str, what: str) -> None:
    """Refuse (UserError, exit 2) a folder on a disk with less than ``LAUNCH_MIN_FREE`` free."""
    r = room(path)
    if r is not None and r[0] < LAUNCH_MIN_FREE:
        raise full_at_launch(key, path, what, nearly=bool(r[0]))


# float32 weights and Adam(W)'s two float32 moments: a lower bound (debug_moe's 0.26M params: 3.17 MB estimated,
# 3.79 MB on disk with DCP's metadata and the data position)
CHECKPOINT_BYTES_PER_PARAM = 12


def checkpoint_bytes(r) -> int | None:
    """About how many bytes one checkpoint of the resolved run ``r`` holds; None where apiary cannot say
    (checkpointing off, adapters, an optimizer other than Adam(W))."""
    cfg = r.cfg
    if not cfg.checkpoint.enable or str(cfg.adapter.name or "none") != "none" or cfg.optimizer.name not in ("Adam", "AdamW"):
        return None
    return int(r.facts.n_params * CHECKPOINT_BYTES_PER_PARAM)


def checkpoint_room_warning(r) -> str | None:
    """A launch's warning when the run folder's disk has less free than one checkpoint of the run."""
    need, have = checkpoint_bytes(r), room(r.cfg.output_dir)
    if need is None or have is None or have[0] >= need:
        return None
    out = r.cfg.output_dir
    return (f"output_dir={out}: {room_text(out)}, and one checkpoint of this run takes about {size_text(need)} "
            f"({r.facts.n_params / 1e6:,.1f}M params x {CHECKPOINT_BYTES_PER_PARAM} bytes: float32 weights and "
            f"{r.cfg.optimizer.name}'s two moments), so its first save (step {r.cfg.checkpoint.interval} or its last) "
            "will likely stop it on a full disk (exit 74). Free space there, or point output_dir at another disk.")
