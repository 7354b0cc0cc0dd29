"""Recipe -> resolved run: typed config, model facts, derived layout, output paths.

Everything here runs before any worker is spawned and turns bad input into UserError.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import yaml
from omegaconf import DictConfig, OmegaConf

from framework import contracts, integrity, paths, recipes, registry, resume, schema
from framework.errors import UserError, did_you_mean
from framework.layout import Layout, check_batch, derive
from framework.preflight import check_memory, choose_by_budget


@dataclass
class Resolved:
    cfg: DictConfig  # composed recipe, derived dims filled in
    facts: object  # the model family's facts (ModelFamily.facts)
    layout: Layout
    grad_accum: int
    data_summary: str = ""  # what the run trains on (printed first by rank 0)
    resume_lines: list = field(default_factory=list)  # a resume: the step it loads, what changed (printed next)
    ctx: contracts.Context | None = None  # the components' context (check ran with it; build applies with it)
    given_parallel: dict = field(default_factory=dict)  # the parallel section as composed, before derivation
    launch: dict | None = None  # {"recipe": as given, "overrides": [...]}: what a resume keeps (resume.LAUNCHES)

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


def _check_members(kind: str, name: str, component) -> None:
    """A component (a user's, typically) lacks a required member of its kind's contract: one
    paragraph, not an AttributeError in a worker. Optional members (``contracts.OPTIONAL_MEMBERS``:
    NUMERICS, plan_terms, hf_writer, ...) may be left out; ``contracts.member`` gives their default."""
    missing = contracts.missing_members(kind, component)
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
    for page in (contracts.member(component, kind, "SKILL") if component is not None else None, name, kind):
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
    except UserError:
        raise
    except Exception as e:  # a user's component failing in its own code: its error, where it was raised
        source = registry.entries().get(kind, {}).get(name, {}).get("source", "registry.yaml")
        if source == "registry.yaml":
            raise
        import traceback  # the user's frame only on this path

        frames = traceback.extract_tb(e.__traceback__)
        at = next((f for f in reversed(frames) if not f.filename.startswith(str(registry.CODE_ROOT))), frames[-1])
        raise UserError(_where(kind, name), f"{kind} {name!r} (bound by {source}) raised {type(e).__name__}: "
                        f"{e} (at {at.filename}:{at.lineno}, in {at.name}).",
                        "Fix the component's code there; a value it refuses is a ValueError, which apiary "
                        "reports as the component's one-line reason.") from None


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
    except contracts.ModelTypeNotRead as e:
        raise contracts.ModelTypeNotRead(e.where, e.model_type, e.family, _reading_family(e.model_type)) from None
    except TypeError as e:
        if opts.hf_checkpoint and "hf_checkpoint" in str(e):
            raise UserError(f"model.hf_checkpoint={opts.hf_checkpoint}",
                            f"model.family={opts.family} does not load HF checkpoints.",
                            "Drop model.hf_checkpoint, or use a family that loads them "
                            "(`apiary ls` lists the families).") from None
        raise


def _reading_family(model_type: str) -> str:
    """The fix for a config.json of ``model_type`` given to a family that does not read it: the
    registry's family whose ``HF_MODEL_TYPES`` holds it, else the model types apiary reads."""
    other = registry.family_of(model_type)
    if other is None:
        known = [t for f in registry.names("model")
                 for t in contracts.member(registry.resolve("model", f), "model", "HF_MODEL_TYPES")]
        return f"apiary's model families read model_type {', '.join(known)} checkpoints."
    flavors = list(registry.resolve("model", other).FLAVORS)
    return (f"Set model.family={other} model.flavor={flavors[0]} (with hf_checkpoint the flavor only supplies "
            "defaults; the architecture comes from config.json).")


def check_components(ctx: contracts.Context) -> None:
    """Every kind's ``check(options, ctx)``, in ``contracts.KINDS`` order, before any worker starts."""
    for kind in contracts.KINDS:
        with _as_user_error(kind, ctx.choice(kind), ctx.components[kind]):
            ctx.components[kind].check(ctx.options[kind], ctx)


# rl.* settings that act through the loss (the policy losses): (key, set?). A loss component lists the
# ones it acts on in ``RL_KEYS``; one set with a loss that does not act on it is refused, never ignored.
_RL_LOSS_KEYS = (("tis_cap", lambda v: v is not None),
                 ("mismatch_threshold", lambda v: v != schema.RLConfig.mismatch_threshold))  # set: not its default


def check_rl_keys(ctx: contracts.Context) -> None:
    """``rl.tis_cap`` / ``rl.mismatch_threshold`` set with a loss whose ``RL_KEYS`` lacks them: exit 2."""
    section = ctx.cfg.get("rl") if hasattr(ctx.cfg, "get") else None
    if section is None:
        return
    name = ctx.choice("loss")
    acts_on = contracts.member(ctx.components["loss"], "loss", "RL_KEYS")
    for key, is_set in _RL_LOSS_KEYS:
        value = section.get(key)
        if is_set(value) and key not in acts_on:
            raise UserError(f"rl.{key}={value}", f"acts through an RL policy loss; loss={name} does not use it, "
                            "so it would be ignored.",
                            f"Choose an RL policy loss (`apiary ls` lists the losses), or drop rl.{key}. "
                            "See docs/skills/tis.md.")


def _world_size_env() -> int | None:
    """WORLD_SIZE as a launcher (torchrun) sets it for the ranks it starts; None when unset. A value that is
    no rank count, or a launcher's variables left in a shell without the launcher, stop here: the run would
    be laid out for ranks that never come and wait for them."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return None
    n = int(raw) if raw.strip().isdigit() else 0
    if n < 1:
        raise UserError(f"WORLD_SIZE={raw}", "(an environment variable) must be a whole number >= 1: the number of "
                        "ranks the launcher (torchrun) started.", "Unset it (`unset WORLD_SIZE`) and choose the "
                        "ranks with nproc=N, or start them with torchrun (docs/launching.md).")
    if n > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        if "RANK" not in os.environ:
            raise UserError(f"WORLD_SIZE={raw}", f"is set in the environment without RANK, so no launcher started "
                            f"this process as one of {n} ranks: the variable is left over (a torchrun or batch "
                            f"shell, an export); the run would be laid out for {n} ranks and wait for the others.",
                            "Unset it (`unset WORLD_SIZE`); nproc=N starts N ranks here (docs/launching.md).")
        if not os.environ.get("MASTER_PORT"):  # (MASTER_ADDR defaults to this host: framework/run.py)
            raise UserError(f"RANK={os.environ['RANK']} WORLD_SIZE={raw}", f"make this process one of {n} ranks, "
                            "but MASTER_PORT is not set, so it cannot meet the others: a launcher's variables left "
                            "in this shell?", "Unset RANK and WORLD_SIZE and start the ranks with nproc=N or "
                            "torchrun; a launcher of your own sets MASTER_ADDR and MASTER_PORT for every rank.")
    return n


def _check_environment() -> None:
    """The environment variables apiary reads, before anything else: APIARY_DEVICE, WORLD_SIZE."""
    device = os.environ.get("APIARY_DEVICE", "")
    if device not in ("", "cpu"):
        raise UserError(f"APIARY_DEVICE={device}", "(an environment variable) is unknown; apiary reads one value, "
                        "APIARY_DEVICE=cpu (run on the CPU even where a GPU is visible). Any other value would be "
                        "ignored.", "Unset it (`unset APIARY_DEVICE`) to use the GPU when there is one, or set "
                        "APIARY_DEVICE=cpu.")
    _world_size_env()


def world_size_from(cfg, for_training: bool = True) -> int:
    """The real world size when launching; the recipe's intended GPU count when only printing."""
    env = _world_size_env()
    if env is not None:
        return env
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
        if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
            raise UserError(f"output_dir={cfg.output_dir}", f"is {_what_is(Path(cfg.output_dir))}, not a folder, so "
                            "it holds no run to resume.", "Pass output_dir=PATH of the run's folder "
                            "(runs/RECIPE/TIMESTAMP).")
        step = integrity.check_resume(Path(cfg.output_dir), ck.load_step, "checkpoint.resume=true",  # exit 2 if corrupt
                                      verify_manifest=bool(ck.verify))  # or unverifiable
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
            raise UserError(f"output_dir={cfg.output_dir}", f"is {_what_is(Path(cfg.output_dir))}, not a folder; "
                            "the run writes config.yaml, metrics.jsonl and checkpoints into a folder there.",
                            "Choose another output_dir (a new or empty folder).")
        elif _any_step_dir(Path(cfg.output_dir)):
            raise UserError(f"output_dir={cfg.output_dir}", "already holds checkpoints of an earlier run; a fresh "
                            "run would load or overwrite them.", "Pass checkpoint.resume=true to continue it, or "
                            "choose another output_dir.")


def _what_is(path: Path) -> str:
    """What a path that is not a folder is, for a message: "an existing file", "a character device"
    (/dev/null), ..."""
    mode = path.stat().st_mode
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "an existing file"


def writable_folder(path, key: str, what: str) -> None:
    """``path`` (or its nearest existing parent) is a folder this process can write; else a UserError
    naming ``key``. ``what`` says what could not be written. The probe (a temporary folder, removed at
    once) leaves nothing behind: os.access alone says yes to root on a read-only mount. The tools'
    output folders (`apiary logprobs --out`, `apiary export --hf`) are checked here too."""
    _check_name_lengths(key, str(path))
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(key, f"{probe} is {_what_is(probe)}, not a folder, so no folder can be made there.",
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
    writable_folder(cfg.output_dir, f"output_dir={cfg.output_dir}", "the run could save no config, metrics or checkpoint")


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
                        "Set publish.interval=0, or add hf_writer to the family (framework/contracts.py "
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
    from framework import publish  # reason: imports torch (a launch imports it anyway: preflight); --cfg never comes here

    others: dict[str, list[str]] = {}
    for v in publish.versions(folder):
        try:
            body = json.loads((folder / f"step-{v}" / publish.VERSION_FILE).read_text())
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
                    f"{publish.VERSION_FILE} names the run {run}{more}, not this one ({out}). Publishing here would "
                    "replace that run's versions and `latest` and prune its newer ones (publish.keep), and a generator "
                    "reading the folder would mix the two runs' weights.", f"Give this run a publish.dir of its own "
                    f"(left out it is OUTPUT_DIR/weights), or delete {folder} if that run's versions are no longer "
                    f"needed; to continue that run, resume it with output_dir={run} checkpoint.resume=true.")


def _check_overlaps(cfg) -> None:
    """The folders a run writes or reads must be apart: publish.dir (with publish.interval > 0), the
    run's checkpoint folder (OUTPUT_DIR/checkpoint, with checkpoint.enable) and data.path. Equal, or
    one inside the other, is refused (exit 2): published versions and checkpoints share the step-N
    names (a publish.keep prune deleted checkpoints, a republication replaced one, `latest` named a
    DCP folder), and a data folder holding either would be read, written and pruned together."""
    def where(path) -> Path:
        return Path(os.path.expanduser(str(path))).absolute().resolve()

    out = Path(str(cfg.output_dir))
    folders = []  # (name, the key to change, its folder, what it holds)
    if cfg.publish.interval > 0:
        pub = cfg.publish.dir if cfg.publish.dir is not None else out / "weights"
        folders.append(("publish", f"publish.dir={pub}", where(pub), "the published weights"))
    if cfg.checkpoint.enable:
        folders.append(("checkpoint", f"output_dir={cfg.output_dir}", where(out / "checkpoint"),
                        "the run's checkpoints"))
    if cfg.data.path is not None:
        folders.append(("data", f"data.path={cfg.data.path}", where(cfg.data.path), "the training data"))
    why = {("publish", "checkpoint"): "published versions and checkpoints would share the step-N names: pruning "
                                      "versions (publish.keep) would delete checkpoints, republishing a version "
                                      "would replace a checkpoint, and `latest` could name a checkpoint",
           ("publish", "data"): "publication would write and prune its step-N folders among the data, and the data "
                                "would be read together with the published files",
           ("checkpoint", "data"): "the checkpoints' files would be read as data, and saving and pruning "
                                   "checkpoints would write and delete among the data"}
    for i, (name_a, key_a, a, what_a) in enumerate(folders):
        for name_b, key_b, b, what_b in folders[i + 1:]:
            if a == b:
                how = f"{a} would hold both {what_a} and {what_b}"
            elif b in a.parents:
                how = f"{what_a} would go in {a}, inside {b}, which holds {what_b}"
            elif a in b.parents:
                how = f"{what_b} would go in {b}, inside {a}, which holds {what_a}"
            else:
                continue
            raise UserError(f"{key_a} {key_b}", f"{how}; {why[name_a, name_b]}.",
                            f"Keep them apart: point {key_a.split('=')[0]} or {key_b.split('=')[0]} elsewhere "
                            "(publish.dir left out is OUTPUT_DIR/weights; the checkpoints are OUTPUT_DIR/checkpoint).")


_MAX_STEPS = 2 ** 63 - 1  # torch's int64: the step counters a checkpoint and the LR scheduler keep
# Values every recipe must keep in range: (key, test, rule, fix). Checked before anything starts.
_RANGES = [
    ("training.steps", lambda v: 1 <= v <= _MAX_STEPS, "must be >= 1 and at most 2**63-1 (the largest step a "
     "checkpoint records)", "Set training.steps to the number of optimizer steps."),
    ("training.seq_len", lambda v: v >= 2, "must be >= 2 (a token and its next)", "For example training.seq_len=256."),
    ("training.local_batch", lambda v: v >= 1, "must be >= 1", "For example training.local_batch=2."),
    ("training.global_batch", lambda v: v is None or v >= 1, "must be >= 1 (or null: local x data-parallel)", ""),
    ("training.max_norm", lambda v: v > 0, "must be > 0 (gradients are clipped to this norm; 0 would zero "
     "every gradient)", "To clip nothing, set training.max_norm=inf."),
    ("optimizer.lr", lambda v: v >= 0 and v != float("inf"), "must be a finite number >= 0 (0: a control run "
     "whose weights never change)", "For example optimizer.lr=3e-4."),
    ("optimizer.weight_decay", lambda v: 0 <= v < float("inf"), "must be a finite number >= 0 (inf would make "
     "the weights infinite at the first step)", "For example optimizer.weight_decay=0.1; 0 for none."),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.eps", lambda v: 0 < v < float("inf"), "must be a finite number > 0 (inf divides every update "
     "to 0: nothing would train)", "For example optimizer.eps=1e-8."),
    ("moe.load_balance_coeff", lambda v: v is None or 0 < v < float("inf"), "must be > 0 and finite (the step "
     "of the MoE routing bias that balances the experts' load)",
     "To turn the balancing off, set moe.load_balance_coeff=null."),
    ("lr.warmup_steps", lambda v: v >= 0, "must be >= 0", "Set 0 for no warm-up."),
    ("lr.decay_ratio", lambda v: v is None or 0 <= v <= 1, "must be in [0, 1] (or null)", ""),
    ("lr.min_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]", ""),
    ("lr.total_steps", lambda v: v is None or 1 <= v <= _MAX_STEPS, "must be >= 1 and at most 2**63-1 (the "
     "steps the schedule spans) or null (training.steps)", ""),
    ("checkpoint.interval", lambda v: v >= 1, "must be >= 1 (steps between saves)",
     "To save no checkpoints, set checkpoint.enable=false."),
    ("checkpoint.keep_latest_k", lambda v: v == 0 or v >= 2, "must be 0 (keep all) or >= 2 (the newest steps "
     "kept; torchtitan keeps at least 2, as the last may still be being written)", "For example "
     "checkpoint.keep_latest_k=2."),
    ("model.vocab_size", lambda v: v is None or v >= 2, "must be >= 2 (the token ids the model predicts among) or "
     "null (the flavor's)", "Leave it out for the flavor's vocabulary, or give the tokenizer's size."),
    ("logging.log_freq", lambda v: v >= 1, "must be >= 1 (steps between metrics records)",
     "For example logging.log_freq=1."),
    ("training.seed", lambda v: -2 ** 63 <= v <= 2 ** 64 - 1, "must be an integer from -2**63 to 2**64-1 (the "
     "range torch.manual_seed accepts)", "For example training.seed=42."),
    ("parallel.gpus", lambda v: v is None or v >= 1, "must be >= 1 (the GPU count the recipe is laid out for) or "
     "null", ""),
    ("parallel.dp_replicate", lambda v: v >= 1, "must be >= 1 (the replicated copies of the model; 1: none)",
     "For example parallel.dp_replicate=1."),
    *((f"parallel.{dim}", lambda v: v is None or v >= 1, "must be >= 1 (a parallel degree; 1: not split that "
       "way), or null to derive it from the layout table", f"For example parallel.{dim}=1, or ~parallel.{dim}.")
      for dim in ("dp_shard", "cp", "ep", "pp", "tp")),
    ("parallel.pp_microbatch_size", lambda v: v >= 1, "must be >= 1 (sequences per pipeline microbatch)",
     "For example parallel.pp_microbatch_size=1."),
]
# torch.distributed.pipelining's schedule names (get_schedule_class; matched without case, as there);
# checked whatever parallel.pp (tests/test_bad_inputs_config.py compares the list with torch's)
PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                "DualPipeV")


