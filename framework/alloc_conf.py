"""The CUDA caching allocator's settings a rank runs with (torch-free: the planner reads them too).

Every launcher starts its ranks with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the
user's environment already sets ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` (the Slurm
script exports the same default; the local launcher's ranks apply it in ``framework.devices``).
Expandable segments grow one mapping per stream instead of caching fixed-size blocks, so the
reserved peak sits closer to the allocated one when tensor shapes vary (MoE routing, long
sequences); the planner's fragmentation reserve follows the setting (``fragmentation_fraction``
with it, ``fragmentation_fraction_fixed`` without).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT = "expandable_segments:True"
ENV_KEYS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads the first one set


def current(environ: Mapping[str, str] | None = None) -> str:
    """The settings string a rank started from ``environ`` (default: this process's) runs with."""
    env = os.environ if environ is None else environ
    return next((env[k] for k in ENV_KEYS if env.get(k)), DEFAULT)


def expandable(conf: str | None = None) -> bool:
    """Whether ``conf`` (default: ``current()``) turns expandable segments on (torch's default: off)."""
    conf = current() if conf is None else conf
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def set_default(environ: dict | None = None) -> bool:
    """Put ``DEFAULT`` into ``environ`` (default: os.environ) unless the user set either variable;
    True when it was put there."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in ENV_KEYS):
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT
    return True
