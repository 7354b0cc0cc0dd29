"""Local launcher: one process for one rank; torchrun on this machine for nproc > 1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass


class LocalLauncher:
    @dataclass
    class Options:
        name: str = "local"
        nproc: int = 1  # ranks on this machine
        master_port: int = 29500

    @staticmethod
    def check(opts: "LocalLauncher.Options") -> None:
        """Called by resolve before anything starts (ValueError: the reason)."""
        if opts.nproc < 1:
            raise ValueError(f"nproc (launcher.nproc) must be >= 1 (processes on this machine), got {opts.nproc}")
        if not 0 < opts.master_port < 65536:
            raise ValueError(f"launcher.master_port must be a TCP port (1-65535), got {opts.master_port}")

    @staticmethod
    def world_size(opts: "LocalLauncher.Options") -> int:
        return opts.nproc

    @staticmethod
    def launch(opts: "LocalLauncher.Options", argv: list[str], run_in_process) -> int:
        """Run ``train argv`` with ``opts.nproc`` ranks; returns the exit code."""
        if opts.nproc == 1:
            return run_in_process()
        torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={opts.nproc}",
               "-m", "framework.cli", "train", *argv]
        env = dict(os.environ, APIARY_LAUNCHED="1")
        return subprocess.call(cmd, env=env)