def _check_values(cfg) -> None:
    """Numbers out of range and names outside their set, each named by its key."""
    for key, ok, rule, fix in _RANGES:
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            raise UserError(f"{key}={value}", f"{rule}.", fix)
    for key, names in schema.choices().items():  # the schema's one_of keys
        value = OmegaConf.select(cfg, key)
        if value not in names:
            raise UserError(f"{key}={value}", f"unknown; valid: {', '.join(names)}.", did_you_mean(str(value), names))
    schedule = str(cfg.parallel.pp_schedule)
    if schedule.lower() not in {s.lower() for s in PP_SCHEDULES}:
        raise UserError(f"parallel.pp_schedule={schedule}", f"unknown pipeline schedule; valid: "
                        f"{', '.join(PP_SCHEDULES)} (read only with parallel.pp > 1).",
                        did_you_mean(schedule, PP_SCHEDULES) or "The default is 1F1B.")
    if cfg.output_dir is not None and not str(cfg.output_dir).strip():
        raise UserError("output_dir=", "is empty, which names the current folder: the run would write its "
                        "config, metrics and checkpoints among the files there.",
                        "Name a folder (output_dir=runs/my_run), or leave output_dir out for "
                        "runs/RECIPE/TIMESTAMP.")


# Keys naming a file or folder (null: off or the default), with what null means. A `~` at the start is
# this user's home folder (the shell leaves `key=~/x` as it is); an empty value names nothing.
_PATH_KEYS = {
    "model.hf_checkpoint": "the flavor's architecture, initialised from training.seed",
    "data.path": "data.name's source",
    "data.tokenizer": "the byte-level tokenizer",
    "validation.path": "no held-out files",
    "publish.dir": "OUTPUT_DIR/weights",
    "checkpoint.load_path": "start from initialised weights",
    "training.kernel_cache": "Triton's and inductor's own caches",
}


