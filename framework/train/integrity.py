"""Checkpoint integrity: atomic saves with a manifest, verified before resuming.

A save of step N (framework/train/atomic_save.py) is written into ``checkpoint/.partial-N`` (a name torchtitan's and apiary's
``step-N`` scans never match). Then every rank hashes its share of the files written there in a
background thread while training goes on, and global rank 0 merges the sizes and checksums into
``manifest.json`` (written last inside the folder) and renames the folder to
``checkpoint/step-N`` at the next step boundary after every rank's share arrived (at the latest
when the trainer closes). A save killed midway therefore leaves only ``.partial-N`` behind:
invisible to resume, removed by the next save. Before a resume the
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
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

from framework.errors import EXIT_NONFINITE, UserError
from framework.launch import lifecycle

MANIFEST = "manifest.json"
PARTIAL = ".partial-"  # no "step-" in it: torchtitan's re.search(r"step-(\d+)") must not see it
STEP_RE = re.compile(r"step-(\d+)")
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
        crc = 0
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
        return f"{crc:08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative, sorted), the manifest (and its per-rank parts) excepted."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and not p.name.startswith(MANIFEST))


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


def write_manifest(folder: Path, step: int, files: dict, model_only: bool = False, **timing) -> None:
    """``model_only``: the save holds the model's weights only (checkpoint.model_only_last's last step), no
    optimizer, data position or step count: a resume cannot go on from it. Written either way (a manifest
    without it is an older apiary's, judged by its .metadata)."""
    body = {"format": 1, "step": step, "algorithm": ALGORITHM, "files": files, "model_only": bool(model_only),
            **{k: round(v, 6) for k, v in timing.items()}}
    tmp = Path(folder) / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(folder) / MANIFEST)


# -- the step folders ----------------------------------------------------------------------
def step_like(checkpoint_dir: Path) -> list[Path]:
    """Entries of ``checkpoint_dir`` not named exactly step-N whose name holds step-N: torchtitan's
    loader takes any such name for that step (a folder renamed step-3.bad in place is still step 3)."""
    ck = Path(checkpoint_dir)
    return sorted(p for p in (ck.iterdir() if ck.is_dir() else []) if STEP_RE.search(p.name)
                  and not STEP_RE.fullmatch(p.name))


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


def is_model_only(step_dir: Path) -> bool:
    """A step saved with the model's weights only (checkpoint.model_only_last=true's last save): its manifest
    says so; a manifest of an apiary before that flag: DCP's .metadata names no ``train_state`` (every full
    save holds the step count under that key). Step 0 (a seed checkpoint) is the model only by design."""
    step_dir = Path(step_dir)
    try:
        body = json.loads((step_dir / MANIFEST).read_text())
        if "model_only" in body:
            return bool(body["model_only"])
    except (OSError, ValueError, AttributeError):
        pass
    meta = step_dir / ".metadata"
    try:
        return meta.stat().st_size < (64 << 20) and b"train_state" not in meta.read_bytes()
    except OSError:
        return False


def full_steps(checkpoint_dir: Path) -> list[int]:
    """The complete steps a resume can go on from: all but those holding the model only (step 0 stays: a
    seed checkpoint, loaded as the model only)."""
    return [n for n, p in step_dirs(checkpoint_dir).items() if is_complete(p) and (n == 0 or not is_model_only(p))]


def prune(checkpoint_dir: Path, landed: int, keep: int) -> list[int]:
    """After step ``landed`` became a complete ``step-N`` (global rank 0): delete the oldest complete steps
    below it so that ``keep`` complete steps remain, ``landed`` among them (0: keep all). Steps above
    ``landed`` (an earlier launch's, which this run re-saves as it reaches them) and folders not complete
    are left alone. Each is first renamed out of the ``step-N`` names (a deletion cut short never leaves a
    step that looks complete). Returns the steps deleted."""
    if keep <= 0:
        return []
    ck = Path(checkpoint_dir)
    older = [n for n in complete_steps(ck) if n < landed]
    gone = older[:max(0, len(older) - (keep - 1))]
    for n in gone:
        aside = ck / f"{PARTIAL}pruned-{n}"  # a .partial-* name: the next save removes what is left of it
        try:
            os.rename(ck / f"step-{n}", aside)
        except OSError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    return gone


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
        return MANIFEST, "is not readable JSON of apiary's format (the manifest itself)"
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


