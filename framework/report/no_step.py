"""Why a run folder holds no checkpoint step, and what to do, from its own files (config.yaml, metrics.jsonl,
summary.json): `apiary export RUN` and `apiary logprobs RUN` (was: "Train with checkpoint.enable=true first" for a
run that had it on, the default, and stopped before its first save; newcomer pass 11, #48)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from framework.train import integrity


def why(run_dir) -> tuple[str, str]:
    """Why a run folder holds no checkpoint step at all, and what to do, from its config.yaml, metrics.jsonl
    and summary.json (was: "Train with checkpoint.enable=true first" for a run that had it on, the default,
    and stopped before its first save)."""
    run = Path(run_dir)
    try:
        cfg = OmegaConf.load(run / "config.yaml")
    except Exception:  # a damaged config: say what the folder shows
        cfg = None
    if cfg is not None and OmegaConf.select(cfg, "checkpoint.enable", default=True) is False:
        return ("no step was saved: the run trained with checkpoint.enable=false.",
                "Train it again with checkpointing on (the default; a fresh run in another output_dir).")
    interval = OmegaConf.select(cfg, "checkpoint.interval", default=None) if cfg is not None else None
    total = OmegaConf.select(cfg, "training.steps", default=None) if cfg is not None else None
    first = min(int(interval), int(total)) if interval and total else interval or total
    last = None
    try:
        lines = [ln for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        last = json.loads(lines[-1]).get("step") if lines else None
    except (OSError, ValueError, AttributeError):
        pass
    try:
        summary = json.loads((run / "summary.json").read_text())
        how = f"stopped {summary['stop']}" if summary.get("stop") else "ended"
    except (OSError, ValueError, KeyError, TypeError):
        how = "stopped without a summary (killed, or it crashed: its console says which)"
    at = f" at step {first} (checkpoint.interval={interval}, training.steps={total})" if first else ""
    if last is None:
        what = f"the run {how} before it logged a step, so before its first save{at}"
    elif first and int(last) < int(first):
        what = f"the run {how} after step {last}, before its first save{at}"
    else:
        what = f"the run {how} after step {last}, and its first save{at} did not complete"
    return (f"no step was saved: checkpointing was on, but {what}.",
            "There is nothing to export or resume: train again (a fresh run: the same command, in this output_dir or "
            f"another) and let it reach {f'step {first}' if first else 'its first save'}, or lower checkpoint.interval; "
            "a stop with SIGTERM or one Ctrl-C saves the step it is in.")


def refusal(run_dir, also: str = "") -> tuple[str, str]:
    """A UserError's reason and suggestion for a run folder without a complete step (``also``: appended to the
    suggestion): a step cut short or damaged, or none saved (``why``)."""
    cut = [f"checkpoint/step-{n}" for n in integrity.step_dirs(Path(run_dir) / "checkpoint")]
    if cut:
        return (f"holds no complete checkpoint: {', '.join(cut)} has no .metadata (a save cut short, or a damaged "
                "step), and DCP cannot read a step without it.", f"Train again. {also}".strip())
    reason, fix = why(run_dir)
    return f"holds no checkpoint: {reason}", f"{fix} {also}".strip()

