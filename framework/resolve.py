"""Recipe -> resolved run: typed config, model facts, derived layout, output paths.

Everything here runs before any worker is spawned and turns bad input into UserError.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from framework import contracts, integrity, recipes, registry, resume
from framework.errors import UserError, did_you_mean
from framework.layout import Layout, check_batch, derive
from framework.preflight import check_memory


@dataclass
class Resolved:
    cfg: DictConfig  # composed recipe, derived dims filled in
    facts: object  # the model family's facts (ModelFamily.facts)
    layout: Layout
    grad_accum: int
    data_summary: str = ""  # what the run trains on (printed first by rank 0)
    resume_lines: list = field(default_factory=list)  # a resume: the step it loads, what changed (printed next)
    ctx: contracts.Context | None = None  # the components' context (check ran with it; build applies with it)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)


def context(cfg, for_training: bool = True) -> contracts.Context:
    """Each kind's chosen component and its Options built from the recipe (before facts or layout).

    A value an ``Options.__post_init__`` refuses (ValueError) becomes a UserError naming the key."""
    ctx = contracts.Context(cfg=cfg, for_training=for_training)
    for kind in contracts.KINDS:
        section, key = contracts.SELECT[kind]
        name = str(cfg[section][key])
        comp = registry.resolve(kind, name, where=_where(kind, name))
        _check_members(kind, name, comp)
        ctx.components[kind] = comp
        with _as_user_error(kind, name, comp):
            ctx.options[kind] = contracts.make_options(comp, cfg[section])
    return ctx


# Members the tools read when present (compare: NUMERICS; the planner: plan_terms) and a loss's own
# check reads (NEEDS_DATA); a user's component may leave them out (compare then holds a switch to
# nothing, the planner warns); a model family's hf_writer (weight publication, refused without it).
_OPTIONAL = ("NUMERICS", "plan_terms", "NEEDS_DATA", "hf_writer")


def _check_members(kind: str, name: str, component) -> None:
    """A component (a user's, typically) lacks a member the framework calls: one paragraph, not an
    AttributeError in a worker."""
    missing = [m for m in contracts.missing_members(kind, component) if m not in _OPTIONAL]
    if missing:
        source = registry.entries()[kind][name].get("source", "registry.yaml")
        raise UserError(_where(kind, name), f"{kind} {name!r} (bound by {source}) lacks "
                        f"{' and '.join([', '.join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)}, "
                        f"which every {kind} provides.",
                        "Add them as docs/architecture.md shows (the contract of each kind is in "
                        "framework/contracts.py).")


def _see(kind: str, name: str, component=None) -> str:
    """Where the options of ``kind=name`` are documented: its skill page (``SKILL`` or its name)
    or its kind's, and `apiary show`."""
    for page in (getattr(component, "SKILL", None), name, kind):
        if page and (registry.ROOT / "docs" / "skills" / f"{page}.md").is_file():
            return f"See `apiary show {name}` and docs/skills/{page}.md."
    return f"See `apiary show {name}`."


def _where(kind: str, name: str) -> str:
    """How the command line names a kind's choice: ``KIND=NAME`` for a group kind, else
    ``SECTION.KEY=NAME`` (contracts.SELECT)."""
    section, key = contracts.SELECT[kind]
    return f"{kind}={name}" if (section, key) == (kind, "name") else f"{section}.{key}={name}"


@contextlib.contextmanager
def _as_user_error(kind: str, name: str, component=None):
    """ValueError raised by a component (the reason) -> UserError naming the kind and choice."""
    try:
        yield
    except ValueError as e:
        raise UserError(_where(kind, name), f"{e}.".replace("..", "."), _see(kind, name, component)) from None


def model_kwargs(cfg, ctx: contracts.Context | None = None) -> dict:
    """The model family's ``model_config`` arguments for this recipe."""
    ctx = ctx or context(cfg, for_training=False)
    return ctx.components["model"].model_kwargs(ctx.options["model"], ctx)


def model_facts(cfg, ctx: contracts.Context | None = None):
    ctx = ctx or context(cfg, for_training=False)
    mod, opts = ctx.components["model"], ctx.options["model"]
    flavors = list(mod.FLAVORS)
    if opts.flavor not in flavors:
        raise UserError(f"model.flavor={opts.flavor}",
                        f"unknown flavor for {opts.family}; known: {', '.join(flavors)}.",
                        did_you_mean(opts.flavor, flavors))
    try:
        return mod.facts(opts.flavor, **mod.model_kwargs(opts, ctx))
    except TypeError as e:
        if opts.hf_checkpoint and "hf_checkpoint" in str(e):
            raise UserError(f"model.hf_checkpoint={opts.hf_checkpoint}",
                            f"model.family={opts.family} does not load HF checkpoints.",
                            "Drop model.hf_checkpoint, or use a family that loads them "
                            "(`apiary ls` lists the families).") from None
        raise


def check_components(ctx: contracts.Context) -> None:
    """Every kind's ``check(options, ctx)``, in ``contracts.KINDS`` order, before any worker starts."""
    for kind in contracts.KINDS:
        with _as_user_error(kind, ctx.choice(kind), ctx.components[kind]):
            ctx.components[kind].check(ctx.options[kind], ctx)


# rl.* settings that act through the loss (the policy losses): (key, set?). A loss component lists the
# ones it acts on in ``RL_KEYS``; one set with a loss that does not act on it is refused, never ignored.
_RL_LOSS_KEYS = (("tis_cap", lambda v: v is not None),
                 ("mismatch_threshold", lambda v: v != 0.1))  # 0.1: framework/schema.py RLConfig's default


def check_rl_keys(ctx: contracts.Context) -> None:
    """``rl.tis_cap`` / ``rl.mismatch_threshold`` set with a loss whose ``RL_KEYS`` lacks them: exit 2."""
    section = ctx.cfg.get("rl") if hasattr(ctx.cfg, "get") else None
    if section is None:
        return
    name = ctx.choice("loss")
    acts_on = getattr(ctx.components["loss"], "RL_KEYS", ())
    for key, is_set in _RL_LOSS_KEYS:
        value = section.get(key)
        if is_set(value) and key not in acts_on:
            raise UserError(f"rl.{key}={value}", f"acts through an RL policy loss; loss={name} does not use it, "
                            "so it would be ignored.",
                            f"Choose an RL policy loss (`apiary ls` lists the losses), or drop rl.{key}. "
                            "See docs/skills/tis.md.")


def world_size_from(cfg, for_training: bool = True) -> int:
    """The real world size when launching; the recipe's intended GPU count when only printing."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    launched = int(registry.resolve("launcher", cfg.launcher.name).world_size(cfg.launcher))
    if not for_training and launched == 1 and cfg.parallel.gpus is not None:
        return int(cfg.parallel.gpus)
    return launched


def default_output_dir(recipe: str) -> str:
    return str(Path("runs") / recipe / time.strftime("%Y%m%d-%H%M%S"))


def latest_run_dir(recipe: str) -> Path | None:
    root = Path("runs") / recipe
    runs = [p for p in root.glob("*") if checkpoint_steps(p)] if root.is_dir() else []
    runs.sort(key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The complete checkpoint steps of a run (a save killed midway is never one)."""
    return integrity.complete_steps(Path(run_dir) / "checkpoint")


def _any_step_dir(run_dir: Path) -> bool:
    """Any checkpoint/step-N folder, complete or not: a fresh run must not overwrite either."""
    return bool(integrity.step_dirs(Path(run_dir) / "checkpoint"))


def _check_outputs(cfg) -> int | None:
    """Resume only from an intact checkpoint; never silently reuse or overwrite one."""
    ck = cfg.checkpoint
    if ck.resume:
        if cfg.output_dir is None:
            latest = latest_run_dir(cfg.recipe)
            if latest is None:
                raise UserError("checkpoint.resume=true", f"no earlier run of {cfg.recipe} with a checkpoint "
                                f"under runs/{cfg.recipe}/.", "Pass output_dir=PATH of the run to continue.")
            cfg.output_dir = str(latest)
        step = integrity.check_resume(Path(cfg.output_dir), ck.load_step, "checkpoint.resume=true")  # exit 2 if corrupt
        if step >= cfg.training.steps:
            raise UserError("checkpoint.resume=true", f"{cfg.output_dir} is already at step {step} of "
                            f"training.steps={cfg.training.steps}.", "Raise training.steps to train further.")
        return step
    else:
        if ck.load_step is not None:
            raise UserError(f"checkpoint.load_step={ck.load_step}", "picks the step a resume loads; this run "
                            "does not resume.", "Add checkpoint.resume=true (with output_dir=RUN), or drop it.")
        if cfg.output_dir is None:
            cfg.output_dir = default_output_dir(cfg.recipe)
        elif Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
            raise UserError(f"output_dir={cfg.output_dir}", "is an existing file, not a folder; the run writes "
                            "config.yaml, metrics.jsonl and checkpoints into a folder there.",
                            "Choose another output_dir (a new or empty folder).")
        elif _any_step_dir(Path(cfg.output_dir)):
            raise UserError(f"output_dir={cfg.output_dir}", "already holds checkpoints of an earlier run; a fresh "
                            "run would load or overwrite them.", "Pass checkpoint.resume=true to continue it, or "
                            "choose another output_dir.")


def _writable_folder(path, key: str, what: str) -> None:
    """``path`` (or its nearest existing parent) is a folder this process can write; else a UserError
    naming ``key``. ``what`` says what could not be written. The probe (a temporary folder, removed at
    once) leaves nothing behind: os.access alone says yes to root on a read-only mount."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(key, f"{probe} is a file, so no folder can be made there.",
                        f"Choose another {key.split('=')[0]} (a new or empty folder).")
    try:
        writable = os.access(probe, os.W_OK | os.X_OK)
        if writable:
            tempfile.TemporaryDirectory(dir=probe, prefix=".apiary-probe-").cleanup()
    except OSError:
        writable = False
    if not writable:
        raise UserError(key, f"{probe} is not writable by this user, so {what}.",
                        f"Choose a writable {key.split('=')[0]}, or fix the folder's permissions.")


def _check_writable(cfg) -> None:
    """output_dir (or its nearest existing parent) must be a folder this process can write."""
    _writable_folder(cfg.output_dir, f"output_dir={cfg.output_dir}", "the run could save no config, metrics or checkpoint")


PUBLISH_DTYPES = ("bfloat16", "float16", "float32")


def _check_publish(cfg, ctx: contracts.Context, layout: Layout, for_training: bool) -> None:
    """publish.* (framework/publish.py): ranges and choices always; with publish.interval > 0 a model
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
    if p.interval == 0 or not for_training:
        return
    family = ctx.choice("model")
    if not callable(getattr(ctx.components["model"], "hf_writer", None)):
        raise UserError(f"publish.interval={p.interval}", f"model.family={family} has no HF exporter "
                        "(hf_writer), so its weights cannot be published as a HuggingFace folder.",
                        "Set publish.interval=0, or add hf_writer to the family (framework/contracts.py "
                        "ModelFamily; docs/skills/publish.md).")
    if layout.pp > 1:
        raise UserError(f"publish.interval={p.interval}", f"with parallel.pp={layout.pp} each rank holds one "
                        "pipeline stage; publication gathers the whole model on rank 0 from one stage only.",
                        "Use parallel.pp=1 (the table's default) or publish.interval=0.")
    where = p.dir if p.dir is not None else str(Path(cfg.output_dir) / "weights")
    _writable_folder(where, f"publish.dir={where}", "no weights could be published")


# Values every recipe must keep in range: (key, test, rule, fix). Checked before anything starts.
_RANGES = [
    ("training.steps", lambda v: v >= 1, "must be >= 1", "Set training.steps to the number of optimizer steps."),
    ("training.seq_len", lambda v: v >= 2, "must be >= 2 (a token and its next)", "For example training.seq_len=256."),
    ("training.local_batch", lambda v: v >= 1, "must be >= 1", "For example training.local_batch=2."),
    ("training.global_batch", lambda v: v is None or v >= 1, "must be >= 1 (or null: local x data-parallel)", ""),
    ("training.max_norm", lambda v: v > 0, "must be > 0 (gradients are clipped to this norm; 0 would zero "
     "every gradient)", "To clip nothing, set training.max_norm=inf."),
    ("optimizer.lr", lambda v: v >= 0 and v != float("inf"), "must be a finite number >= 0 (0: a control run "
     "whose weights never change)", "For example optimizer.lr=3e-4."),
    ("optimizer.weight_decay", lambda v: v >= 0, "must be >= 0", ""),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.eps", lambda v: v > 0, "must be > 0", ""),
    ("moe.load_balance_coeff", lambda v: v is None or v > 0, "must be > 0 (the step of the MoE routing bias that "
     "balances the experts' load)", "To turn the balancing off, set moe.load_balance_coeff=null."),
    ("lr.warmup_steps", lambda v: v >= 0, "must be >= 0", "Set 0 for no warm-up."),
    ("lr.decay_ratio", lambda v: v is None or 0 <= v <= 1, "must be in [0, 1] (or null)", ""),
    ("lr.min_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]", ""),
    ("lr.total_steps", lambda v: v is None or v >= 1, "must be >= 1 (the steps the schedule spans) or null "
     "(training.steps)", ""),
    ("checkpoint.interval", lambda v: v >= 1, "must be >= 1 (steps between saves)",
     "To save no checkpoints, set checkpoint.enable=false."),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, "must be >= 0 (0 keeps all)", ""),
    ("logging.log_freq", lambda v: v >= 1, "must be >= 1 (steps between metrics records)",
     "For example logging.log_freq=1."),
]
_CHOICES = {
    "optimizer.name": ("Adam", "AdamW"),  # torchtitan's factories that take apiary's betas / eps / weight_decay
    "lr.decay_type": ("linear", "sqrt", "cosine"),
    "preflight.memory": ("refuse", "warn", "off"),
    "training.autotune_configs": ("recorded", "all"),
}


