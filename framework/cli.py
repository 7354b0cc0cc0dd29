"""The `train` console script (Hydra's command line: framework/compose/hydra_cli.py).

    train [recipe=NAME] [key=value | group=option | +key=value | ~key ...] [-m] [--cfg job|hydra|all] [-v]

The `apiary` command (ls, show, cp, plan, compare, launch, warmup, cp-template, export) is the
tools' (toolkit/cli.py): `apiary ...` or `python -m toolkit.cli ...`.
"""

from __future__ import annotations

import os
import sys
import time

from omegaconf import OmegaConf
from rich.console import Console
from rich.text import Text

from framework import compat
from framework.compose import hydra_cli
from framework.compose.schema import DEFAULT_RECIPE
from framework.errors import UserError
from framework.launch import lifecycle, pipes, runlock, start
from framework.plan import preflight
from framework.resolve.handoff import ENV_RESOLVED, load_resolved
from framework.resolve.resolver import resolve
from framework.train import preempt, run

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
console = Console(highlight=False, soft_wrap=True)


def _fail(e: UserError) -> int:
    err_console.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
    return e.exit_code


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def _print_cfg(r, args) -> None:
    """--cfg job|all: the resolved config (+ Hydra's section for all) and the derived layout."""
    cfg = r.cfg
    preflight.check_gpu_only_settings(cfg)  # refused as the launch would refuse it
    if args.cfg in ("hydra", "all"):
        hydra = hydra_cli.hydra_cfg(args.recipe, args.overrides, args.resolve)
        if args.cfg == "hydra":
            cfg = hydra
        else:
            cfg = OmegaConf.merge(OmegaConf.to_container(r.cfg), hydra)
    if args.package not in (None, "_global_"):
        sel = OmegaConf.select(cfg, args.package)
        if sel is None:
            raise UserError(f"train --package {args.package}", "no such key in the config.",
                            "Run `train --cfg all` to see the keys.")
        console.print(f"# @package {args.package}", markup=False)
        cfg = sel
    if OmegaConf.is_config(cfg):
        console.print(OmegaConf.to_yaml(cfg, resolve=args.resolve), end="", markup=False)
    else:
        console.print(str(cfg), markup=False)
    if args.cfg != "hydra":
        n = r.layout.world_size
        console.print(f"# derived layout for {n} GPU{'' if n == 1 else 's'}:", markup=False)
        for dim, rule in r.layout.rules.items():
            console.print(f"#   {dim} = {r.layout.dims[dim]}: {rule}", markup=False)


def train_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    if "TORCHELASTIC_RUN_ID" in os.environ:
        lifecycle.die_with_parent()  # torchrun killed outright: this worker dies with it
    try:
        try:
            args = hydra_cli.parse(argv)
        except SystemExit as e:  # --version: argparse printed it
            return int(e.code or 0)
        if args.help:
            console.print(hydra_cli.help_text(), end="", markup=False)
            return 0
        if args.hydra_help:
            h, name, base = hydra_cli.hydra_for(args.recipe)
            h.hydra_help(config_name=name, args_parser=hydra_cli.parser(), args=args)
            return 0
        recipe, overrides = args.recipe, args.overrides
        if _under_torchrun() and os.environ.get(ENV_RESOLVED) and not (args.multirun or args.info or args.cfg):
            return _train_worker(argv, args.verbose)  # started by `train`: the run it resolved
        if args.multirun:
            if _under_torchrun():
                raise UserError("train -m", "a sweep is started once, not by each torchrun worker.",
                                "Run `train -m ...` without torchrun; nproc=N launches each job's ranks.")
            return hydra_cli.multirun(recipe, overrides, lambda job, out: _run_job(recipe, job, out, args.verbose))
        if args.info:
            resolve(recipe, overrides, for_training=False)
            hydra_cli.info(recipe, overrides, args.info)
            return 0

        if args.cfg:
            _print_cfg(resolve(recipe, overrides, for_training=False), args)
            return 0
        if not _under_torchrun():  # resolved for the launcher's ranks, then started or submitted
            return start.launch(recipe, overrides, verbose=args.verbose)
        if not any(o.startswith("output_dir=") for o in overrides):  # a torchrun no apiary launch started
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
            overrides.append(f"output_dir=runs/{recipe or DEFAULT_RECIPE}/torchrun-{run_id}")
        r = resolve(recipe, overrides)
    except UserError as e:
        return _fail(e)
    return _train_rank(r, args.verbose)


def _train_worker(argv: list[str], verbose: bool) -> int:
    """A rank that an apiary launch started (`train`'s torchrun, a Slurm job's first start): load the run
    the launching process resolved (``ENV_RESOLVED``) and train it; nothing is composed or checked again."""
    try:
        r = load_resolved(argv)
    except UserError as e:  # every rank reads the same file
        return _rank_fail(e)
    return _train_rank(r, verbose)


def _train_rank(r, verbose: bool) -> int:
    try:
        lock = runlock.hold_in_worker(r.cfg.output_dir)  # rank 0 of a job no apiary parent started
    except UserError as e:
        return _fail(e)
    try:
        run.train(r, verbose=verbose)
    except UserError as e:  # found while the model loads (e.g. a NaN in a checkpoint tensor)
        return _rank_fail(e)
    finally:
        if lock is not None:
            lock.release()
    return 0


def _rank_fail(e: UserError) -> int:
    """Every rank found the same error: rank 0 says it once, the parent exits with the code."""
    lifecycle.write_status(e.exit_code)
    if os.environ.get("RANK", "0") == "0":
        return _fail(e)
    # the others give rank 0 time to reach the same check and say it (torchrun ends them once it
    # exits; without the preemption handler a SIGTERM ends them quietly)
    preempt.disarm()
    time.sleep(10)
    return e.exit_code


def _run_job(recipe, job: list[str], output_dir: str, verbose: bool) -> int:
    """One job of a `train -m` sweep, in the directory Hydra's launcher made for it."""
    restore = hydra_cli.env_snapshot()
    try:
        overrides = [o for o in job if not o.startswith("output_dir=")] + [f"output_dir={output_dir}"]
        return start.launch(recipe, overrides, verbose=verbose)
    finally:
        restore()


def _arm() -> None:
    """`train` from the command line: a signal while starting up exits 75 at once (no
    KeyboardInterrupt traceback); once training runs, it checkpoints first (framework/train/preempt).
    A reader that leaves (`train | head`) ends it quietly, 141, from every console, or once training
    runs stops it as SIGTERM does: a checkpoint, exit 75 (framework/launch/pipes)."""
    preempt.arm()
    pipes.stop_requested = preempt.requested  # a stopping process checkpoints before it goes quiet
    pipes.stop_training = preempt.stop_for_closed_pipe  # a training loop stops as on SIGTERM
    compat.route_broken_pipe(pipes.on_broken_pipe)
    pipes.guard_streams()  # a plain print's closed pipe, in any thread


def main() -> None:
    """``python -m framework.cli [train] ARGS``: ``train ARGS``."""
    if len(sys.argv) > 1 and sys.argv[1] == "apiary":
        _fail(UserError("python -m framework.cli apiary", "the apiary command is the tools' (toolkit.cli), "
                        "not the training path's.", "Run `apiary ...` or `python -m toolkit.cli ...`."))
        sys.exit(2)
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        sys.argv.pop(1)
    train_entry()


def train_entry() -> None:
    _arm()
    try:
        code = train_main()
        sys.stdout.flush()
    except BrokenPipeError:  # a plain print's
        pipes.quiet_exit()
    sys.exit(code)


if __name__ == "__main__":
    main()