NAME_MAX, PATH_MAX = 255, 4096  # bytes: a file name, a whole path (Linux; the OS refuses longer with ENAMETOOLONG)


def _check_name_lengths(key: str, value: str) -> None:
    """A path whose file name or whole length the OS refuses: one paragraph, not an OSError traceback."""
    long = [part for part in Path(value).parts if len(part.encode()) > NAME_MAX]
    if long:
        raise UserError(f"{key}={value[:60]}...", f"names a file or folder of {len(long[0].encode())} bytes "
                        f"({long[0][:40]}...); the file system takes at most {NAME_MAX} bytes per name.",
                        f"Use a shorter name (or nest folders: a/b/c) for {key}.")
    if len(value.encode()) >= PATH_MAX:
        raise UserError(f"{key}={value[:60]}...", f"is {len(value.encode())} bytes long; the OS takes paths of "
                        f"fewer than {PATH_MAX} bytes.", f"Use a shorter path for {key}.")


def _check_paths(cfg) -> None:
    """An empty path, or an empty data.name, is refused (it named the current folder, or fell back to
    a default, silently); ``~/...`` is expanded (what the training processes read too)."""
    for key, null_means in _PATH_KEYS.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        if not str(value).strip():
            default = "byte" if key == "data.tokenizer" else "null"
            raise UserError(f"{key}=", "is empty: it names no file or folder.",
                            f"Give a path, or {key}={default} ({null_means}).")
        if str(value).startswith("~"):
            OmegaConf.update(cfg, key, os.path.expanduser(str(value)))
    for key in ("output_dir", *_PATH_KEYS):
        value = OmegaConf.select(cfg, key)
        if value is not None:
            _check_name_lengths(key, str(value))
    if not str(cfg.data.name).strip():
        raise UserError("data.name=", "is empty: it names no source of text.", "Use data.name=packaged (the packaged "
                        "corpus), data.name=local with data.path=PATH, or a HuggingFace dataset name.")


