"""The summary's account of skipped updates (``training.on_nonfinite=skip``): each record carries ``nonfinite``
(1: this step's update was not applied) and ``skipped_steps`` (skips so far in its launch: the count starts
again at a resume), so the count is the last record's of each launch, and the steps named are the logged ones
(with ``logging.log_freq`` > 1 a skip between records is counted, not named)."""

from __future__ import annotations


def fields(train: list[dict], launches: list[list[dict]]) -> dict:
    """summary.json's ``skipped_updates`` (all launches) and ``skipped_steps_logged`` (the logged skipped steps)."""
    return {"skipped_updates": sum(int(seg[-1].get("skipped_steps") or 0) for seg in launches if seg),
            "skipped_steps_logged": [r["step"] for r in train if r.get("nonfinite")]}


def applied(record: dict) -> bool:
    """Whether the record's step applied its update (a skipped step's loss is no point of the curve)."""
    return not record.get("nonfinite")


def text(s: dict) -> str:
    """The steps line's note: '' without skips, else how many updates of the steps were skipped and which."""
    n, named = s.get("skipped_updates") or 0, s.get("skipped_steps_logged") or []
    if not n:
        return ""
    where = "none at a logged step" if not named else f"step{'s' if len(named) > 1 else ''} " + ", ".join(map(str, named))
    if named and len(named) < n:
        where += f", {n - len(named)} more between records"
    best = "" if s.get("rl_objective") else "; the best loss leaves them out"
    return (f" ({n} of {s['step']} updates skipped: non-finite loss or gradient norm, training.on_nonfinite=skip; "
            f"{where}{best})")
