"""Hydra's private names `train` calls (hydra-core 1.3.8): its argument parser, its Hydra object and
its basic sweeper's expansion, which Hydra exposes only under hydra._internal.
"""

from __future__ import annotations


def hydra_args_parser(prog: str, on_error):
    """hydra-core 1.3.8: ``hydra._internal.utils.get_args_parser()``, the argparse parser of Hydra's
    command line (overrides, -m, --cfg, --info, ...), named ``prog``, with ``on_error(message)`` in
    place of its ``error`` (argparse's would print its usage and exit 2; apiary's errors are one
    paragraph)."""
    from hydra._internal.utils import get_args_parser  # reason: start-up time (no library at module level)

    parser = get_args_parser()
    parser.prog = prog
    parser.error = on_error
    return parser


def hydra_for_config_dir(config_dir: str, task_name: str):
    """hydra-core 1.3.8: ``hydra._internal.hydra.Hydra.create_main_hydra2`` with a config search path
    rooted at ``config_dir`` (``hydra._internal.utils.create_config_search_path``)."""
    from hydra._internal.hydra import Hydra  # reason: start-up time (no library at module level)
    from hydra._internal.utils import create_config_search_path  # reason: as above

    return Hydra.create_main_hydra2(task_name=task_name, config_search_path=create_config_search_path(config_dir))


def hydra_sanitized_cfg(cfg):
    """hydra-core 1.3.8: ``Hydra.get_sanitized_hydra_cfg(cfg)``, the `hydra` section as Hydra's
    ``--cfg hydra`` prints it."""
    from hydra._internal.hydra import Hydra  # reason: start-up time (no library at module level)

    return Hydra.get_sanitized_hydra_cfg(cfg)


def hydra_split_sweep(parsed_overrides) -> list:
    """hydra-core 1.3.8: ``BasicSweeper.split_arguments(overrides, None)``, the basic sweeper's
    expansion of parsed overrides into batches of jobs (one batch: no batch size)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # reason: start-up time (no library at module level)

    return BasicSweeper.split_arguments(parsed_overrides, None)
