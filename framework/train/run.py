"""Worker side: build the torchtitan Trainer from a resolved recipe and train."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import warnings
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from framework.errors import DiskFull
from framework.launch import lifecycle
from framework.report import summary
from framework.report.resume_command import run_overrides
from framework.resolve import disk, resume
from framework.train import disk_full, first_step, integrity, preempt


def train_here(resolved, verbose: bool = False) -> int:
    """One rank in this process (rank 0 of run.train prints the run's summary); a UserError found while
    the model loads (e.g. a NaN in a checkpoint tensor) goes to the launching command."""
    train(resolved, verbose=verbose)
    return 0


def write_run_files(resolved) -> None:
    """Before the trainer is built: the first launch's config.yaml and layout.json (a resume's launch is
    recorded by ``record_launch`` once its trainer is built)."""
    out = Path(resolved.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not resolved.cfg.checkpoint.resume:
        (out / resume.FIRST).write_text(OmegaConf.to_yaml(resolved.cfg))
    derived = resolved.ctx.derived if resolved.ctx is not None else {}
    (out / "layout.json").write_text(json.dumps({"dims": resolved.layout.dims, "rules": resolved.layout.rules,
                                                 **({"derived": derived} if derived else {})}, indent=2))


def record_launch(resolved) -> None:
    """Once the trainer is built (the checkpoint loaded): a resume's config as config.resume-K.yaml, and the
    launch's recipe and overrides in launches.jsonl, which the next resume keeps and compares with
    (framework/resolve/resume.py). A launch that crashed before it trained is not recorded as one."""
    out = Path(resolved.cfg.output_dir)
    if resolved.cfg.checkpoint.resume:
        resume.config_path_for_launch(out).write_text(OmegaConf.to_yaml(resolved.cfg))
    resume.write_launch(out, resolved.launch)


# torchtitan's log lines that say nothing about an apiary run (dropped unless `train -v`): it runs
# lspci to name the GPU, falls back to an A100's peak for its MFU (apiary's is framework.devices'),
# and looks for an HF index in the run folder that a run saving DCP checkpoints never has
QUIET_LOG_LINES = ("Error running lspci", "Peak flops undefined for", "model.safetensors.index.json not found at")
# ... and, with pipeline stages, its note that the loss is only visible on the last stage's rank (in
# color codes): apiary logs that stage's loss on every rank (framework/train/trainer.py)
QUIET_LOG_PARTS = ("Pipeline Parallel loss is not visible",)
# ... and its note that it sets an environment variable, when the value stays the same or replaces
# torchrun's own default (TORCH_NCCL_ASYNC_ERROR_HANDLING=1 -> 3, docs/launching.md); a value a user
# exported that it overrides is still shown
_ENV_OVERRIDE = re.compile(r"ENV\[(\w+)\] = (.*) will be overridden to (.*) based on job config$")
_TORCHRUN_DEFAULTS = {("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


class _QuietLogLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith(QUIET_LOG_LINES) or any(part in msg for part in QUIET_LOG_PARTS):
            return False
        m = _ENV_OVERRIDE.match(msg)
        return not (m and (m.group(2) == m.group(3) or (m.group(1), m.group(2)) in _TORCHRUN_DEFAULTS))


_QUIET = _QuietLogLines()


def quiet_third_party(verbose: bool) -> None:
    """Drop QUIET_LOG_LINES on torchtitan's logger (the root logger); every other record still shows."""
    root = logging.getLogger()
    if verbose:
        root.removeFilter(_QUIET)
    elif _QUIET not in root.filters:
        root.addFilter(_QUIET)


