"""The checks of weight publication (``publish.*``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from framework import contracts
from framework.errors import UserError
from framework.resolve import resume
from framework.resolve.inputs import writable_folder
from framework.resolve.layout import Layout

PUBLISH_DTYPES = ("bfloat16", "float16", "float32")


def check(cfg, ctx: contracts.Context, layout: Layout, for_training: bool) -> None:
    """publish.* (framework/train/publish.py): ranges and choices always; with publish.interval > 0 a model
    family that converts to HF (its ``hf_writer``), one pipeline stage and a writable publish.dir."""
    p = cfg.publish
    if p.interval < 0:
        raise UserError(f"publish.interval={p.interval}", "must be >= 0 (steps between published weight "
                        "versions; 0 publishes nothing).", "For example publish.interval=10.")
    if p.keep < 1:
        raise UserError(f"publish.keep={p.keep}", "must be >= 1 (the newest versions kept on disk; the one "
                        "`latest` names is never deleted).", "Keep 2 or more so a generator still loading "
                        "the previous version does not lose it: publish.keep=3.")
    if str(p.background).lower() not in ("auto", "true", "false"):
        raise UserError(f"publish.background={p.background}", "unknown; valid: auto, true, false.",
                        "auto writes in a background thread once a write costs more than 10% of a step.")
    if p.dtype is not None and str(p.dtype) not in PUBLISH_DTYPES:
        raise UserError(f"publish.dtype={p.dtype}", f"unknown; valid: {', '.join(PUBLISH_DTYPES)} (or null: the "
                        "trained parameters' dtype).", "Inference engines load bfloat16: publish.dtype=bfloat16.")
    if p.interval == 0:
        return
    horizon = resume.horizon(cfg)
    if p.interval > horizon:
        horizon_key = "lr.total_steps" if cfg.lr.total_steps is not None else "training.steps"
        raise UserError(f"publish.interval={p.interval} with {horizon_key}={horizon}", f"publishes every {p.interval} "
                        f"steps, and the run ends at step {horizon}: only the weights it starts from "
                        "(version 0, or the step a resume loads) would be published, never trained ones.",
                        f"Use publish.interval={horizon} or less (publish.interval=0 publishes nothing); a run that "
                        "resumes will extend can give its whole length now with lr.total_steps=N (N >= "
                        f"{p.interval}), and then publishes once it passes step {p.interval}.")
    # the launch's refusals below are config-level: `--cfg job` runs them too (only the folder's are launch-only)
    family = ctx.choice("model")
    if contracts.member(ctx.components["model"], "model", "hf_writer") is None:
        raise UserError(f"publish.interval={p.interval}", f"model.family={family} has no HF exporter "
                        "(hf_writer), so its weights cannot be published as a HuggingFace folder.",
                        "Set publish.interval=0, or add hf_writer to the family (framework/contracts/protocols.py "
                        "ModelFamily; docs/skills/publish.md).")
    if layout.pp > 1:
        raise UserError(f"publish.interval={p.interval}", f"with parallel.pp={layout.pp} each rank holds one "
                        "pipeline stage; publication gathers the whole model on rank 0 from one stage only.",
                        "Use parallel.pp=1 (the table's default) or publish.interval=0.")
    if not for_training:
        return
    where = p.dir if p.dir is not None else str(Path(cfg.output_dir) / "weights")
    writable_folder(where, f"publish.dir={where}", "no weights could be published")
    _check_publish_owner(cfg, where)


def _check_publish_owner(cfg, where) -> None:
    """publish.dir holding versions another run published (their apiary_version.json names another
    output_dir): this run would replace its step-0 and `latest` and prune its newer versions, silently.
    A resume of the same run (same output_dir) keeps them; a publish.dir inside the run's own folder
    (OUTPUT_DIR/weights, the default) is this run folder's, even after the folder was moved."""
    folder = Path(os.path.expanduser(str(where))).absolute()
    if not folder.is_dir():
        return
    out = Path(os.path.expanduser(str(cfg.output_dir))).absolute().resolve()
    if folder.resolve() == out or out in folder.resolve().parents:
        return
    from framework.train import published  # reason: imports torch (a launch imports it anyway); --cfg never comes here

    others: dict[str, list[str]] = {}
    for v in published.versions(folder):
        try:
            body = json.loads((folder / f"step-{v}" / published.VERSION_FILE).read_text())
        except (OSError, ValueError):
            continue
        run = body.get("run") if isinstance(body, dict) else None
        if isinstance(run, str) and run.strip() and Path(run).resolve() != out:
            others.setdefault(run, []).append(f"step-{v}")
    if not others:
        return
    run, names = next(iter(others.items()))
    more = f" (and versions of {len(others) - 1} other run(s))" if len(others) > 1 else ""
    raise UserError(f"publish.dir={where}", f"holds weight versions another run published: {', '.join(names)}, whose "
                    f"{published.VERSION_FILE} names the run {run}{more}, not this one ({out}). Publishing here would "
                    "replace that run's versions and `latest` and prune its newer ones (publish.keep), and a generator "
                    "reading the folder would mix the two runs' weights.", f"Give this run a publish.dir of its own "
                    f"(left out it is OUTPUT_DIR/weights), or delete {folder} if that run's versions are no longer "
                    f"needed; to continue that run, resume it with output_dir={run} checkpoint.resume=true.")
