"""The overrides a resume command repeats (the end-of-run summary prints the command): the run's
launch, as given, which the hand-off carries to rank 0 (``Resolved.launch``) and the run folder keeps
(``launches.jsonl``); nothing is composed again.
"""

from __future__ import annotations

# keys a resume command sets itself, or that follow from the recipe
_NOT_REPEATED = ("output_dir", "training.steps", "checkpoint.resume", "checkpoint.load_step", "recipe", "description")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def run_overrides(launch: dict | None) -> list[str] | None:
    """The overrides that make the run's recipe give its config again (a resume must repeat what its
    checkpoint depends on, framework/resolve/resume.py): the launch's own as given (a resume's include
    those it kept from the launch before), the last of each key, without the keys a resume command
    sets itself. None without a launch (a run folder of an older apiary)."""
    if not launch or not isinstance(launch.get("overrides"), list):
        return None
    last = {_key(o): i for i, o in enumerate(launch["overrides"])}
    return [o for i, o in enumerate(launch["overrides"]) if last[_key(o)] == i
            and _key(o) not in _NOT_REPEATED and not _key(o).startswith("hydra.")]
