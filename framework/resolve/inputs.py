"""The environment variables apiary reads, the paths a recipe names and the inputs a run loads:
checked before any worker starts, each failure a UserError.

    check(cfg, for_training, world_size) -> the world size

runs them in that order and says how many ranks the run is laid out for.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from framework.compose import registry
from framework.errors import UserError
from framework.resolve import disk
from framework.train import integrity


def world_size_env() -> int | None:
    """WORLD_SIZE as a launcher (torchrun) sets it for the ranks it starts; None when unset. A value that is
    no rank count, or a launcher's variables left in a shell without the launcher, stop here: the run would
    be laid out for ranks that never come and wait for them."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return None
    n = int(raw) if raw.strip().isdigit() else 0
    if n < 1:
        raise UserError(f"WORLD_SIZE={raw}", "(an environment variable) must be a whole number >= 1: the number of "
                        "ranks the launcher (torchrun) started.", "Unset it (`unset WORLD_SIZE`) and choose the "
                        "ranks with nproc=N, or start them with torchrun (docs/launching.md).")
    if n > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        if "RANK" not in os.environ:
            raise UserError(f"WORLD_SIZE={raw}", f"is set in the environment without RANK, so no launcher started "
                            f"this process as one of {n} ranks: the variable is left over (a torchrun or batch "
                            f"shell, an export); the run would be laid out for {n} ranks and wait for the others.",
                            "Unset it (`unset WORLD_SIZE`); nproc=N starts N ranks here (docs/launching.md).")
        if not os.environ.get("MASTER_PORT"):  # (MASTER_ADDR defaults to this host: framework/train/run.py)
            raise UserError(f"RANK={os.environ['RANK']} WORLD_SIZE={raw}", f"make this process one of {n} ranks, "
                            "but MASTER_PORT is not set, so it cannot meet the others: a launcher's variables left "
                            "in this shell?", "Unset RANK and WORLD_SIZE and start the ranks with nproc=N or "
                            "torchrun; a launcher of your own sets MASTER_ADDR and MASTER_PORT for every rank.")
    return n


def check_environment() -> None:
    """The environment variables apiary reads, before anything else: APIARY_DEVICE, WORLD_SIZE."""
    device = os.environ.get("APIARY_DEVICE", "")
    if device not in ("", "cpu"):
        raise UserError(f"APIARY_DEVICE={device}", "(an environment variable) is unknown; apiary reads one value, "
                        "APIARY_DEVICE=cpu (run on the CPU even where a GPU is visible). Any other value would be "
                        "ignored.", "Unset it (`unset APIARY_DEVICE`) to use the GPU when there is one, or set "
                        "APIARY_DEVICE=cpu.")
    world_size_env()


def world_size_from(cfg, for_training: bool = True) -> int:
    """The real world size when launching; the recipe's intended GPU count when only printing."""
    env = world_size_env()
    if env is not None:
        return env
    launched = int(registry.resolve("launcher", cfg.launcher.name).world_size(cfg.launcher))
    if not for_training and launched == 1 and cfg.parallel.gpus is not None:
        return int(cfg.parallel.gpus)
    return launched


def what_is(path: Path) -> str:
    """What a path that is not a folder is, for a message: "an existing file", "a character device"
    (/dev/null), ..."""
    mode = path.stat().st_mode
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "an existing file"


def writable_folder(path, key: str, what: str) -> None:
    """``path`` (or its nearest existing parent) is a folder this process can write, on a disk that is
    not full; else a UserError naming ``key``. ``what`` says what could not be written. The probe (a
    temporary folder holding one small file, removed at once) leaves nothing behind: os.access alone
    says yes to root on a read-only mount, and a folder alone can be made on a full tmpfs. The tools'
    output folders (`apiary logprobs --out`, `apiary export --hf`) are checked here too."""
    _check_name_lengths(key, str(path))
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(key, f"{probe} is {what_is(probe)}, not a folder, so no folder can be made there.",
                        f"Choose another {key.split('=')[0]} (a new or empty folder).")
    try:
        writable = os.access(probe, os.W_OK | os.X_OK)
        if writable:
            with tempfile.TemporaryDirectory(dir=probe, prefix=".apiary-probe-") as d:
                (Path(d) / "probe").write_bytes(b"apiary" * 512)
    except OSError as e:
        if e.errno in disk.FULL_ERRNOS:
            raise disk.full_at_launch(key, probe, what, e) from None
        writable = False
    if not writable:
        raise UserError(key, f"{probe} is not writable by this user, so {what}.",
                        f"Choose a writable {key.split('=')[0]}, or fix the folder's permissions.")
    disk.check_room(probe, key, what)


# Keys naming a file or folder (null: off or the default), with what null means. A `~` at the start is
# this user's home folder (the shell leaves `key=~/x` as it is); an empty value names nothing.
_PATH_KEYS = {
    "model.hf_checkpoint": "the flavor's architecture, initialised from training.seed",
    "data.path": "data.name's source",
    "data.tokenizer": "the byte-level tokenizer",
    "validation.path": "no held-out files",
    "publish.dir": "OUTPUT_DIR/weights",
    "checkpoint.load_path": "start from initialised weights",
    "training.kernel_cache": "Triton's and inductor's own caches",
}


NAME_MAX, PATH_MAX = 255, 4096  # bytes: a file name, a whole path (Linux; the OS refuses longer with ENAMETOOLONG)


