"""Kernel caches across launches, and what the first steps spend on kernel autotuning.

A cold start of a long-context job spends minutes of its first step compiling and autotuning
Triton kernels (fla's linear-attention kernels, the fused loss kernels, flex attention through
inductor), every rank on its own. Triton keeps compiled kernels on disk by default but
re-benchmarks every autotuned kernel in every new process; `training.cache_autotuning` keeps
those results on disk too (TRITON_CACHE_AUTOTUNING), so a relaunch of the same shapes skips
the benchmarking. `training.kernel_cache=PATH` puts Triton's and inductor's caches under PATH
(a shared filesystem on a cluster, so every node reuses them; inductor's default lives in the
node's /tmp) and keeps inductor's FX graph cache and AOTAutograd cache on
(TORCHINDUCTOR_FX_GRAPH_CACHE=1, TORCHINDUCTOR_AUTOGRAD_CACHE=1). Variables the user already
exported win. A path that cannot be created or written is not used: a warning, and Triton's and
inductor's defaults.

With the disk cache on, one process per kernel and shapes key tunes while the others wait on a
file lock (fcntl.flock on ``<triton cache>/autotune_locks/<key>.lock``) and then read its result
from the disk cache, so N ranks sharing a cache do not tune the same kernel at once. Triton writes
each entry to a private temporary directory and renames it into place (atomic on POSIX); an entry
that cannot be parsed is re-tuned with a warning.

`AutotuneLog` counts, per logged step, the seconds Triton spent autotuning in this process,
the kernels it tuned and those it read from the disk cache (metrics.jsonl: autotune_s,
autotuned_kernels, autotune_cache_hits).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import MutableMapping

from framework import compat


def configure(kernel_cache: str | None, cache_autotuning: bool,
              env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the cache variables in ``env`` (os.environ) where unset; returns those it set."""
    env = os.environ if env is None else env
    wanted = {}
    if cache_autotuning:
        wanted["TRITON_CACHE_AUTOTUNING"] = "1"
    if kernel_cache:
        root = Path(kernel_cache).expanduser().resolve()
        problem = unusable(root)
        if problem:
            _log.warning("apiary: training.kernel_cache=%s is not used (%s); Triton and inductor keep their "
                         "default caches. Give a writable directory.", kernel_cache, problem)
        else:
            wanted["TRITON_CACHE_DIR"] = str(root / "triton")
            wanted["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
            wanted["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
            wanted["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    added = {k: v for k, v in wanted.items() if k not in env or _torch_wrote_default(k, env)}
    env.update(added)
    if env is os.environ and env.get("TRITON_CACHE_AUTOTUNING") == "1":
        compat.cache_existing_autotuners()  # those defined later read the variable themselves
        install_tune_lock()
    return added


_log = logging.getLogger(__name__)


def _torch_wrote_default(key: str, env) -> bool:
    """torch's inductor writes its default TORCHINDUCTOR_CACHE_DIR into the environment the first
    time it looks it up (importing some of torch while resolving a recipe does): that is not a
    user's export, so the recipe's path replaces it."""
    if key != "TORCHINDUCTOR_CACHE_DIR" or env is not os.environ:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # reason: private torch module, may be absent
    except ImportError:
        return False
    return os.path.abspath(env[key]) == os.path.abspath(default_cache_dir())


def unusable(root: Path) -> str:
    """Why ``root`` cannot hold the caches ('' when it can): created if missing, must be writable."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create it: {e.strerror or e}"
    if not root.is_dir():
        return "it is not a directory"
    if not os.access(root, os.W_OK | os.X_OK):
        return "it is not writable"
    return ""


def cache_dirs(env: MutableMapping[str, str] | None = None) -> dict[str, Path]:
    """The directories Triton and inductor cache into under ``env`` (their defaults when unset)."""
    env = os.environ if env is None else env
    triton = env.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    if not env.get("TORCHINDUCTOR_CACHE_DIR"):
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # reason: private torch module, may be absent

            inductor = default_cache_dir()
        except ImportError:
            pass
    return {"triton": Path(triton), "inductor": Path(inductor)}


def _lock_path(fn_cache_key: str, name: str, tuning_key, configs) -> Path:
    key = "-".join([fn_cache_key, str(tuning_key), *map(str, configs)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_dirs()["triton"] / "autotune_locks" / f"{name[:80]}-{digest}.lock"


@contextlib.contextmanager
def tune_lock(path: Path):
    """Hold an exclusive flock on ``path`` (created); without a lock (warning) where it cannot be made."""
    f = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)  # released by close, or by the kernel when the process dies
        LOG.total_wait_seconds += time.perf_counter() - t0
    except OSError as e:  # unwritable, or a filesystem without flock (some NFS mounts: ENOLCK)
        _log.warning("apiary: no autotuning lock at %s (%s); this process tunes without waiting for others",
                     path, e.strerror or e)
        if f is not None:
            f.close()
        yield False
        return
    try:
        yield True
    finally:
        f.close()


def jit_function(tuner):
    """The @triton.jit function under an autotuner (and any heuristics wrapped around it)."""
    fn = tuner.fn
    while hasattr(fn, "fn") and not hasattr(fn, "cache_key"):
        fn = fn.fn
    return fn


def _locked_check_disk_cache(original):
    def check_disk_cache(self, tuning_key, configs, bench_fn):
        if not tuning_key or any(c.pre_hook for c in configs):  # Triton does not cache these
            return original(self, tuning_key, configs, bench_fn)
        fn = jit_function(self)
        benched = []

        def bench():
            benched.append(True)
            LOG.tuning_now = getattr(fn, "__name__", "kernel")  # the first step's progress line names it
            try:
                bench_fn()
            finally:
                LOG.tuning_now = None

        with tune_lock(_lock_path(str(getattr(fn, "cache_key", "")), getattr(fn, "__name__", "kernel"),
                                  tuning_key, configs)):
            try:
                return original(self, tuning_key, configs, bench)
            except (ValueError, KeyError, TypeError) as e:  # an entry that does not parse: tune again
                if benched:
                    raise
                _log.warning("apiary: unreadable autotuning cache entry for %s (%s: %s); tuning it again",
                             getattr(fn, "__name__", "kernel"), type(e).__name__, e)
                bench_fn()
                return False

    return check_disk_cache


def install_tune_lock() -> bool:
    """Wrap Triton's Autotuner.check_disk_cache (once) in the per-kernel file lock."""
    return compat.lock_autotune_disk_cache(_locked_check_disk_cache)


class AutotuneLog:
    """Triton autotuning in this process since the last ``take()``."""

    def __init__(self):
        self.seconds, self.tuned, self.cache_hits = 0.0, 0, 0
        self.total_seconds, self.total_tuned = 0.0, 0  # since the process started (never reset)
        self.total_wait_seconds = 0.0  # waiting on another process's tuning of the same kernel (tune_lock)
        self.by_kernel: dict[str, float] = {}  # kernel name -> seconds tuning it (all keys) since the process started
        self.tuning_now: str | None = None  # the kernel being tuned at this moment (where results are cached)

    def __call__(self, *, fn, key, best_config, configs_timings, duration, cache_hit, **_):
        if cache_hit:
            self.cache_hits += 1
        else:
            self.tuned += 1
            self.seconds += duration or 0.0
            self.total_tuned += 1
            self.total_seconds += duration or 0.0
            name = getattr(fn, "__name__", "kernel")
            self.by_kernel[name] = self.by_kernel.get(name, 0.0) + (duration or 0.0)

    def take(self) -> dict:
        rec = {"autotune_s": round(self.seconds, 3), "autotuned_kernels": self.tuned,
               "autotune_cache_hits": self.cache_hits}
        self.seconds, self.tuned, self.cache_hits = 0.0, 0, 0
        return rec

    def install(self) -> bool:
        """Become Triton's autotuning listener; False where Triton is absent or has no hook."""
        return compat.set_autotuning_listener(self)


LOG = AutotuneLog()