def train(resolved, verbose: bool = False, report: bool = True) -> dict | None:
    """Train; returns the last metrics record on rank 0, which prints the end-of-run summary and
    writes summary.json (``report=False``: neither, for a run whose folder is thrown away)."""
    from framework.train import process  # reason: start-up time (imports torch; `train --help` and --cfg need none)

    process.prepare(resolved.cfg)  # device shims, kernel caches, preemption signals, a one-rank world, threads
    rank = int(os.environ["RANK"])
    if rank == 0:
        if resolved.data_summary:
            print(resolved.data_summary, flush=True)  # the run's first line: what it trains on
        for line in resolved.resume_lines:  # which checkpoint was verified and is loaded
            print(line, flush=True)
        try:
            write_run_files(resolved)
        except OSError as e:  # filled up since the launch checked it
            if e.errno not in disk.FULL_ERRNOS:
                raise
            raise disk.full_at_launch(f"output_dir={resolved.cfg.output_dir}", resolved.cfg.output_dir,
                                      "the run's config.yaml and layout.json could not be written", e) from None
        if resolved.facts.source:  # which checkpoint and architecture this run loads
            Console(highlight=False, soft_wrap=True).print(f"model: {resolved.facts.source}", markup=False)
    import torch  # reason: below, with torchtitan (slow to import; only workers train)
    from torchtitan.tools.logging import init_logger  # reason: as above

    from framework.train.build import trainer_config  # reason: as above

    init_logger()
    for msg in ("In CPU autocast", "DTensor random operators", "'set_vital' is deprecated",
                "initial_load_model_only=True has no effect",
                "To get the last learning rate computed by the scheduler",  # torchtitan's resume recomputes it
                "DTensor manual_seed() may not have complete support on cpu"):  # CPU ranks: seeded as on GPU
        warnings.filterwarnings("ignore", message=msg)
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
    quiet_third_party(verbose)
    tc = trainer_config(resolved)
    trainer = guard = None
    report = report and rank == 0 and not resolved.cfg.checkpoint.create_seed
    first_step.STATE.begin()  # metrics.jsonl's first record: first_step_build_s and the step's breakdown
    ended = nonfinite = False  # every rank ended the loop together (not a crash)
    full = None  # the run folder's disk filled up (framework/train/disk_full.py)
    try:
        trainer = tc.build()
        if rank == 0:
            record_launch(resolved)
        guard = preempt.install(trainer)
        if resolved.cfg.checkpoint.create_seed:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
        ended = True
    except integrity.NonFiniteStop:
        nonfinite = True
        raise
    except DiskFull as e:  # a checkpoint that did not fit (framework/train/atomic_save.py)
        full = e
        raise
    except BaseException as e:  # another write of the run on a full disk (metrics.jsonl, a manifest): said
        if disk.stops_here(e) or (err := disk.full_errno(e)) is None:  # below, once the trainer is closed
            raise
        full = (err, disk.room_text(resolved.cfg.output_dir, has="had"))  # the room before anything is removed
        raise
    finally:
        if trainer is not None:
            try:
                trainer.close()  # the live progress line ends here; a save still being hashed becomes step-N
            except BaseException as e:  # on a full disk: the paragraph below says it, not a second traceback
                if full is None or disk.stops_here(e) or disk.full_errno(e) is None:
                    raise
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # torchtitan's flight-recorder folder (GPU) when no rank dumped into it; kept after a crash,
        # where a rank may still dump there
        if rank == 0 and (ended or nonfinite):
            _drop_empty(Path(resolved.cfg.output_dir) / "comm_traces")
        if nonfinite and report:  # the step is the one that was not applied
            _report(resolved, "on a non-finite loss or gradient norm", integrity.EXIT_NONFINITE, trainer.step - 1)
        if isinstance(full, tuple):  # the half-written saves removed (room for summary.json), then the paragraph
            out = Path(resolved.cfg.output_dir)
            removed = disk_full.drop_partials(out / "checkpoint") if rank == 0 else []
            full = disk_full.error(resolved.cfg.output_dir, step=trainer.step if trainer is not None else None,
                                   removed=removed, err=full[0], room=full[1])
        if full is not None and report:
            _report(resolved, "on a full disk", disk_full.EXIT_CODE, trainer.step if trainer is not None else None)
        if full is not None:
            raise full from None  # in place of the OSError on its way up
    if rank == 0 and ended and resolved.cfg.checkpoint.create_seed:
        print(seed_line(resolved), flush=True)
    if preempt.stopped(guard):
        if report:
            _report(resolved, preempt.stop_reason(), preempt.EXIT_CODE, guard.stopped_at)
        preempt.exit_if_stopped(guard)
    stop = trainer.follow_stop  # follow mode stopped waiting: a signal, a timeout or a bad shard (FollowStop)
    if stop is not None:
        if report:
            why = {"signal": f"{preempt.stop_reason()} while waiting for data",
                   "malformed": "on a malformed shard of the followed data",
                   "timeout": f"waiting for data (data.wait_timeout{stop.detail})"}[stop.why]
            _report(resolved, why, stop.exit_code, trainer.step)
        lifecycle.write_status(stop.exit_code)
        raise SystemExit(stop.exit_code)
    metrics = Path(resolved.cfg.output_dir) / "metrics.jsonl"
    if rank == 0 and metrics.is_file():
        _record_plan(resolved, metrics)
        if report:
            _report(resolved)
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    return None