# the values wandb's Settings.mode accepts (wandb 0.31); another one fails to create the logger in the
# worker, and the run trained on without it
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")


def _check_inputs(cfg, for_training: bool) -> None:
    mode = os.environ.get("WANDB_MODE")
    if cfg.logging.wandb and mode is not None and mode not in WANDB_MODES:
        known = ", ".join(WANDB_MODES)
        raise UserError(f"WANDB_MODE={mode}", f"(an environment variable) is not a mode wandb knows ({known}): "
                        "logging.wandb=true would fail to create its logger and the run would train unlogged.",
                        "Set WANDB_MODE=online, offline or disabled, or unset it (without WANDB_API_KEY apiary "
                        "logs offline).")
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
        if ck.verify and not (Path(ck.load_path) / integrity.MANIFEST).is_file():
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"has no {integrity.MANIFEST}, so it cannot be "
                            "verified: every step apiary saves (a seed checkpoint too) gets one as it completes; a "
                            "step without one lost it afterwards, or was written by another program or a version "
                            "before manifests.", "Point it at an intact apiary step folder; or, if you know this one "
                            "is intact, load it unverified with checkpoint.verify=false.")
        problem = integrity.verify(Path(ck.load_path))
        if problem is not None:
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"{Path(ck.load_path) / problem[0]} "
                            f"{problem[1]}: the checkpoint is corrupt.", "Point it at an intact step folder.")


