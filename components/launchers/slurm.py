"""Slurm launcher: render a batch script (one torchrun per node through srun) and submit it.

The script lives in ``launchers/slurm/train.sbatch.j2`` (Jinja2); ``apiary cp-template slurm
PATH`` copies it and ``launcher.template=PATH`` renders a customised copy instead. The script:

* runs ONE torchrun per node through ``srun`` with c10d rendezvous on the job's first node
  (rendezvous id = ``$SLURM_JOB_ID``, so a requeued job rejoins the same run directory);
* always passes ``output_dir`` (fixed when the script is rendered) and adds
  ``checkpoint.resume=true`` when that directory already holds a checkpoint;
* handles preemption: ``--signal=B:USR1@<preempt_signal_s>`` reaches the batch shell, which
  forwards USR1 to the training processes; they checkpoint at the next step boundary and exit
  (framework.train.preempt), and the script runs ``scontrol requeue $SLURM_JOB_ID``;
* writes one log per rank (torchrun ``--log-dir``/``--tee``) under ``<output_dir>/logs``.

``device=cpu`` runs ``gpus_per_node`` gloo ranks per node and requests no GPUs (CI, laptops).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Literal, Optional

from omegaconf import OmegaConf

from components.launchers.sbatch_errors import sbatch_failed
from framework.contracts import LaunchEnv
from framework.errors import EXIT_PREEMPTED, UserError

ROOT = Path(__file__).resolve().parents[2]
# the source tree's template, else the one a wheel installs under the environment's share/apiary
TEMPLATE = next((d / "launchers" / "slurm" / "train.sbatch.j2" for d in (ROOT, Path(sys.prefix) / "share" / "apiary")
                 if (d / "launchers" / "slurm" / "train.sbatch.j2").is_file()),
                ROOT / "launchers" / "slurm" / "train.sbatch.j2")
SCRIPT_NAME = "train.sbatch"
# Keys that choose or configure the launcher: the submitting side consumes them; workers do not
# see them (a worker learns its world from torchrun's environment).
_LAUNCH_ONLY = ("launcher", "output_dir", "checkpoint.resume", "nproc")


class SlurmLauncher:
    RUNS_HERE = False  # the ranks run on the cluster's nodes
    TEMPLATE = TEMPLATE  # the sbatch template `apiary cp-template slurm` copies
    @dataclass(kw_only=True)
    class Options:
        name: str = "slurm"
        """registry name (launcher=slurm)"""
        nodes: int = 1
        """nodes of the job (one torchrun each)"""
        gpus_per_node: int = 8
        """ranks per node (one per GPU; with device=cpu, CPU ranks)"""
        partition: Optional[str] = None
        """sbatch --partition"""
        account: Optional[str] = None
        """sbatch --account"""
        qos: Optional[str] = None
        """sbatch --qos"""
        time: str = "04:00:00"
        """Slurm time limit: MM, HH:MM:SS, D-HH, D-HH:MM:SS ..."""
        job_name: Optional[str] = None
        """default: apiary-<recipe>"""
        cpus_per_task: Optional[int] = None
        """CPUs for each node's torchrun (all its ranks)"""
        mem: Optional[str] = None
        """per node, e.g. 0 (all), 500G"""
        exclusive: bool = False
        """sbatch --exclusive (whole nodes)"""
        device: Literal["gpu", "cpu"] = "gpu"
        """gpu | cpu (cpu: gloo ranks, no GPUs requested)"""
        preempt_signal_s: int = 300
        """USR1 this long before the time limit: checkpoint + requeue"""
        requeue: bool = True
        """requeue the job after a preemption checkpoint"""
        rdzv_port: Optional[int] = None
        """default: 20000 + SLURM_JOB_ID % 20000"""
        template: Optional[str] = None
        """path to your own .sbatch.j2 (apiary cp-template slurm PATH)"""
        extra_sbatch: List[str] = field(default_factory=list)
        """e.g. ["--constraint=h200", "--exclusive"]"""
        setup: List[str] = field(default_factory=list)
        """shell lines before launch, e.g. 'module load cuda'"""
        wait: bool = False
        """block until the job ends (through requeues) and return its exit code"""
        warmup: bool = False
        """before srun: `apiary warmup` on one task fills training.kernel_cache"""

    @staticmethod
    def world_size(opts) -> int:
        return int(opts.nodes) * int(opts.gpus_per_node)

    @staticmethod
    def check(options, ctx=None) -> None:
        """Before launch: the options themselves, and warmup's need of a shared kernel cache."""
        SlurmLauncher.check_options(options)
        if ctx is not None:
            SlurmLauncher.check_warmup(options, ctx)

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        """Nothing to edit: the batch script starts the ranks, it does not configure them."""
        return None

    # ------------------------------------------------------------------ checks
    @staticmethod
    def check_options(opts) -> None:
        """Checks that need no recipe (run before resolving, so the message names the option)."""
        if opts.nodes < 1 or opts.gpus_per_node < 1:
            raise UserError(f"launcher.nodes={opts.nodes} launcher.gpus_per_node={opts.gpus_per_node}",
                            "both must be >= 1.", "E.g. nodes=4 gpus_per_node=8.")
        if opts.device not in ("gpu", "cpu"):
            raise UserError(f"launcher.device={opts.device}", "must be gpu or cpu.",
                            "cpu runs gpus_per_node gloo ranks per node and requests no GPUs.")
        limit = parse_time(opts.time)
        if limit is None:
            raise UserError(f"launcher.time={opts.time}", "is not a Slurm time limit.",
                            "Use MM, HH:MM:SS, D-HH or D-HH:MM:SS, e.g. time=04:00:00.")
        if opts.preempt_signal_s < 0:
            raise UserError(f"launcher.preempt_signal_s={opts.preempt_signal_s}", "must be >= 0.")
        if limit != float("inf") and opts.preempt_signal_s >= limit:
            raise UserError(f"launcher.preempt_signal_s={opts.preempt_signal_s}",
                            f"the checkpoint signal must come before the time limit time={opts.time} "
                            f"({int(limit)} s).", "Lower launcher.preempt_signal_s or raise launcher.time.")
        if opts.cpus_per_task is not None and opts.cpus_per_task < 1:
            raise UserError(f"launcher.cpus_per_task={opts.cpus_per_task}", "must be >= 1.")
        for key in ("partition", "account", "qos", "job_name", "mem"):  # one #SBATCH word each
            value = getattr(opts, key)
            if value is None:
                continue
            if not str(value).strip():
                raise UserError(f"launcher.{key}=", f"is empty, so sbatch --{key.replace('_', '-')} would be left "
                                "out and Slurm's default used.", f"Name one, or leave {key} out (null) for the "
                                "cluster's default.")
            if any(c.isspace() for c in str(value)):
                raise UserError(f"launcher.{key}={value}", "holds a space: the #SBATCH line would end at it "
                                f"(sbatch --{key.replace('_', '-')} takes one word).",
                                "Use one without spaces" + (" (several partitions: a comma-separated list)."
                                                            if key == "partition" else "."))
        if opts.mem is not None and not re.fullmatch(r"\d+[KMGT]?", str(opts.mem), re.IGNORECASE):
            raise UserError(f"launcher.mem={opts.mem}", "is not a Slurm memory size (sbatch --mem: a whole number "
                            "of megabytes, or with a unit K, M, G or T; 0: all of a node's memory).",
                            "For example mem=500G, or mem=0.")
        if opts.rdzv_port is not None and not 0 < int(opts.rdzv_port) < 65536:
            raise UserError(f"launcher.rdzv_port={opts.rdzv_port}", "must be a TCP port (1-65535), or null (20000 + "
                            "SLURM_JOB_ID % 20000).", "For example rdzv_port=29400, or leave it out.")
        template_path(opts)  # raises when missing

    @staticmethod
    def check_warmup(opts, resolved) -> None:
        """launcher.warmup=true needs a cache the job's ranks read: training.kernel_cache."""
        if getattr(opts, "warmup", False) and not resolved.cfg.training.kernel_cache:
            raise UserError("launcher.warmup=true", "needs training.kernel_cache: without it the warmup task "
                            "fills the caches of the node it runs on only, not those the job's other nodes read.",
                            "Add training.kernel_cache=PATH on a shared filesystem.")
        if getattr(opts, "warmup", False) and not resolved.cfg.training.cache_autotuning:
            raise UserError("launcher.warmup=true training.cache_autotuning=false",
                            "the warmup's autotuning results would not be kept.",
                            "Leave training.cache_autotuning=true, or drop launcher.warmup.")

    @staticmethod
    def preflight(opts, resolved, *, dry_run: bool = False) -> list[str]:
        """Raise UserError for options that cannot work; return warnings."""
        SlurmLauncher.check_options(opts)
        SlurmLauncher.check_warmup(opts, resolved)
        if not dry_run and shutil.which("sbatch") is None:
            raise UserError("launcher=slurm", "sbatch is not on PATH here, so nothing can be submitted.",
                            "Run on a Slurm login node, or add --dry-run to print the script.")
        out = Path(resolved.cfg.output_dir).resolve()
        parent = next((p for p in [out, *out.parents] if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK):
            raise UserError(f"output_dir={resolved.cfg.output_dir}", f"{parent} is not writable.",
                            "Choose an output_dir on a shared, writable filesystem.")
        warnings = []
        if not resolved.cfg.checkpoint.enable:
            warnings.append("checkpoint.enable=false: a preempted or requeued job starts over from step 0.")
        return warnings

    # ------------------------------------------------------------------ render
    @staticmethod
    def render(opts, resolved, argv: list[str], worker_env=None) -> str:
        """The batch script for ``train argv`` (recipe=... and overrides) with these options; with
        ``worker_env`` (LaunchEnv's) its ranks get the run resolved here (``handoff`` in the template)."""
        import jinja2  # reason: start-up time (only rendering a script needs it)

        SlurmLauncher.check_warmup(opts, resolved)
        path = template_path(opts)
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(path.parent)),
                                 undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                 trim_blocks=True, lstrip_blocks=True, autoescape=False)
        env.filters["shquote"] = lambda v: shlex.quote(str(v))
        try:
            return env.get_template(path.name).render(**context(opts, resolved, argv, worker_env))
        except jinja2.TemplateError as e:
            line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise UserError(f"launcher.template={path}", f"does not render ({type(e).__name__}{line}: {e}).",
                            "Compare it with `apiary cp-template slurm NEW_PATH`.") from None

    # ------------------------------------------------------------------ launch
    @staticmethod
    def launch(opts, argv: list[str], env: LaunchEnv) -> int:
        """Write the script into the run directory and submit it; returns sbatch's exit code
        (or the job's, with launcher.wait=true). ``env.resolved`` is the run, resolved for
        this launcher's world size; ``env.worker_env`` writes it into the run folder, and the job's
        first start hands it to its ranks (they load it, nothing is composed again). A requeued job
        resumes from a checkpoint the submission did not see: its ranks resolve that resume themselves."""
        resolved = env.resolved
        try:
            if not env.warned:  # `train launcher=slurm ...` (apiary launch ran preflight itself)
                for w in SlurmLauncher.preflight(opts, resolved):
                    print(f"warning: {w}", file=sys.stderr)
            script = SlurmLauncher.render(opts, resolved, argv, env.worker_env)
        except UserError as e:
            print(f"error {e}", file=sys.stderr)
            return e.exit_code
        out = Path(resolved.cfg.output_dir).resolve()
        (out / "logs").mkdir(parents=True, exist_ok=True)
        path = out / SCRIPT_NAME
        path.write_text(script)
        path.chmod(0o755)
        proc = subprocess.run(["sbatch", "--parsable", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        first = proc.stdout.strip().splitlines()[0] if (proc.stdout or "").strip() else ""
        if proc.returncode != 0 or not first:
            e = sbatch_failed(proc, path, out)
            print(f"error {e}", file=sys.stderr)
            return e.exit_code
        job = first.split(";")[0]
        print(f"submitted Slurm job {job}: {path}\n  batch log  {out / 'logs' / f'slurm-{job}.out'}\n"
              f"  rank logs  {out / 'logs' / f'job{job}.<restart>'}/node<N>/...\n"
              f"  follow     tail -f {out / 'logs' / f'slurm-{job}.out'}", flush=True)
        return wait_for_job(job) if opts.wait else 0

    # apiary compare: how runs differing in this component or its options are held to each other
    # (nodes x gpus_per_node: the data-parallel size).
    NUMERICS = {"": "any", "nodes": "dp", "gpus_per_node": "dp"}


# ---------------------------------------------------------------------- waiting
# Final states (scontrol's JobState names). COMPLETING is not one: a job shows it on its way to
# COMPLETED, and also on its way back to PENDING when it is requeued.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED")


def job_info(job: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def exit_code(info: dict) -> int:
    """scontrol's ExitCode=STATUS:SIGNAL -> a shell exit code (128 + signal when signalled)."""
    status, _, sig = info.get("ExitCode", "1:0").partition(":")
    return 128 + int(sig) if sig.isdigit() and int(sig) else int(status) if status.isdigit() else 1


def wait_for_job(job: str, poll_s: float = 2.0) -> int:
    """Block until the job reaches a final state, through any number of requeues, printing its
    state changes (so a requeue and its outcome are visible); return its exit code."""
    last, misses = None, 0
    while True:
        info = job_info(job)
        if not info:  # purged from slurmctld's memory (MinJobAge) or a transient error
            misses += 1
            if misses >= 5:
                print(f"Slurm job {job}: no longer known to scontrol; see its batch log for the outcome", flush=True)
                return 1
            _time.sleep(poll_s)
            continue
        misses = 0
        state, restarts = info.get("JobState", "?"), info.get("Restarts", "0")
        if (state, restarts) != last:
            print(f"Slurm job {job}: {state}" + (f" (restart {restarts})" if restarts != "0" else ""), flush=True)
            last = (state, restarts)
        if state in FINAL_STATES:
            return 0 if state == "COMPLETED" else (exit_code(info) or 1)
        _time.sleep(poll_s)


# ---------------------------------------------------------------------- helpers
def template_path(opts) -> Path:
    if not opts.template:
        return TEMPLATE
    p = Path(opts.template).expanduser()
    if not p.is_file():
        raise UserError(f"launcher.template={opts.template}", "no template file there.",
                        "Copy the default with `apiary cp-template slurm my.sbatch.j2` and edit it.")
    return p.resolve()


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(s: str) -> float | None:
    """Slurm's time formats -> seconds (inf for UNLIMITED); None when malformed."""
    s = str(s).strip()
    if s.upper() in ("UNLIMITED", "INFINITE"):
        return float("inf")
    m = _TIME.match(s)
    if not m:
        return None
    d, a, b, c = m.groups()
    if d is not None:  # D-HH[:MM[:SS]]
        return int(d) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # HH:MM:SS
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # MM:SS
        return int(a) * 60 + int(b)
    return int(a) * 60  # MM


def worker_args(argv: list[str]) -> list[str]:
    """``train`` arguments for the workers: the recipe and its overrides, without the keys only
    the submitting side uses (launcher choice/options, output_dir, checkpoint.resume)."""
    out = []
    for a in argv:
        key = a.lstrip("+~").split("=", 1)[0]
        if key in _LAUNCH_ONLY or key.startswith("launcher."):
            continue
        if a.startswith("--cfg") or a in ("-h", "--help", "--dry-run", "--wait"):
            continue
        out.append(a)
    return out


def latest_step(out: Path) -> int | None:
    """The newest ``checkpoint/step-N`` folder's N, as the batch script finds it (LATEST), or None."""
    steps = [int(p.name[5:]) for p in (out / "checkpoint").glob("step-*") if p.name[5:].isdigit()]
    return max(steps) if steps else None


def handoff(worker_env, argv: list[str], out: Path) -> dict | None:
    """The resolved run for the job's ranks: the variables that hand it to them (``env``), the ``argv``
    they get it with, and the checkpoint ``step`` it was resolved against ("none": a fresh run). The
    script hands it over only while that is still the newest checkpoint (not after a requeue)."""
    if worker_env is None:
        return None
    step = latest_step(out)
    ranks = [*worker_args(argv), f"output_dir={out}", *(["checkpoint.resume=true"] if step is not None else [])]
    return {"env": dict(worker_env(ranks)), "step": "none" if step is None else str(step)}


def context(opts, resolved, argv: list[str], worker_env=None) -> dict:
    """Everything the template may use (documented in docs/launching.md)."""
    cfg = resolved.cfg
    out = Path(cfg.output_dir).resolve()
    venv_bin = Path(sys.executable).parent
    o = OmegaConf.to_container(opts, resolve=True) if OmegaConf.is_config(opts) else dict(vars(opts))
    nproc = int(o["gpus_per_node"])
    limit = parse_time(o["time"]) or 0
    grace = int(o["preempt_signal_s"])
    return dict(
        opts=o,
        recipe=cfg.recipe,
        job_name=o.get("job_name") or f"apiary-{cfg.recipe}",
        nodes=int(o["nodes"]),
        nproc_per_node=nproc,
        world_size=int(o["nodes"]) * nproc,
        gpu=o["device"] == "gpu",
        dims=dict(resolved.layout.dims),
        output_dir=str(out),
        log_dir=str(out / "logs"),
        workdir=str(Path.cwd().resolve()),
        venv_bin=str(venv_bin),
        venv=sys.prefix,
        python=sys.executable,
        torchrun=str(venv_bin / "torchrun"),
        train_args=worker_args(argv),
        handoff=handoff(worker_env, argv, out),
        warmup=bool(o.get("warmup", False)),
        kernel_cache=str(Path(cfg.training.kernel_cache).expanduser().resolve()) if cfg.training.kernel_cache else "",
        total_steps=int(cfg.training.steps),
        checkpoint_enabled=bool(cfg.checkpoint.enable),
        preempt_signal_s=grace,
        # how long torchrun lets ranks finish their step and checkpoint after USR1/TERM
        shutdown_timeout_s=max(30, grace - 30) if grace else 30,
        time_limit_s=limit,
        preempt_exit_code=EXIT_PREEMPTED,
        rendered_at=_time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        command=" ".join(shlex.quote(a) for a in ["apiary", "launch", *argv]),
    )
