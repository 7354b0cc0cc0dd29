"""Kernel caches across launches, and what the first steps spend on kernel autotuning.

A cold start of a long-context job spends minutes of its first step compiling and autotuning
Triton kernels (fla's GatedDeltaNet kernels, the fused loss kernels, flex attention through
inductor), every rank on its own. Triton keeps compiled kernels on disk by default but
re-benchmarks every autotuned kernel in every new process; `training.cache_autotuning` keeps
those results on disk too (TRITON_CACHE_AUTOTUNING), so a relaunch of the same shapes skips
the benchmarking. `training.kernel_cache=PATH` puts Triton's and inductor's caches under PATH
(a shared filesystem on a cluster, so every node reuses them; inductor's default lives in the
node's /tmp). Variables the user already exported win.

`AutotuneLog` counts, per logged step, the seconds Triton spent autotuning in this process,
the kernels it tuned and those it read from the disk cache (metrics.jsonl: autotune_s,
autotuned_kernels, autotune_cache_hits).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping


def configure(kernel_cache: str | None, cache_autotuning: bool,
              env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the cache variables in ``env`` (os.environ) where unset; returns those it set."""
    env = os.environ if env is None else env
    wanted = {}
    if cache_autotuning:
        wanted["TRITON_CACHE_AUTOTUNING"] = "1"
    if kernel_cache:
        root = Path(kernel_cache).expanduser().resolve()
        wanted["TRITON_CACHE_DIR"] = str(root / "triton")
        wanted["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    added = {k: v for k, v in wanted.items() if k not in env}
    env.update(added)
    if env is os.environ and env.get("TRITON_CACHE_AUTOTUNING") == "1":
        _cache_existing_autotuners()
    return added


def _cache_existing_autotuners() -> int:
    """Triton reads TRITON_CACHE_AUTOTUNING when an autotuned kernel is defined, i.e. when its
    module is imported; resolving a recipe already imports fla's. Turn the disk cache on for the
    autotuners that exist now (those defined later read the variable)."""
    import gc
    import sys
    import warnings

    if "triton" not in sys.modules:
        return 0
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    with warnings.catch_warnings():  # isinstance on torch's deprecated module proxies warns
        warnings.simplefilter("ignore")
        tuners = [o for o in gc.get_objects() if isinstance(o, Autotuner)]
    for t in tuners:
        t.cache_results = not knobs.runtime.interpret  # as Triton's own constructor decides
    return len(tuners)


class AutotuneLog:
    """Triton autotuning in this process since the last ``take()``."""

    def __init__(self):
        self.seconds, self.tuned, self.cache_hits = 0.0, 0, 0

    def __call__(self, *, fn, key, best_config, configs_timings, duration, cache_hit, **_):
        if cache_hit:
            self.cache_hits += 1
        else:
            self.tuned += 1
            self.seconds += duration or 0.0

    def take(self) -> dict:
        rec = {"autotune_s": round(self.seconds, 3), "autotuned_kernels": self.tuned,
               "autotune_cache_hits": self.cache_hits}
        self.seconds, self.tuned, self.cache_hits = 0.0, 0, 0
        return rec

    def install(self) -> bool:
        """Become Triton's autotuning listener; False where Triton is absent or has no hook."""
        try:
            from triton import knobs
        except ImportError:
            return False
        if not hasattr(knobs, "autotuning") or not hasattr(knobs.autotuning, "listener"):
            return False
        knobs.autotuning.listener = self
        return True


LOG = AutotuneLog()