def _check_values(cfg) -> None:
    """Numbers out of range and names outside their set, each named by its key."""
    for key, ok, rule, fix in _RANGES:
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            raise UserError(f"{key}={value}", f"{rule}.", fix)
    for key, names in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in names:
            raise UserError(f"{key}={value}", f"unknown; valid: {', '.join(names)}.", did_you_mean(str(value), names))


def _check_inputs(cfg, for_training: bool) -> None:
    if cfg.training.dtype not in ("bfloat16", "float32"):
        raise UserError(f"training.dtype={cfg.training.dtype}", "must be bfloat16 or float32.")
    if cfg.training.on_nonfinite not in ("stop", "skip"):
        raise UserError(f"training.on_nonfinite={cfg.training.on_nonfinite}", "must be stop or skip.",
                        "stop: exit 76 at the first NaN/Inf loss or grad norm; skip: skip that update "
                        "(at most training.max_skips in a row).")
    if cfg.training.max_skips < 0:
        raise UserError(f"training.max_skips={cfg.training.max_skips}", "must be >= 0 (0: the first "
                        "non-finite step stops the run, as on_nonfinite=stop).")
    if not for_training:
        return
    ck = cfg.checkpoint
    if ck.create_seed and (world_size_from(cfg) != 1 or not ck.enable):
        raise UserError("checkpoint.create_seed=true", "a seed checkpoint is written by one process with "
                        "checkpointing enabled.", "Run it without nproc/torchrun and with checkpoint.enable=true.")
    if ck.load_path is not None and not (Path(ck.load_path) / ".metadata").is_file():
        raise UserError(f"checkpoint.load_path={ck.load_path}", "is not a DCP checkpoint folder (no .metadata).",
                        "Point it at a step folder, e.g. runs/X/checkpoint/step-0.")
    if ck.load_path is not None:
        problem = integrity.verify(Path(ck.load_path))
        if problem is not None:
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"{Path(ck.load_path) / problem[0]} "
                            f"{problem[1]}: the checkpoint is corrupt.", "Point it at an intact step folder.")