def seed_line(resolved) -> str:
    """What a seed run (checkpoint.create_seed=true) wrote, and the commands that start from it (docs/skills/compare.md)."""
    seed = Path(resolved.cfg.output_dir) / "checkpoint" / "step-0"
    recipe = (resolved.launch or {}).get("recipe") or resolved.cfg.recipe
    keep = [o for o in run_overrides(resolved.launch) or [] if not o.lstrip("+~").startswith("checkpoint.")]
    args = shlex.join([f"recipe={recipe}", *keep, f"checkpoint.load_path={seed}"])
    return (f"seed checkpoint: {seed} (the initial weights). Train from it: train {args} "
            f"output_dir=RUN; or compare variants from it: apiary compare KEY=A,B {args}")


def _drop_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only when empty
    except OSError:
        pass


def _report(resolved, stop: str | None = None, exit_code: int = 0, step: int | None = None) -> None:
    """Rank 0, once training ended: the summary on the console and as summary.json."""
    try:
        s = summary.summarize(resolved.cfg.output_dir, stop=stop, exit_code=exit_code, stopped_at=step,
                              launch=resolved.launch)  # what the hand-off carries: nothing composed again
        summary.write(s)
        # stdout's reader left (`train | head`): on stderr, which a user still sees, with the resume command
        console = Console(stderr=True, highlight=False, soft_wrap=True) if preempt.stdout_gone() else None
        summary.render(s, console=console, color=bool(resolved.cfg.logging.color))
    except Exception as e:  # a summary must never fail a finished run
        logging.getLogger(__name__).warning("apiary: run summary skipped: %s", e)


def _record_plan(resolved, metrics: Path) -> None:
    """Write the planner's per-GPU estimate next to the measured peak (last record) and print both."""
    from framework import devices  # reason: start-up time (imports torch)
    from framework.plan.planner import estimate_for_run, merge_into_last_record  # reason: planner is heavy; after the run

    if not devices.has_accelerator():  # the estimate is for GPU memory; CPU RSS is not comparable: none recorded
        return
    try:
        est = estimate_for_run(resolved)
        merge_into_last_record(metrics, est)
    except Exception as e:  # an estimate must never fail a finished run
        logging.getLogger(__name__).warning("apiary: planner estimate skipped: %s", e)
        return
    last = json.loads(metrics.read_text().splitlines()[-1])
    Console(highlight=False, soft_wrap=True).print(
        f"memory: measured peak {last['peak_mem_bytes'] / 2**30:.2f} GiB ({last['peak_mem_kind']}), "
        f"planned {est['plan_torch_reserved_bytes'] / 2**30:.2f} GiB (torch reserved; "
        f"{est['plan_total_bytes'] / 2**30:.2f} GiB with CUDA context and NCCL)")