# how to go on from an earlier step ({n}; {step_dir}: the refused one), per command
RESUME_PICK = ("Resume from the previous complete step with checkpoint.load_step={n} (it is verified the same way), "
               "or move {step_dir} out of its checkpoint folder")


def corrupt_error(step_dir: Path, problem: tuple[str, str], previous: int | None, where: str,
                  pick: str = RESUME_PICK, fresh: str = "start a fresh run"):
    step_dir = Path(step_dir)
    n = STEP_RE.fullmatch(step_dir.name).group(1)
    fix = (f"{pick.format(n=previous, step_dir=step_dir)}." if previous is not None
           else f"No earlier complete step exists: move {step_dir} out of its checkpoint folder and {fresh}.")
    return UserError(where, f"checkpoint step {n} is corrupt: {step_dir / problem[0]} {problem[1]}; "
                            "loading it could train on damaged weights.", fix)


def unverifiable_error(step_dir: Path, previous: int | None, where: str, pick: str = RESUME_PICK,
                       override: str = "checkpoint.verify=false") -> UserError:
    """A complete step folder without a manifest: apiary writes one into every step it saves, so a step
    without one lost it afterwards (or was written before manifests existed); nothing proves it intact.
    ``previous``: the latest earlier step that has a manifest (None: none)."""
    step_dir = Path(step_dir)
    fix = (f"{pick.format(n=previous, step_dir=step_dir)}; or, if you know {step_dir.name} is intact, load it "
           f"unverified with {override}." if previous is not None else
           f"No earlier step has a manifest either; if you know {step_dir.name} is intact, load it unverified "
           f"with {override}.")
    return UserError(where, f"checkpoint {step_dir} has no {MANIFEST}, so it cannot be verified: every step "
                     "apiary saves gets one as it completes, and a step without one lost it afterwards (or was "
                     "written by a version before manifests); loading it could use damaged weights unnoticed.", fix)


