"""Checkpoint integrity: atomic saves with a manifest, verified before resuming.

A save of step N is written into ``checkpoint/.partial-N`` (a name torchtitan's and apiary's
``step-N`` scans never match), then every rank hashes its share of the files written there,
global rank 0 gathers the sizes and checksums into ``manifest.json`` (written last inside the
folder) and renames the folder to ``checkpoint/step-N``. A save killed midway therefore leaves
only ``.partial-N`` behind: invisible to resume, removed by the next save. Before a resume the
launching process (or global rank 0 under torchrun) re-hashes the step it will load and compares
it with the manifest; any difference (a changed byte, a truncated, missing or extra file) stops
the run with exit code 2 naming the step and the file, and how to resume from the previous step.

The checksum is xxHash's XXH3-64 (``xxhash``, a ``datasets`` dependency): about 11 GB/s on one
core of the 2-core CI box, against 1.7 GB/s for zlib.crc32 and 0.7 GB/s for blake2b
(benchmarks/checkpoint_bench.py). It detects accidental corruption, not tampering.

Also here: the non-finite guard's exit (``NonFiniteStop``, exit code 76) and the check that no
checkpoint is written from model or optimizer state holding NaN or Inf.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
PARTIAL = ".partial-"  # no "step-" in it: torchtitan's re.search(r"step-(\d+)") must not see it
STEP_RE = re.compile(r"step-(\d+)")
EXIT_NONFINITE = 76  # training stopped on NaN/Inf: nothing applied, nothing non-finite saved
VERIFIED_ENV = "APIARY_CHECKPOINT_VERIFIED"  # set by the launching process for its workers
_CHUNK = 8 << 20

try:
    import xxhash

    ALGORITHM = "xxh3_64"
except ImportError:  # pragma: no cover - xxhash comes with datasets
    xxhash = None
    ALGORITHM = "crc32"


# -- hashing -------------------------------------------------------------------------------
def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """Checksum of a file's bytes, read in 8 MiB blocks."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    if algorithm == "xxh3_64":
        h = xxhash.xxh3_64()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        return h.hexdigest()
    if algorithm == "crc32":
        import zlib

        crc = 0
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
        return f"{crc:08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative, sorted), the manifest excepted."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def entries(folder: Path, files: list[str], algorithm: str = ALGORITHM, threads: int = 1) -> dict:
    """{relative path: {"size", "hash"}} for ``files`` (xxhash and zlib release the GIL)."""
    folder = Path(folder)

    def one(rel):
        p = folder / rel
        return rel, {"size": p.stat().st_size, "hash": file_digest(p, algorithm)}

    if threads > 1 and len(files) > 1:
        with ThreadPoolExecutor(min(threads, len(files))) as pool:
            return dict(pool.map(one, files))
    return dict(map(one, files))


def write_manifest(folder: Path, step: int, files: dict, **timing) -> None:
    body = {"format": 1, "step": step, "algorithm": ALGORITHM, "files": files,
            **{k: round(v, 6) for k, v in timing.items()}}
    tmp = Path(folder) / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(folder) / MANIFEST)