def _check_name_lengths(key: str, value: str) -> None:
    """A path whose file name or whole length the OS refuses: one paragraph, not an OSError traceback."""
    long = [part for part in Path(value).parts if len(part.encode()) > NAME_MAX]
    if long:
        raise UserError(f"{key}={value[:60]}...", f"names a file or folder of {len(long[0].encode())} bytes "
                        f"({long[0][:40]}...); the file system takes at most {NAME_MAX} bytes per name.",
                        f"Use a shorter name (or nest folders: a/b/c) for {key}.")
    if len(value.encode()) >= PATH_MAX:
        raise UserError(f"{key}={value[:60]}...", f"is {len(value.encode())} bytes long; the OS takes paths of "
                        f"fewer than {PATH_MAX} bytes.", f"Use a shorter path for {key}.")


def check_paths(cfg) -> None:
    """An empty path, or an empty data.name, is refused (it named the current folder, or fell back to
    a default, silently); ``~/...`` is expanded (what the training processes read too)."""
    for key, null_means in _PATH_KEYS.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if not str(value).strip():
            default = "byte" if key == "data.tokenizer" else "null"
            raise UserError(f"{key}=", "is empty: it names no file or folder.",
                            f"Give a path, or {key}={default} ({null_means}).")
        if str(value).startswith("~"):
            OmegaConf.update(cfg, key, os.path.expanduser(str(value)))
    for key in ("output_dir", *_PATH_KEYS):
        value = OmegaConf.select(cfg, key)
        if value is not None:
            _check_name_lengths(key, str(value))
    if not str(cfg.data.name).strip():
        raise UserError("data.name=", "is empty: it names no source of text.", "Use data.name=packaged (the packaged "
                        "corpus), data.name=local with data.path=PATH, or a HuggingFace dataset name.")


# the values wandb's Settings.mode accepts (wandb 0.31); another one fails to create the logger in the
# worker, and the run trained on without it
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")


def check_inputs(cfg, for_training: bool) -> None:
    mode = os.environ.get("WANDB_MODE")
    if cfg.logging.wandb and mode is not None and mode not in WANDB_MODES:
        known = ", ".join(WANDB_MODES)
        raise UserError(f"WANDB_MODE={mode}", f"(an environment variable) is not a mode wandb knows ({known}): "
                        "logging.wandb=true would fail to create its logger and the run would train unlogged.",
                        "Set WANDB_MODE=online, offline or disabled, or unset it (without WANDB_API_KEY apiary "
                        "logs offline).")
    if cfg.training.dtype not in ("bfloat16", "float32"):
        raise UserError(f"training.dtype={cfg.training.dtype}", "must be bfloat16 or float32.")
    if cfg.training.on_nonfinite not in ("stop", "skip"):
        raise UserError(f"training.on_nonfinite={cfg.training.on_nonfinite}", "must be stop or skip.",
                        "stop: exit 76 at the first NaN/Inf loss or grad norm; skip: skip that update "
                        "(at most training.max_skips in a row).")
    if cfg.training.max_skips < 0:
        raise UserError(f"training.max_skips={cfg.training.max_skips}", "must be >= 0 (0: the first "
                        "non-finite step stops the run, as on_nonfinite=stop).")
    if not for_training:
        return
    ck = cfg.checkpoint
    if ck.create_seed and (world_size_from(cfg) != 1 or not ck.enable):
        raise UserError("checkpoint.create_seed=true", "a seed checkpoint is written by one process with "
                        "checkpointing enabled.", "Run it without nproc/torchrun and with checkpoint.enable=true.")
    if ck.load_path is not None and not Path(ck.load_path).exists():
        raise UserError(f"checkpoint.load_path={ck.load_path}", "does not exist (nothing at that path).",
                        "Point it at a step folder, e.g. runs/X/checkpoint/step-0.")
    if ck.load_path is not None and not (Path(ck.load_path) / ".metadata").is_file():
        steps = integrity.complete_steps(Path(ck.load_path) / "checkpoint")  # a run's folder: name its latest step
        at = Path(ck.load_path) / "checkpoint" / f"step-{steps[-1]}" if steps else "runs/X/checkpoint/step-0"
        raise UserError(f"checkpoint.load_path={ck.load_path}", "is not a DCP checkpoint folder (no .metadata)"
                        + (", but a run's folder" if steps else "") + ".", f"Point it at a step folder, e.g. {at}.")
    if ck.load_path is not None:
        if (adapted := integrity.adapter_run(ck.load_path)) is not None:
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"is a step of {adapted[1]}, a run trained with "
                            f"adapter={adapted[0]}: its model state holds the adapters (with the frozen base under the "
                            "adapter's names), not a model a run loads.", integrity.merged_hint(ck.load_path))
        if ck.verify and not (Path(ck.load_path) / integrity.MANIFEST).is_file():
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"has no {integrity.MANIFEST}, so it cannot be "
                            "verified: every step apiary saves (a seed checkpoint too) gets one as it completes; a "
                            "step without one lost it afterwards, or was written by another program or a version "
                            "before manifests.", "Point it at an intact apiary step folder; or, if you know this one "
                            "is intact, load it unverified with checkpoint.verify=false.")
        problem = integrity.verify(Path(ck.load_path))
        if problem is not None:
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"{Path(ck.load_path) / problem[0]} "
                            f"{problem[1]}: the checkpoint is corrupt.", "Point it at an intact step folder.")


def check(cfg, for_training: bool, world_size=None) -> int:
    """The environment, the paths (``~`` expanded), the inputs; returns the ranks to lay the run out for:
    ``world_size`` (an int, or a function of the config: the launcher's, its options checked), or with None
    the environment's or the launcher's (``world_size_from``)."""
    check_environment()
    check_paths(cfg)
    check_inputs(cfg, for_training)
    if world_size is None:
        return world_size_from(cfg, for_training)
    return int(world_size(cfg)) if callable(world_size) else world_size
