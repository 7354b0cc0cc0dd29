"""The patches of Triton's autotuner (Triton 3.8.0): recorded configs, the disk cache's lock, the
autotuning listener.
"""

from __future__ import annotations

import gc
import sys
import warnings

from framework.compat.originals import _keep_original


def _autotuner():
    try:
        from triton.runtime.autotuner import Autotuner  # reason: optional dependency: triton
    except ImportError:
        return None
    return Autotuner


def prune_autotune_configs(wrap) -> bool:
    """Triton 3.8.0. ``Autotuner.prune_configs(self, kwargs)`` picks the configs an autotuned kernel
    benchmarks; replace it (once) by ``wrap(original)`` (the recorded-winners table of
    training.autotune_configs). False where Triton is absent."""
    Autotuner = _autotuner()
    if Autotuner is None:
        return False
    _wrap_autotuner_once(Autotuner, "prune_configs", wrap, "apiary_table")
    return True


def lock_autotune_disk_cache(wrap) -> bool:
    """Triton 3.8.0. ``Autotuner.check_disk_cache(self, tuning_key, configs, bench_fn)`` reads a tuning
    from the disk cache or benchmarks and writes it; replace it (once) by ``wrap(original)`` (the
    per-kernel file lock of training.kernel_cache, so that ranks sharing a cache tune a kernel
    once). False where Triton is absent or has no disk cache."""
    Autotuner = _autotuner()
    if Autotuner is None or not hasattr(Autotuner, "check_disk_cache"):
        return False
    _wrap_autotuner_once(Autotuner, "check_disk_cache", wrap, "apiary_tune_lock")
    return True


def _wrap_autotuner_once(Autotuner, name: str, wrap, marker: str) -> None:
    """Replace ``Autotuner.<name>`` by ``wrap(original)``, marked with ``marker`` so it happens once;
    the original is kept for ``original()``."""
    current = getattr(Autotuner, name)
    if getattr(current, marker, False):
        return
    _keep_original(f"triton.runtime.autotuner:Autotuner.{name}", current)
    wrapped = wrap(current)
    setattr(wrapped, marker, True)
    setattr(Autotuner, name, wrapped)


def set_autotuning_listener(listener) -> bool:
    """Triton 3.8.0. ``triton.knobs.autotuning.listener`` is called after every autotuning (and
    cache hit); set it to ``listener``. False where Triton is absent or has no such knob."""
    try:
        from triton import knobs  # reason: optional dependency: triton
    except ImportError:
        return False
    if not hasattr(knobs, "autotuning") or not hasattr(knobs.autotuning, "listener"):
        return False
    knobs.autotuning.listener = listener
    return True


def cache_existing_autotuners() -> int:
    """Triton 3.8.0. An ``Autotuner`` reads TRITON_CACHE_AUTOTUNING into its ``cache_results``
    attribute when it is constructed, i.e. when the autotuned kernel's module is imported (resolving
    a recipe already imports fla's). Turn the disk cache on for the autotuners that exist now, as
    Triton's own constructor decides; returns how many."""
    if "triton" not in sys.modules:
        return 0
    from triton import knobs  # reason: optional dependency: triton
    from triton.runtime.autotuner import Autotuner  # reason: optional dependency: triton

    with warnings.catch_warnings():  # isinstance on torch's deprecated module proxies warns
        warnings.simplefilter("ignore")
        tuners = [o for o in gc.get_objects() if isinstance(o, Autotuner)]
    for t in tuners:
        t.cache_results = not knobs.runtime.interpret  # as Triton's own constructor decides
    return len(tuners)