def _check_warmup(cfg, overrides: list[str], ctx: contracts.Context) -> None:
    """lr.warmup_steps must be shorter than the schedule (lr.total_steps, else training.steps): a warm-up
    that never ends never reaches optimizer.lr. One case is shortened instead, and the run's first lines
    say so: a schedule cut short on the command line (training.steps=N or lr.total_steps=N: a smoke test,
    a benchmark, the resume command a finished run prints) below the warm-up the recipe sets."""
    warmup, total = int(cfg.lr.warmup_steps), resume.horizon(cfg)
    if warmup < total:
        return
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    horizon_key = "lr.total_steps" if cfg.lr.total_steps is not None else "training.steps"
    if horizon_key in given and "lr.warmup_steps" not in given:
        used = resume.warmup_steps(cfg)
        ctx.summary.append(f"lr: warm-up shortened to {used} step{'s' if used != 1 else ''} (lr.warmup_steps="
                           f"{warmup} is not shorter than {horizon_key}={total}, the schedule's length); set "
                           "lr.warmup_steps or lr.total_steps to choose another")
        return
    raise UserError(f"lr.warmup_steps={warmup}", f"is not shorter than the learning-rate schedule ({horizon_key}="
                    f"{total}): the warm-up would never end, and optimizer.lr would never be reached.",
                    f"Lower it below {total} (e.g. lr.warmup_steps={total // 5}); or, if resumes will extend this "
                    "run, give the whole schedule now with lr.total_steps=N (N > the warm-up; "
                    "docs/skills/resume.md).")


# Settings that act only with another one: (key, the setting it needs, is that setting off?, what the key does).
# Given on the command line while the other is off, the key would be ignored: refused. (A recipe may keep
# such a value for the times the other is on: `train recipe=R checkpoint.enable=false` is not refused for
# the recipe's checkpoint.interval.)
def _in_memory(cfg) -> bool:
    """Whether publish.transport hands weights over in memory (its component's ``IN_MEMORY``)."""
    name = str(cfg.publish.transport)
    return bool(contracts.member(registry.resolve("transport", name, where=f"publish.transport={name}"),
                                 "transport", "IN_MEMORY"))


_NEEDS = [
    ("training.max_skips", "training.on_nonfinite=skip", lambda c: c.training.on_nonfinite != "skip",
     "how many non-finite steps in a row are skipped before the run stops"),
    ("data.wait_timeout", "data.follow=true", lambda c: not c.data.follow,
     "how long a followed folder may stay without new records"),
    ("data.name", "data.follow=false", lambda c: bool(c.data.follow),
     "the dataset a run reads when it does not follow a folder (a followed folder is read from data.path alone)"),
    ("validation.steps", "validation.interval=N", lambda c: c.validation.interval == 0,
     "the batches of each validation pass"),
    *((f"publish.{k}", "publish.interval=N", lambda c: c.publish.interval == 0, what) for k, what in (
        ("dir", "where published weights go"), ("keep", "how many published versions stay"),
        ("background", "how published weights are written"), ("dtype", "the dtype of published weights"),
        ("transport", "how published weights reach the generator"))),
    *((f"publish.{k}", "an in-memory publish.transport", lambda c: not _in_memory(c), what) for k, what in (
        ("engine", "where the trainer listens for the engine"), ("bucket_mb", "the size of a transfer bucket"),
        ("engine_timeout", "how long the trainer waits for the engine"))),
    *((f"checkpoint.{k}", "checkpoint.enable=true", lambda c: not c.checkpoint.enable, what) for k, what in (
        ("interval", "the steps between saves"), ("keep_latest_k", "how many saved steps stay"),
        ("model_only_last", "what the last save holds"))),
    ("logging.wandb_project", "logging.wandb=true", lambda c: not c.logging.wandb,
     "the W&B project the metrics go to"),
    ("parallel.pp_microbatch_size", "parallel.pp=N (N > 1)",
     lambda c: int(c.parallel.pp if c.parallel.pp is not None else c.layout.pp) == 1,
     "the sequences per pipeline microbatch"),
]