def manifest_step(step_dir: Path) -> int | None:
    """The step a folder's manifest says it holds (None: no readable manifest, or no step in it)."""
    try:
        step = json.loads((Path(step_dir) / MANIFEST).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def latest_with_manifest(checkpoint_dir: Path, before: int) -> int | None:
    """The latest complete step below ``before`` that has a manifest (None: none)."""
    ok = [n for n, p in step_dirs(checkpoint_dir).items() if n < before and (p / MANIFEST).is_file()]
    return ok[-1] if ok else None


def check_step(step_dir: Path, where: str, *, unverified_ok: bool = False, pick: str = RESUME_PICK,
               override: str = "checkpoint.verify=false", fresh: str = "start a fresh run") -> None:
    """A step about to be read (resume, export, log-probs) matches its manifest; UserError (exit 2)
    naming the step and the way out when it does not, or when it has none (unless ``unverified_ok``)."""
    step_dir = Path(step_dir)
    n = int(STEP_RE.fullmatch(step_dir.name).group(1))
    if not (step_dir / MANIFEST).is_file():
        if unverified_ok:
            return
        raise unverifiable_error(step_dir, latest_with_manifest(step_dir.parent, n), where, pick, override)
    saved = manifest_step(step_dir)
    if saved is not None and saved != n:  # another step's folder copied or renamed onto this name
        earlier = [s for s in complete_steps(step_dir.parent) if s < n and manifest_step(step_dir.parent /
                                                                                        f"step-{s}") in (s, None)]
        fix = (f"{pick.format(n=earlier[-1], step_dir=step_dir)}." if earlier
               else f"No earlier complete step exists: move {step_dir} out of its checkpoint folder and {fresh}.")
        raise UserError(where, f"{step_dir} holds the checkpoint of step {saved}, not step {n} (its {MANIFEST} "
                        f"says step {saved}): the folder was copied or renamed from step-{saved}. Loading it would "
                        f"train on from step {saved}'s weights, optimizer and data position while counting from "
                        f"step {n + 1}.", f"{fix} Nothing on disk was changed.")
    problem = verify(step_dir)
    if problem is not None:
        earlier = [s for s in complete_steps(step_dir.parent) if s < n]
        raise corrupt_error(step_dir, problem, earlier[-1] if earlier else None, where, pick, fresh)


def adapter_run(step_dir) -> tuple[str, Path] | None:
    """(the adapter, the run folder) when ``step_dir`` (RUN/checkpoint/step-N) is a step of a run trained with an
    adapter (its run folder's config.yaml names one: adapter.name): its model state is the adapters (saved whole,
    with the frozen base under the adapter's module names), which no new run loads as a model. Else None."""
    step_dir = Path(step_dir).resolve()
    config = step_dir.parent.parent / "config.yaml"
    if step_dir.parent.name != "checkpoint" or not config.is_file():
        return None
    try:
        name = OmegaConf.select(OmegaConf.load(config), "adapter.name", default="none")
    except Exception:  # noqa: BLE001  (an unreadable config: nothing known)
        return None
    return (str(name), step_dir.parent.parent) if name not in (None, "none") else None


def seeded_base(run) -> str | None:
    """Why no merged export of adapter run ``run`` exists, or None: its adapters were trained on weights
    initialised from training.seed (no model.hf_checkpoint, no checkpoint.load_path), a base that exists on no
    disk, which ``apiary export`` refuses (the wording is its refusal's)."""
    try:
        cfg = OmegaConf.load(Path(run) / "config.yaml")
    except Exception:  # noqa: BLE001  (an unreadable config: nothing known)
        return None
    if OmegaConf.select(cfg, "model.hf_checkpoint") or OmegaConf.select(cfg, "checkpoint.load_path"):
        return None
    return (f"the adapters were trained on weights initialised from training.seed={OmegaConf.select(cfg, 'training.seed')}"
            f" ({OmegaConf.select(cfg, 'model.family')} {OmegaConf.select(cfg, 'model.flavor')}), a base that exists on "
            "no disk, so apiary export refuses them (no merged folder to start a new run from)")


def merged_hint(step_dir, resume: bool = True) -> str:
    """What to write instead of checkpoint.load_path=STEP for an adapter run's step (``adapter_run``): its
    adapters folded into the base as an HF folder, the base of a new run; for adapters on a seeded base
    (``seeded_base``), which no export folds, what works instead (``resume``: with their run's resume among it)."""
    step_dir = Path(step_dir)
    run, step = adapter_run(step_dir)[1], step_dir.name.removeprefix("step-")
    if (why := seeded_base(run)) is not None:
        return (f"No new run can start from these adapters: {why}. "
                + (f"To train these adapters on, resume their run (output_dir={run} checkpoint.resume=true); to "
                   if resume else "To ") + "carry adapters into a new run, train them on a base folder "
                "(model.hf_checkpoint=DIR) or a saved step (checkpoint.load_path=...).")
    out = run / f"merged-step-{step}"
    return (f"Export the adapters merged into their base, apiary export {run} --hf {out} --merged --step {step}, "
            f"and start a new run from that folder with model.hf_checkpoint={out} (no checkpoint.load_path).")


def check_resume(run_dir: Path, load_step: int | None, where: str, verify_manifest: bool = True) -> int:
    """The step a resume of ``run_dir`` will load (``load_step`` or the latest complete one),
    verified against its manifest; raises UserError (exit 2) when it is missing or corrupt, or
    has no manifest to verify against (unless ``verify_manifest`` is False: checkpoint.verify=false)."""
    ck = Path(run_dir) / "checkpoint"
    dirs = step_dirs(ck)
    steps = [n for n, p in dirs.items() if is_complete(p)]
    if not dirs:
        raise UserError(where, f"{run_dir} holds no checkpoint (checkpoint/step-N).",
                        "Check output_dir, or start a fresh run without checkpoint.resume.")
    latest = max(dirs)
    if load_step is None and latest not in steps:  # not apiary's atomic save: an older version's, cut short
        earlier = [s for s in steps if s < latest]
        raise UserError(where, f"the latest checkpoint {dirs[latest]} is incomplete or corrupt (no .metadata, no "
                        f"{MANIFEST}).", (f"Resume from step {earlier[-1]} with checkpoint.load_step={earlier[-1]}, "
                                          "or move it out of the checkpoint folder." if earlier else
                                          "Move it out of the checkpoint folder and start a fresh run."))
    if load_step is not None and load_step not in steps:
        raise UserError(f"checkpoint.load_step={load_step}", f"{ck} has no complete step {load_step}; complete "
                        f"steps: {', '.join(map(str, steps))}.", "Pick one of them.")
    full = full_steps(ck)
    if load_step is None and steps[-1] not in full and any(0 < s < steps[-1] for s in full):
        step = max(s for s in full if s < steps[-1])  # the last save held the model only: the last full one
    else:
        step = load_step if load_step is not None else steps[-1]
    if step not in full:  # checkpoint.model_only_last=true's last save: no optimizer, data position, step count
        raise UserError(f"checkpoint.load_step={load_step}" if load_step is not None else where,
                        f"{dirs[step]} holds the model's weights only (checkpoint.model_only_last=true saves the "
                        "last step so), without the optimizer state, data position and step count a resume goes "
                        "on from.", (f"Resume from the last full step with checkpoint.load_step={full[-1]}; or "
                                     if full and full[-1] > 0 else "No full step exists to resume from; ")
                        + (f"to start a new run from these weights: {merged_hint(dirs[step], False)}" if adapter_run(dirs[step])
                           else f"start a new run from these weights with checkpoint.load_path={dirs[step]}."))
    step_dir = ck / f"step-{step}"
    key = str(step_dir.resolve())
    # under torchrun without apiary's launcher, global rank 0 checks for all (its exit 2 ends the others)
    if os.environ.get(VERIFIED_ENV) != key and os.environ.get("RANK", "0") == "0":
        check_step(step_dir, where, unverified_ok=not verify_manifest)
        os.environ[VERIFIED_ENV] = key  # the workers this process starts need not hash it again
    return step


# -- non-finite values ---------------------------------------------------------------------
class NonFiniteStop(SystemExit):
    """Training stopped on a non-finite loss, gradient norm or state: exit code 76. Raised on
    every rank together (the decision is all-reduced); rank 0 prints the paragraph."""

    def __init__(self, message: str):
        super().__init__(EXIT_NONFINITE)
        self.message = message
        lifecycle.write_status(EXIT_NONFINITE)  # the supervising `train` parent exits with it too
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)


