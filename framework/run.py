"""Worker side: build the torchtitan Trainer from a resolved recipe and train."""

from __future__ import annotations

import json
import logging
import os
import socket
import warnings
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from framework import autotune_table, contracts, devices, first_step, kernel_cache, lifecycle, preempt


def _single_process_env() -> None:
    """One process without torchrun: give torch.distributed a one-rank world."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def launch_env(resolved) -> contracts.LaunchEnv:
    """What a launcher component needs of the framework to start ``resolved``'s ranks."""
    return contracts.LaunchEnv(resolved=resolved, supervise=lifecycle.supervise)


def write_run_files(resolved) -> None:
    out = Path(resolved.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(resolved.cfg))
    (out / "layout.json").write_text(json.dumps({"dims": resolved.layout.dims, "rules": resolved.layout.rules},
                                                indent=2))


def train(resolved, verbose: bool = False) -> dict | None:
    """Train; returns the last metrics record on rank 0."""
    devices.install()
    kernel_cache.configure(resolved.cfg.training.kernel_cache, resolved.cfg.training.cache_autotuning)
    kernel_cache.LOG.install()  # metrics.jsonl: autotune_s, autotuned_kernels, autotune_cache_hits
    autotune_table.install(resolved.cfg.training.autotune_configs)  # recorded: tune this GPU's known winners only
    preempt.arm()  # SIGUSR1/SIGTERM/SIGINT: checkpoint at the next step boundary, exit 75 (requeue)
    _single_process_env()
    rank = int(os.environ["RANK"])
    if rank == 0:
        if getattr(resolved, "data_summary", ""):
            print(resolved.data_summary, flush=True)  # the run's first line: what it trains on
        write_run_files(resolved)
        if getattr(resolved.facts, "source", ""):  # which checkpoint and architecture this run loads
            Console(highlight=False, soft_wrap=True).print(f"model: {resolved.facts.source}", markup=False)
    import torch  # reason: below, with torchtitan (slow to import; only workers train)
    from torchtitan.tools.logging import init_logger  # reason: as above

    from framework.build import trainer_config  # reason: as above

    init_logger()
    for msg in ("In CPU autocast", "DTensor random operators", "'set_vital' is deprecated",
                "initial_load_model_only=True has no effect"):
        warnings.filterwarnings("ignore", message=msg)
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
    if not devices.has_accelerator():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    tc = trainer_config(resolved)
    trainer = guard = None
    first_step.STATE.begin()  # metrics.jsonl's first record: first_step_build_s and the step's breakdown
    try:
        trainer = tc.build()
        guard = preempt.install(trainer)
        if resolved.cfg.checkpoint.create_seed:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    preempt.exit_if_stopped(guard)
    follow_stop = getattr(trainer, "_follow_stop", None)  # follow mode stopped waiting: timeout or bad shard
    if follow_stop is not None:
        lifecycle.write_status(follow_stop[0])
        raise SystemExit(follow_stop[0])
    metrics = Path(resolved.cfg.output_dir) / "metrics.jsonl"
    if rank == 0 and metrics.is_file():
        _record_plan(resolved, metrics)
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    return None


def _record_plan(resolved, metrics: Path) -> None:
    """Write the planner's per-GPU estimate next to the measured peak (last record) and print both."""
    from framework.planner import estimate_for_run, merge_into_last_record  # reason: planner is heavy; after the run

    try:
        est = estimate_for_run(resolved)
        merge_into_last_record(metrics, est)
    except Exception as e:  # an estimate must never fail a finished run
        logging.getLogger(__name__).warning("apiary: planner estimate skipped: %s", e)
        return
    if not devices.has_accelerator():  # the estimate is for GPU memory; CPU RSS is not comparable
        return
    last = json.loads(metrics.read_text().splitlines()[-1])
    Console(highlight=False, soft_wrap=True).print(
        f"memory: measured peak {last['peak_mem_bytes'] / 2**30:.2f} GiB ({last['peak_mem_kind']}), "
        f"planned {est['plan_torch_reserved_bytes'] / 2**30:.2f} GiB (torch reserved; "
        f"{est['plan_total_bytes'] / 2**30:.2f} GiB with CUDA context and NCCL)")