def _check_no_effect(cfg, overrides: list[str], ctx: contracts.Context) -> None:
    """Every setting takes effect or is refused: what would load nothing, resume nothing or be ignored."""
    ck, given = cfg.checkpoint, {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    own_load = ctx.shared.get("checkpoint.load_path reader")  # a component that loads it itself (its check says)
    if ck.load_path is not None and not ck.enable and not own_load:
        raise UserError(f"checkpoint.load_path={ck.load_path} with checkpoint.enable=false", "with checkpointing off "
                        "nothing is loaded: the run would start from initialised weights, not from that step.",
                        "Drop checkpoint.enable=false (set checkpoint.interval above training.steps to save only "
                        "the last step), or drop checkpoint.load_path.")
    if ck.resume and not ck.enable:
        raise UserError("checkpoint.resume=true with checkpoint.enable=false", "with checkpointing off nothing is "
                        "loaded: the run would start over at step 1 in the run's folder (its records of those steps "
                        "moved aside) instead of continuing it.", "Drop checkpoint.enable=false.")
    if ck.resume and ck.create_seed:
        raise UserError("checkpoint.create_seed=true with checkpoint.resume=true", "a seed checkpoint is the step-0 "
                        "weights of a new run (written, then the process exits); it cannot continue a run, and "
                        "would be written into the run's checkpoints.", "Drop one of them: create the seed in a new "
                        "output_dir.")
    for key, needs, off, what in _NEEDS:
        if key in given and off(cfg):
            raise UserError(f"{key}={OmegaConf.select(cfg, key)}", f"sets {what}, which acts only with {needs}, "
                            "and this run does not have it, so the setting would be ignored.",
                            f"Add {needs}, or drop {key}.")
    _check_ignored_data_keys(cfg, given, ctx)
    model = cfg.model
    if "model.flavor" in given and model.get("hf_checkpoint") and ctx.facts is not None:
        mod = ctx.components["model"]
        flavor_moe = bool(mod.facts(model.flavor).num_experts)
        if flavor_moe != bool(ctx.facts.num_experts):
            kinds = ("an MoE", "a dense") if flavor_moe else ("a dense", "an MoE")
            raise UserError(f"model.flavor={model.flavor} with model.hf_checkpoint={model.hf_checkpoint}",
                            f"the flavor is {kinds[0]} model, and the checkpoint's config.json describes {kinds[1]} "
                            "one, which is what would load (with hf_checkpoint the architecture comes from "
                            "config.json; the flavor only supplies defaults).",
                            "Drop model.flavor, or point model.hf_checkpoint at the model you mean.")
    if ctx.facts is not None and not ctx.facts.num_experts:
        for key in ("moe.chunk", "moe.comm", "moe.load_balance_coeff"):
            if key in given:
                raise UserError(f"{key}={OmegaConf.select(cfg, key)}", f"{ctx.facts.family} {ctx.facts.flavor} is a "
                                "dense model: it has no MoE layers, so the setting would be ignored.",
                                f"Drop {key}, or choose an MoE flavor.")


def _check_ignored_data_keys(cfg, given: set[str], ctx: contracts.Context) -> None:
    """A ``data.*`` key given on the command line that the data format declares it does not read
    (its ``ignored_keys``) is refused; the recipe's own value of it stays accepted."""
    data = ctx.components.get("data")
    ignored = contracts.member(data, "data", "ignored_keys") if data is not None else None
    if ignored is None:
        return
    section, key = contracts.SELECT["data"]
    for name, (instead, fix) in ignored(ctx.options["data"], ctx).items():
        if name in given:
            raise UserError(f"{name}={OmegaConf.select(cfg, name)} with {section}.{key}={ctx.choice('data')}",
                            f"this data format does not read {name}: {instead}, so the setting would be ignored.",
                            fix or f"Drop {name}.")


def _check_resume_load_path(cfg, ctx: contracts.Context, plan) -> None:
    """A resume loads the run's own step, so a checkpoint.load_path other than the one the run was launched
    with would be ignored (the same one, as the resume command a run prints repeats it, is harmless)."""
    if ctx.shared.get("checkpoint.load_path reader"):  # a component that loads it itself, resumed or not
        return
    changed = [(a, b) for key, a, b in plan.changes if key == "checkpoint.load_path" and b is not None]
    if changed:
        before, now = changed[0]
        raise UserError(f"checkpoint.resume=true with checkpoint.load_path={now}", "both name what to load: a resume "
                        "loads the run's own latest step (checkpoint.load_step picks another of its steps), so "
                        "checkpoint.load_path would be ignored (the run was launched "
                        f"{'without one' if before is None else f'with {before}'}).",
                        "Drop checkpoint.load_path to continue the run; or, to start a new run from those weights, "
                        "drop checkpoint.resume and output_dir.")


def _check_decay(cfg, overrides: list[str], ctx: contracts.Context) -> None:
    """lr.decay_ratio: warm-up and decay must fit the schedule, else torchtitan shortens the decay (a
    warning in its log). A schedule cut short on the command line (a smoke test) is shortened, and said."""
    ratio = cfg.lr.decay_ratio
    if ratio is None:
        return
    total, warmup = resume.horizon(cfg), resume.warmup_steps(cfg)
    decay = round(total * float(ratio))
    if warmup + decay <= total:
        return
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    horizon_key = "lr.total_steps" if cfg.lr.total_steps is not None else "training.steps"
    if horizon_key in given and not given & {"lr.decay_ratio", "lr.warmup_steps"}:
        ctx.summary.append(f"lr: decay shortened to {total - warmup} steps (lr.decay_ratio={ratio} of {horizon_key}="
                           f"{total} is {decay} steps, after {warmup} of warm-up)")
        return
    raise UserError(f"lr.decay_ratio={ratio}", f"decays over {decay} of the schedule's {total} steps ({horizon_key}), "
                    f"and lr.warmup_steps={warmup} warm up first: {warmup + decay} steps do not fit in {total}, so "
                    "the decay would be cut short.", f"Use lr.decay_ratio <= {int((total - warmup) / total * 1000) / 1000:g} "
                    "or fewer lr.warmup_steps.")


def resolve(recipe: str | None, overrides: list[str], *, world_size=None, for_training: bool = True) -> Resolved:
    """The run ``train recipe overrides`` describes, every check done (a UserError: exit 2). ``world_size``:
    the ranks to lay it out for (an int, or a function of the composed config); None: the launcher's."""
    _check_environment()
    cfg = recipes.load(recipe, overrides)
    kept = resume.kept_overrides(cfg.output_dir or latest_run_dir(cfg.recipe), overrides) \
        if for_training and cfg.checkpoint.resume else []
    if kept:  # a resume keeps the launch's overrides, unless given again
        overrides = [*kept, *overrides]
        cfg = recipes.load(recipe, overrides)
    _check_values(cfg)
    _check_paths(cfg)
    ctx = context(cfg, for_training)
    facts = model_facts(cfg, ctx)
    _check_inputs(cfg, for_training)
    world = world_size_from(cfg, for_training) if world_size is None else \
        int(world_size(cfg)) if callable(world_size) else world_size
    layout = backend_layout(ctx, derive(cfg.parallel, cfg.training, cfg.layout, facts, world))
    ctx.facts, ctx.layout = facts, layout
    check_components(ctx)
    check_rl_keys(ctx)
    _check_warmup(cfg, overrides, ctx)
    _check_no_effect(cfg, overrides, ctx)
    _check_decay(cfg, overrides, ctx)
    resume.check_tail(cfg)
    grad_accum = check_batch(cfg.training, layout, cfg.parallel)
    given_parallel = OmegaConf.to_container(cfg.parallel)
    OmegaConf.set_struct(cfg, False)
    for dim, value in layout.dims.items():
        cfg.parallel[dim] = value
    resume_lines, step = [], None
    if for_training:
        step = _check_outputs(cfg)
        _check_writable(cfg)
    _check_publish(cfg, ctx, layout, for_training)
    if for_training:
        _check_overlaps(cfg)
    paths.absolute_in(cfg)  # stored absolute (framework/paths.py); every check above read them as given
    OmegaConf.set_struct(cfg, True)
    if for_training and step is not None:  # what this resume loads and what changed since the last launch
        plan = resume.check(cfg, Path(cfg.output_dir), step)
        _check_resume_load_path(cfg, ctx, plan)
        plan.verified = (Path(cfg.output_dir) / "checkpoint" / f"step-{step}" / integrity.MANIFEST).is_file()
        resume_lines = plan.lines(cfg.output_dir)
        if kept:
            resume_lines.append(f"resume: keeps the last launch's overrides {' '.join(kept)} (give one again to "
                                "change it)")
    r = Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=grad_accum, given_parallel=given_parallel,
                 data_summary="\n".join(ctx.summary), ctx=ctx, resume_lines=resume_lines,
                 launch={"recipe": recipe, "overrides": list(overrides)})
    choose_by_budget(r, for_training)
    r.data_summary = "\n".join(ctx.summary)
    if for_training:
        check_memory(r, recipe, overrides, check_candidate)
    return r


