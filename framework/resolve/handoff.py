"""The hand-off to workers: the launching process resolves once and writes the result into the run
folder; the ranks it starts (torchrun under the local launcher, the first start of a Slurm job) load it
instead of composing and checking the recipe again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from framework.errors import UserError
from framework.resolve.context import context, model_facts
from framework.resolve.inputs import world_size_env
from framework.resolve.layout import Layout
from framework.resolve.resolver import Resolved

RESOLVED_FILE = "resolved.yaml"
ENV_RESOLVED = "APIARY_RESOLVED"  # the file's path, set by the launcher for the ranks it starts
ENV_RESOLVED_SHA256 = "APIARY_RESOLVED_SHA256"  # its digest: a file changed after the launch is refused
_FORMAT = 1


def _text(r: Resolved, argv: list[str]) -> bytes:
    ctx = r.ctx
    doc = {"format": _FORMAT, "argv": list(argv), "cfg": OmegaConf.to_container(r.cfg, resolve=False),
           "layout": {"world_size": r.layout.world_size, "dims": r.layout.dims, "rules": dict(r.layout.rules)},
           "grad_accum": int(r.grad_accum), "data_summary": r.data_summary, "resume_lines": list(r.resume_lines),
           "given_parallel": dict(r.given_parallel), "launch": r.launch,
           "derived": dict(ctx.derived) if ctx is not None else {},
           "shared": ctx.shared.plain() if ctx is not None else {}}
    return yaml.safe_dump(doc, sort_keys=False).encode()


def _env(path: Path, text: bytes) -> dict[str, str]:
    return {ENV_RESOLVED: str(path.resolve()), ENV_RESOLVED_SHA256: hashlib.sha256(text).hexdigest()}


def write_resolved(r: Resolved, argv: list[str]) -> dict[str, str]:
    """Write ``r`` into ``output_dir/resolved.yaml`` for the ranks started with ``train argv``; returns
    the environment variables that hand it to them."""
    out = Path(r.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = _text(r, argv)
    path = out / RESOLVED_FILE
    tmp = path.with_name(f".{RESOLVED_FILE}.tmp")
    tmp.write_bytes(text)
    tmp.replace(path)
    return _env(path, text)


def preview_resolved(r: Resolved, argv: list[str]) -> dict[str, str]:
    """The variables ``write_resolved(r, argv)`` would return, writing nothing (a dry run's script)."""
    return _env(Path(r.cfg.output_dir) / RESOLVED_FILE, _text(r, argv))


def _handoff_error(path, what: str) -> UserError:
    return UserError(f"{ENV_RESOLVED}={path}", f"{what} This rank was started by an apiary launch (`train`, "
                     "`apiary launch`, a Slurm job it submitted), which resolved the recipe once and wrote that "
                     "file into the run folder for its ranks; they train exactly what it holds and check nothing "
                     "again.", "Launch the run again with the same command (it rewrites the file); do not edit "
                     f"{RESOLVED_FILE}, and unset {ENV_RESOLVED} and {ENV_RESOLVED_SHA256} in a shell that starts "
                     "its own torchrun.")


def load_resolved(argv: list[str], env=os.environ) -> Resolved:
    """A rank started by an apiary launcher: the run its launching process resolved (``ENV_RESOLVED``),
    rebuilt without composing or checking again (the components' context, the model's facts and the
    layout come from the file's config). A missing, changed or foreign file is a UserError (exit 2)."""
    path = Path(env[ENV_RESOLVED])
    try:
        text = path.read_bytes()
    except OSError as e:
        raise _handoff_error(path, f"cannot be read ({e.strerror or e}).") from None
    if hashlib.sha256(text).hexdigest() != env.get(ENV_RESOLVED_SHA256):
        raise _handoff_error(path, "was changed after the launching process wrote it (its SHA-256 is not the "
                             f"one in {ENV_RESOLVED_SHA256}).")
    try:
        doc = yaml.safe_load(text)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a resolved run of this apiary version")
        if list(doc["argv"]) != list(argv):
            raise _handoff_error(path, f"was written for `train {' '.join(doc['argv'])}`, and this rank was started "
                                 f"as `train {' '.join(argv)}`.")
        cfg = OmegaConf.create(doc["cfg"])
        lay = doc["layout"]
        layout = Layout(world_size=int(lay["world_size"]), rules=dict(lay["rules"]),
                        **{d: int(v) for d, v in lay["dims"].items()})
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        raise _handoff_error(path, f"is not a resolved run ({e}).") from None
    world = world_size_env()
    if world is not None and world != layout.world_size:
        raise _handoff_error(path, f"lays the run out for {layout.world_size} ranks, and this rank is one of {world}.")
    OmegaConf.set_struct(cfg, True)
    ctx = context(cfg, for_training=True)
    facts = model_facts(cfg, ctx)
    ctx.facts, ctx.layout = facts, layout
    ctx.derived.update(doc.get("derived") or {})
    for name, value in (doc.get("shared") or {}).items():  # contracts.Shared's fields
        setattr(ctx.shared, name, value)
    summary = str(doc.get("data_summary") or "")
    ctx.summary[:] = summary.splitlines()
    return Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=int(doc["grad_accum"]), data_summary=summary,
                    resume_lines=list(doc.get("resume_lines") or []), ctx=ctx,
                    given_parallel=dict(doc.get("given_parallel") or {}), launch=doc.get("launch"))
