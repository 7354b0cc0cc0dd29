"""Hydra's own settings on `train`'s command line (``hydra.*`` keys, ``hydra/...`` groups): each takes effect
or is refused, never ignored; and any key given twice with two values is refused (Hydra keeps the last).

    check(overrides, mode)    # mode: "run" (one job; --cfg job and --info preview it), "multirun" (-m)
                              # or "show" (--cfg hydra / --cfg all, which print Hydra's config)

A single run never starts Hydra's app: apiary resolves the recipe itself and writes to output_dir, so no
``hydra.*`` key acts on it (``hydra.run.*`` is refused by framework.compose.recipes, with its own fix). A -m sweep runs
through Hydra's sweeper and launcher, which read ``hydra.sweep.*`` (and the sweeper's own keys). apiary never
changes directory and logs through its own handlers, so ``hydra.job.chdir`` and Hydra's logging configs
(``hydra/job_logging``, ``hydra/hydra_logging``) are refused in every mode but "show", which prints Hydra's
config as given.
"""

from __future__ import annotations

from framework.errors import UserError

_LOGGING = ("job_logging", "hydra_logging")


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def _given_once(overrides: list[str]) -> None:
    """A key typed twice with two values (`training.steps=100 ... training.steps=6`; was: the last one won, no
    line said so): refused, whatever its spelling (``key=``, ``+key=``, ``++key=``: apiary sets a key the recipe
    has with each, and ``~key`` unsets it). The same value twice is one setting. Only one command line counts:
    a resume keeps its last launch's overrides except the keys given again (framework/resolve/resume.py)."""
    seen: dict[str, str] = {}
    for raw in overrides:
        key, sep, value = raw.lstrip("+~").partition("=")
        value = f"~{value}" if raw.startswith("~") else value.strip()
        if not sep and not raw.startswith("~"):
            continue  # not an override: Hydra's parser says so
        first = seen.setdefault(key, raw)
        was = first.lstrip("+~").partition("=")[2].strip()
        if (f"~{was}" if first.startswith("~") else was) != value:
            raise UserError(f"override {key}", f"is given twice, as {first} and as {raw}; Hydra would keep the last "
                            "one and drop the other without a word.", f"Give {key} once, with the value meant.")


def check(overrides: list[str], mode: str) -> None:
    """Refuse a key given twice with two values, and a ``hydra.*`` key or ``hydra/`` group that would have no
    effect in this mode (exit 2)."""
    _given_once(overrides)
    if mode == "show":
        return
    for raw in overrides:
        key = _key(raw)
        if not (key == "hydra" or key.startswith(("hydra.", "hydra/"))):
            continue
        group = key.replace("/", ".")
        if group.startswith(tuple(f"hydra.{name}" for name in _LOGGING)):
            raise UserError(f"override {raw}", "apiary does not use Hydra's logging configuration: a run logs "
                            "through its own console and handlers (a -m job's output goes to its train.log), so "
                            "the setting would be ignored.", "Drop it (-v logs every step).")
        if group == "hydra.job.chdir" or group.startswith("hydra.job.chdir."):
            raise UserError(f"override {raw}", "apiary runs every job from where train starts (relative paths "
                            "such as data.path are read from there) and a run writes to output_dir (a -m job to its "
                            "folder under hydra.sweep.dir): changing directory is not supported.",
                            "Drop it; set output_dir=PATH for where a run writes.")
        if mode != "run" or group == "hydra.run" or group.startswith("hydra.run."):
            continue  # hydra.run.*: refused with its own fix (output_dir) by framework.compose.recipes
        if group == "hydra.sweep" or group.startswith("hydra.sweep."):
            raise UserError(f"override {raw}", f"{key} places the jobs of a -m sweep, and a run without -m is one "
                            "job that writes to output_dir, so the setting would be ignored.",
                            f"Sweep with -m (train -m {raw} key=A,B), or set output_dir=PATH for this run.")
        raise UserError(f"override {raw}", "a run without -m does not start Hydra's app (apiary resolves the "
                        "recipe itself and writes to output_dir), so Hydra's settings (hydra.*) would be ignored.",
                        "Drop it; a -m sweep reads hydra.sweep.dir and hydra.sweep.subdir.")