def backend_layout(ctx: contracts.Context, layout: Layout) -> Layout:
    """``layout`` as the chosen state backend runs it (its optional ``layout`` member): the degrees it
    moves, with its reason as their rule. A backend that changes the world size is a framework bug."""
    runs = contracts.member(ctx.components["state"], "state", "layout")
    if runs is None:
        return layout
    dims, reason = runs(ctx.options["state"], dict(layout.dims))
    changed = {d: int(v) for d, v in dims.items() if int(v) != layout.dims[d]}
    if not changed:
        return layout
    if math.prod(int(v) for v in dims.values()) != math.prod(layout.dims.values()) or set(dims) != set(layout.dims):
        raise ValueError(f"the state backend's layout {dims} does not keep the degrees' product of {layout.dims}")
    return dataclasses.replace(layout, **changed, rules={**layout.rules, **{d: reason for d in changed}})


def check_candidate(r: Resolved, dims: dict, choice: dict, world_size: int) -> None:
    """What resolve checks of ``r`` with other layout dims (``parallel.ep=..`` etc.) and other component
    choices (``loss=NAME`` ...: that component's default options), without composing the recipe again:
    the layout's derivation and batch split, every kind's ``check`` and the RL keys, as a print-only
    resolve (``for_training=False``) checks them. A UserError names what the candidate breaks. The
    preflight's and ``apiary plan --search``'s suggestions are checked with it."""
    cfg = copy.deepcopy(r.cfg)
    par = SimpleNamespace(**r.given_parallel)
    for d, v in dims.items():
        setattr(par, d, v)
    OmegaConf.set_struct(cfg, False)
    for kind, name in choice.items():
        section, key = contracts.SELECT[kind]
        if str(cfg[section][key]) != str(name):
            cfg[section] = {key: str(name)}  # another component: its own defaults
    OmegaConf.set_struct(cfg, True)
    ctx = context(cfg, for_training=False)
    layout = backend_layout(ctx, derive(par, cfg.training, cfg.layout, r.facts, world_size))
    check_batch(cfg.training, layout, par)
    OmegaConf.set_struct(cfg, False)
    for d, v in layout.dims.items():
        cfg.parallel[d] = v
    OmegaConf.set_struct(cfg, True)
    ctx.facts, ctx.layout = r.facts, layout
    check_components(ctx)
    check_rl_keys(ctx)


