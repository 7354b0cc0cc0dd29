"""Local launcher: one process for one rank; torchrun on this machine for nproc > 1.

With nproc > 1 this process supervises torchrun (``env.supervise``, framework.launch.lifecycle's): it forwards
SIGTERM / SIGINT / SIGUSR1 once, so the ranks checkpoint at the next step boundary and exit 75,
returns the ranks' exit code, stops at once on a second Ctrl-C, and takes torchrun and the
ranks down with it if it is killed outright."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from framework.contracts import LaunchEnv
from framework.errors import UserError


class LocalLauncher:
    RUNS_HERE = True  # the ranks run on this machine
    @dataclass(kw_only=True)
    class Options:
        name: str = "local"
        """registry name (launcher=local)"""
        nproc: int = 1
        """ranks on this machine (`nproc=N` for short)"""
        master_port: int = 29500
        """torchrun's rendezvous port"""
        shutdown_timeout_s: int = 900
        """after a stop signal, torchrun kills ranks that have not exited by then"""

        def __post_init__(self):
            if self.nproc < 1:
                raise ValueError(f"nproc (launcher.nproc) must be >= 1 (processes on this machine), got {self.nproc}")
            if not 0 < self.master_port < 65536:
                raise ValueError(f"launcher.master_port must be a TCP port (1-65535), got {self.master_port}")

    @staticmethod
    def check(options: "LocalLauncher.Options", ctx=None) -> None:
        """Called by resolve before anything starts (ValueError: the reason; UserError)."""
        LocalLauncher.check_options(options)

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        """Nothing to edit: the launcher starts the ranks, it does not configure them."""
        return None

    @staticmethod
    def world_size(opts: "LocalLauncher.Options") -> int:
        return opts.nproc

    @staticmethod
    def check_options(opts: "LocalLauncher.Options") -> None:
        if int(opts.shutdown_timeout_s) < 1:
            raise UserError(f"launcher.shutdown_timeout_s={opts.shutdown_timeout_s}", "must be >= 1: it is how "
                            "long torchrun waits for the ranks to checkpoint after a stop signal before it "
                            "kills them.", "Leave it at 900, or set it above one step plus one checkpoint save.")

    @staticmethod
    def launch(opts: "LocalLauncher.Options", argv: list[str], env: LaunchEnv) -> int:
        """Run ``train argv`` with ``opts.nproc`` ranks; returns the exit code. One rank trains in this
        process (``env.run_here``); torchrun's ranks load the run this process resolved (``env.worker_env``:
        the file and its digest) instead of resolving it again."""
        if opts.nproc == 1:
            return env.run_here()
        try:
            LocalLauncher.check_options(opts)
        except UserError as e:
            print(f"error {e}", file=sys.stderr)
            return e.exit_code

        # torchrun, run as `python -m framework.launch.lifecycle torchrun` (no traceback after a stop signal)
        cmd = [sys.executable, "-m", env.worker_module, "torchrun", "--standalone", f"--nproc_per_node={opts.nproc}",
               "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
               f"--shutdown-timeout={int(opts.shutdown_timeout_s)}",
               "-m", env.train_module, "train", *argv]
        child_env = {**os.environ, **env.worker_env()}
        child_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its banner about it
        return env.supervise(cmd, child_env, nproc=opts.nproc)

    # apiary compare: how runs differing in this component or its options are held to each other
    # (nproc: the data-parallel size).
    NUMERICS = {"": "any", "nproc": "dp"}
