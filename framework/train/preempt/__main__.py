"""``python -m framework.train.preempt train ARGS``: ``train ARGS``, preemptible (the Slurm template's
worker command): the handlers are armed before torch and torchtitan load, every torchtitan
Trainer this process trains is hooked, and the exit code is ``EXIT_CODE`` when training stopped
for a signal."""

from __future__ import annotations

import sys

from framework import devices
from framework.train import preempt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        argv = argv[1:]
    preempt.arm()  # a signal during start-up exits with EXIT_CODE instead of killing the process
    devices.install()  # point torchtitan at the CPU (when there is no GPU) before importing it
    preempt._hook_trainer_class()
    from framework.cli import train_main  # reason: loads torchtitan, so only after arm() and the device shims

    code = train_main(argv)
    if code == 0 and preempt.stopped():
        return preempt.EXIT_CODE
    return code


if __name__ == "__main__":
    sys.exit(main())