# ----------------------------------------------------------------------------- the hand-off to workers
# The launching process resolves once and writes the result into the run folder; the ranks it starts
# (torchrun under the local launcher) load it instead of composing and checking the recipe again.
RESOLVED_FILE = "resolved.yaml"
ENV_RESOLVED = "APIARY_RESOLVED"  # the file's path, set by the launcher for the ranks it starts
ENV_RESOLVED_SHA256 = "APIARY_RESOLVED_SHA256"  # its digest: a file changed after the launch is refused
_FORMAT = 1


def _json_values(d: dict) -> dict:
    """The entries of ``d`` that a YAML file keeps as they are (ctx.shared: what a check leaves for a
    component's apply is plain data; objects there serve other checks only)."""
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def write_resolved(r: Resolved, argv: list[str]) -> dict[str, str]:
    """Write ``r`` into ``output_dir/resolved.yaml`` for the ranks started with ``train argv``; returns
    the environment variables that hand it to them."""
    out = Path(r.cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = r.ctx
    doc = {"format": _FORMAT, "argv": list(argv), "cfg": OmegaConf.to_container(r.cfg, resolve=False),
           "layout": {"world_size": r.layout.world_size, "dims": r.layout.dims, "rules": dict(r.layout.rules)},
           "grad_accum": int(r.grad_accum), "data_summary": r.data_summary, "resume_lines": list(r.resume_lines),
           "given_parallel": dict(r.given_parallel), "launch": r.launch,
           "derived": dict(ctx.derived) if ctx is not None else {},
           "shared": _json_values(ctx.shared) if ctx is not None else {}}
    text = yaml.safe_dump(doc, sort_keys=False).encode()
    path = out / RESOLVED_FILE
    tmp = path.with_name(f".{RESOLVED_FILE}.tmp")
    tmp.write_bytes(text)
    tmp.replace(path)
    return {ENV_RESOLVED: str(path.resolve()), ENV_RESOLVED_SHA256: hashlib.sha256(text).hexdigest()}


def _handoff_error(path, what: str) -> UserError:
    return UserError(f"{ENV_RESOLVED}={path}", f"{what} This rank was started by `train` (the launching process), "
                     "which resolved the recipe once and wrote that file into the run folder for its ranks; they "
                     "train exactly what it holds and check nothing again.", "Launch the run again with the same "
                     f"`train ...` command (it rewrites the file); do not edit {RESOLVED_FILE}, and unset "
                     f"{ENV_RESOLVED} and {ENV_RESOLVED_SHA256} in a shell that starts its own torchrun.")


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
    world = _world_size_env()
    if world is not None and world != layout.world_size:
        raise _handoff_error(path, f"lays the run out for {layout.world_size} ranks, and this rank is one of {world}.")
    OmegaConf.set_struct(cfg, True)
    ctx = context(cfg, for_training=True)
    facts = model_facts(cfg, ctx)
    ctx.facts, ctx.layout = facts, layout
    ctx.derived.update(doc.get("derived") or {})
    ctx.shared.update(doc.get("shared") or {})
    summary = str(doc.get("data_summary") or "")
    ctx.summary[:] = summary.splitlines()
    return Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=int(doc["grad_accum"]), data_summary=summary,
                    resume_lines=list(doc.get("resume_lines") or []), ctx=ctx,
                    given_parallel=dict(doc.get("given_parallel") or {}), launch=doc.get("launch"))
