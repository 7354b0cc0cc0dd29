"""This process made ready to train, before torchtitan is imported: the device shims and the
allocator's default (framework/devices.py), the kernel caches and the autotune table
(framework/train/kernel_cache.py, autotune_table.py), the preemption signals (framework/train/preempt/),
a one-rank world when no launcher started it, and the CPU threads of each rank.

    prepare(cfg)

framework/train/run.py ``train`` calls it first; the order is the one each step needs (the shims before
torchtitan, the allocator's default before the first CUDA allocation, the signals before anything
worth saving)."""

from __future__ import annotations

import os
import socket

import torch

from framework import devices
from framework.train import autotune_table, kernel_cache, preempt


def single_process_env() -> None:
    """One process without torchrun: give torch.distributed a one-rank world."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def prepare(cfg) -> None:
    """Everything this process sets up before the trainer's config is built, for the run ``cfg``."""
    devices.install()
    devices.apply_allocator_default()  # before this rank's first CUDA allocation (framework.alloc_conf)
    kernel_cache.configure(cfg.training.kernel_cache, cfg.training.cache_autotuning)
    kernel_cache.LOG.install()  # metrics.jsonl: autotune_s, autotuned_kernels, autotune_cache_hits
    autotune_table.install(cfg.training.autotune_configs)  # recorded: tune this GPU's known winners only
    preempt.arm()  # SIGUSR1/SIGTERM/SIGINT/SIGHUP: checkpoint at the next step boundary, exit 75 (requeue)
    single_process_env()
    if not devices.has_accelerator():  # the CPU's cores shared among this host's ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