def resolve(recipe: str | None, overrides: list[str], *, world_size: int | None = None,
            for_training: bool = True) -> Resolved:
    cfg = recipes.load(recipe, overrides)
    _check_values(cfg)
    ctx = context(cfg, for_training)
    facts = model_facts(cfg, ctx)
    _check_inputs(cfg, for_training)
    world = world_size if world_size is not None else world_size_from(cfg, for_training)
    layout = derive(cfg.parallel, cfg.training, cfg.layout, facts, world)
    ctx.facts, ctx.layout = facts, layout
    check_components(ctx)
    check_rl_keys(ctx)
    grad_accum = check_batch(cfg.training, layout)
    OmegaConf.set_struct(cfg, False)
    for dim, value in layout.dims.items():
        cfg.parallel[dim] = value
    resume_lines, step = [], None
    if for_training:
        step = _check_outputs(cfg)
        _check_writable(cfg)
    _check_publish(cfg, ctx, layout, for_training)
    OmegaConf.set_struct(cfg, True)
    if for_training and step is not None:  # what this resume loads and what changed since the last launch
        resume_lines = resume.check(cfg, Path(cfg.output_dir), step).lines(cfg.output_dir)
    r = Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=grad_accum,
                 data_summary="\n".join(ctx.summary), ctx=ctx, resume_lines=resume_lines)
    if for_training:
        check_memory(r, recipe, overrides, resolve)
    return r