# -- the step folders ----------------------------------------------------------------------
def step_dirs(checkpoint_dir: Path) -> dict[int, Path]:
    """{N: checkpoint/step-N} for every folder named exactly step-N."""
    ck = Path(checkpoint_dir)
    out = {}
    for p in ck.iterdir() if ck.is_dir() else []:
        m = STEP_RE.fullmatch(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def is_complete(step_dir: Path) -> bool:
    """Written to the end: a manifest (apiary's atomic save) or, for folders saved before
    manifests existed, DCP's .metadata (written last by DCP)."""
    return (Path(step_dir) / MANIFEST).is_file() or (Path(step_dir) / ".metadata").is_file()


def complete_steps(checkpoint_dir: Path) -> list[int]:
    return [n for n, p in step_dirs(checkpoint_dir).items() if is_complete(p)]


def verify(step_dir: Path, threads: int | None = None) -> tuple[str, str] | None:
    """None when ``step_dir`` matches its manifest, else (file, what is wrong). A folder without
    a manifest (saved before manifests) cannot be checked and passes."""
    step_dir = Path(step_dir)
    mf = step_dir / MANIFEST
    if not mf.is_file():
        return None
    try:
        body = json.loads(mf.read_text())
        want, algorithm = body["files"], body["algorithm"]
    except (ValueError, KeyError, TypeError):
        return MANIFEST, "the manifest itself is not readable JSON of apiary's format"
    have = set(list_files(step_dir))
    for rel in sorted(want):
        if rel not in have:
            return rel, "is missing"
        size = (step_dir / rel).stat().st_size
        if size != want[rel]["size"]:
            return rel, f"has {size:,} bytes, the manifest says {want[rel]['size']:,} (truncated or overwritten)"
    extra = sorted(have - set(want))
    if extra:
        return extra[0], "is not in the manifest (written after the save completed)"
    got = entries(step_dir, sorted(want), algorithm, threads or min(8, os.cpu_count() or 1))
    for rel in sorted(want):
        if got[rel]["hash"] != want[rel]["hash"]:
            return rel, f"has checksum {got[rel]['hash']}, the manifest says {want[rel]['hash']} (bytes changed)"
    return None


def corrupt_error(step_dir: Path, problem: tuple[str, str], previous: int | None, where: str):
    from framework.errors import UserError

    step_dir = Path(step_dir)
    n = STEP_RE.fullmatch(step_dir.name).group(1)
    fix = (f"Resume from the previous complete step with checkpoint.load_step={previous} (it is verified the "
           f"same way), or move {step_dir} aside." if previous is not None
           else f"No earlier complete step exists: move {step_dir} aside and start a fresh run.")
    return UserError(where, f"checkpoint step {n} is corrupt: {step_dir / problem[0]} {problem[1]}; "
                            "loading it could train on damaged weights.", fix)


def check_resume(run_dir: Path, load_step: int | None, where: str) -> int:
    """The step a resume of ``run_dir`` will load (``load_step`` or the latest complete one),
    verified against its manifest; raises UserError (exit 2) when it is missing or corrupt."""
    from framework.errors import UserError

    ck = Path(run_dir) / "checkpoint"
    steps = complete_steps(ck)
    if not steps:
        raise UserError(where, f"{run_dir} holds no complete checkpoint (checkpoint/step-N).",
                        "Check output_dir, or start a fresh run without checkpoint.resume.")
    if load_step is not None and load_step not in steps:
        raise UserError(f"checkpoint.load_step={load_step}", f"{ck} has no complete step {load_step}; complete "
                        f"steps: {', '.join(map(str, steps))}.", "Pick one of them.")
    step = load_step if load_step is not None else steps[-1]
    step_dir = ck / f"step-{step}"
    key = str(step_dir.resolve())
    # under torchrun without apiary's launcher, global rank 0 checks for all (its exit 2 ends the others)
    if os.environ.get(VERIFIED_ENV) != key and os.environ.get("RANK", "0") == "0":
        problem = verify(step_dir)
        if problem is not None:
            earlier = [s for s in steps if s < step]
            raise corrupt_error(step_dir, problem, earlier[-1] if earlier else None, where)
        os.environ[VERIFIED_ENV] = key  # the workers this process starts need not hash it again
    return step


# -- the atomic save -----------------------------------------------------------------------
def _cpu_group():
    """A gloo group for barriers and the gathered manifest (the default group when it is gloo)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if "gloo" in str(dist.get_backend()):
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def install_atomic_save(checkpointer, before_save=None) -> None:
    """Wrap ``checkpointer.dcp_save`` (a torchtitan CheckpointManager, on the instance): write
    aside, hash, manifest, rename. ``before_save()`` runs first on every rank (the finite check).
    Every rank must call this, in the same order (it may create a process group)."""
    if getattr(checkpointer, "_apiary_atomic", False):
        return
    import torch.distributed as dist
    from torchtitan.components.checkpoint import AsyncMode

    group = _cpu_group()
    original = checkpointer.dcp_save

    def barrier():
        if group is not None:
            dist.barrier(group=group)

    def dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if before_save is not None:
            before_save()
        m = STEP_RE.fullmatch(Path(checkpoint_id).name)
        if async_mode != AsyncMode.DISABLED or m is None:  # apiary saves synchronously to step-N
            return original(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step, final = int(m.group(1)), Path(checkpoint_id)
        tmp = final.parent / f"{PARTIAL}{step}"
        rank = dist.get_rank() if group is not None else 0
        world = dist.get_world_size() if group is not None else 1
        if rank == 0:
            for stale in final.parent.glob(f"{PARTIAL}*"):  # saves killed midway: never visible, now gone
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        t0 = time.perf_counter()
        result = original(state_dict, str(tmp), async_mode, enable_garbage_collection, to_hf)
        barrier()
        t1 = time.perf_counter()
        files = list_files(tmp)
        mine = entries(tmp, files[rank::world])
        if group is not None:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine, group=group)
            mine = {k: v for part in gathered for k, v in part.items()}
        if rank == 0:
            write_manifest(tmp, step, mine, save_s=t1 - t0, hash_s=time.perf_counter() - t1)
            aside = final.parent / f"{PARTIAL}replaced-{step}"
            if final.exists():  # re-saving a step (e.g. after checkpoint.load_step): replace it whole
                os.rename(final, aside)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
            shutil.rmtree(aside, ignore_errors=True)
        barrier()
        return result

    checkpointer.dcp_save = dcp_save
    checkpointer._apiary_atomic = True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- non-finite values ---------------------------------------------------------------------
class NonFiniteStop(SystemExit):
    """Training stopped on a non-finite loss, gradient norm or state: exit code 76. Raised on
    every rank together (the decision is all-reduced); rank 0 prints the paragraph."""

    def __init__(self, message: str):
        super().__init__(EXIT_NONFINITE)
        self.message = message
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)


def last_good(checkpoint_dir: Path) -> str:
    steps = complete_steps(checkpoint_dir)
    return f"step-{steps[-1]} in {checkpoint_dir}" if steps else f"none (no complete step in {checkpoint_dir})"