def restart_hint(checkpoint_dir: Path, resume_hint: str, nonfinite: set | frozenset = frozenset()) -> str:
    """Where a run stopped on a non-finite step goes on from: its newest complete step, unless the step after it
    (computed from its weights) was non-finite (``nonfinite``: this process's such steps, skipped or stopped);
    then the newest step before such ones, or the start (was: "Last good" for weights that gave NaN at once)."""
    steps, again = complete_steps(checkpoint_dir), resume_hint or "checkpoint.resume=true"
    if not steps:
        return "No step was checkpointed before this one, so there is nothing to resume: run it again from the start"
    good = [s for s in steps if s + 1 not in nonfinite]
    if good and good[-1] == steps[-1]:
        return f"Last good checkpoint: step-{steps[-1]} in {checkpoint_dir}. Resume from it with {again}"
    said = (f"No good checkpoint to name: step {steps[-1] + 1}, computed from the weights of the newest, step-{steps[-1]} "
            f"in {checkpoint_dir}, was not finite, so they may be damaged (a resume from it stops at once if they are)")
    if not good:
        return f"{said}; none was saved before that: run it again from the start (a new output_dir)"
    pick = f"{again.rstrip('`')} checkpoint.load_step={good[-1]}" + ("`" if again.endswith("`") else "")
    return f"{said}. The last one saved before: step-{good[-1]}. Resume from it with {pick}"
