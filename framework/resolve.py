"""Recipe -> resolved run: typed config, model facts, derived layout, output paths.

Everything here runs before any worker is spawned and turns bad input into UserError.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from framework import recipes, registry
from framework.errors import UserError, did_you_mean
from framework.layout import Layout, check_batch, derive


@dataclass
class Resolved:
    cfg: DictConfig  # composed recipe, derived dims filled in
    facts: object  # components.models.common.ModelFacts
    layout: Layout
    grad_accum: int
    data_summary: str = ""  # what the run trains on (printed first by rank 0)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)


def model_module(cfg):
    return registry.resolve("model", cfg.model.family, where=f"model.family={cfg.model.family}")


def model_kwargs(cfg) -> dict:
    comm = registry.resolve("moe_comm", cfg.moe.comm, where=f"moe.comm={cfg.moe.comm}")
    kw = dict(attn_backend=cfg.model.attn_backend, moe_comm_backend=comm.torchtitan_backend,
              n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size,
              load_balance_coeff=cfg.moe.load_balance_coeff)
    if cfg.model.hf_checkpoint:
        kw["hf_checkpoint"] = cfg.model.hf_checkpoint
    return kw


def model_facts(cfg):
    mod = model_module(cfg)
    flavors = list(getattr(mod, "FLAVORS", {}))
    if cfg.model.flavor not in flavors:
        raise UserError(f"model.flavor={cfg.model.flavor}",
                        f"unknown flavor for {cfg.model.family}; known: {', '.join(flavors)}.",
                        did_you_mean(cfg.model.flavor, flavors))
    if cfg.model.n_layers is not None and cfg.model.n_layers < 1:
        raise UserError(f"model.n_layers={cfg.model.n_layers}", "must be >= 1.")
    try:
        return mod.facts(cfg.model.flavor, **model_kwargs(cfg))
    except TypeError as e:
        if cfg.model.hf_checkpoint and "hf_checkpoint" in str(e):
            raise UserError(f"model.hf_checkpoint={cfg.model.hf_checkpoint}",
                            f"model.family={cfg.model.family} does not load HF checkpoints.",
                            "Drop model.hf_checkpoint, or use a family that loads them (qwen3, llama3, qwen3_5).") from None
        raise


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
    from framework.integrity import complete_steps

    return complete_steps(Path(run_dir) / "checkpoint")


def _any_step_dir(run_dir: Path) -> bool:
    """Any checkpoint/step-N folder, complete or not: a fresh run must not overwrite either."""
    from framework.integrity import step_dirs

    return bool(step_dirs(Path(run_dir) / "checkpoint"))


def _check_outputs(cfg) -> None:
    """Resume only from an intact checkpoint; never silently reuse or overwrite one."""
    ck = cfg.checkpoint
    if ck.resume:
        if cfg.output_dir is None:
            latest = latest_run_dir(cfg.recipe)
            if latest is None:
                raise UserError("checkpoint.resume=true", f"no earlier run of {cfg.recipe} with a checkpoint "
                                f"under runs/{cfg.recipe}/.", "Pass output_dir=PATH of the run to continue.")
            cfg.output_dir = str(latest)
        from framework.integrity import check_resume

        step = check_resume(Path(cfg.output_dir), ck.load_step, "checkpoint.resume=true")  # exit 2 if corrupt
        if step >= cfg.training.steps:
            raise UserError("checkpoint.resume=true", f"{cfg.output_dir} is already at step {step} of "
                            f"training.steps={cfg.training.steps}.", "Raise training.steps to train further.")
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


def _check_writable(cfg) -> None:
    """output_dir (or its nearest existing parent) must be a folder this process can write."""
    out = Path(cfg.output_dir).absolute()
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"output_dir={cfg.output_dir}", f"{probe} is a file, so no folder can be made under it.",
                        "Choose another output_dir.")
    try:  # os.access alone says yes to root on a read-only mount
        writable = os.access(probe, os.W_OK | os.X_OK)
        if writable:
            import tempfile

            tempfile.TemporaryDirectory(dir=probe, prefix=".apiary-probe-").cleanup()
    except OSError:
        writable = False
    if not writable:
        raise UserError(f"output_dir={cfg.output_dir}", f"{probe} is not writable by this user, so the run "
                        "could save no config, metrics or checkpoint.",
                        "Choose a writable output_dir, or fix the folder's permissions.")


# Values every recipe must keep in range: (key, test, rule, fix). Checked before anything starts.
_RANGES = [
    ("training.steps", lambda v: v >= 1, "must be >= 1", "Set training.steps to the number of optimizer steps."),
    ("training.seq_len", lambda v: v >= 2, "must be >= 2 (a token and its next)", "For example training.seq_len=256."),
    ("training.local_batch", lambda v: v >= 1, "must be >= 1", "For example training.local_batch=2."),
    ("training.global_batch", lambda v: v is None or v >= 1, "must be >= 1 (or null: local x data-parallel)", ""),
    ("training.max_norm", lambda v: v > 0, "must be > 0 (gradients are clipped to this norm; 0 would zero "
     "every gradient)", "To clip nothing, set training.max_norm=inf."),
    ("optimizer.lr", lambda v: not v <= 0, "must be > 0", "For example optimizer.lr=3e-4."),
    ("optimizer.weight_decay", lambda v: v >= 0, "must be >= 0", ""),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.eps", lambda v: v > 0, "must be > 0", ""),
    ("lr.warmup_steps", lambda v: v >= 0, "must be >= 0", "Set 0 for no warm-up."),
    ("lr.decay_ratio", lambda v: v is None or 0 <= v <= 1, "must be in [0, 1] (or null)", ""),
    ("lr.min_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]", ""),
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
    "data.sharding": ("blocks", "documents"),
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


def _check_group_options(cfg) -> None:
    """A component group's options are checked by its own ``check(options)`` (ValueError: the reason)."""
    for kind in registry.GROUP_KINDS:
        if kind == "state":
            continue  # checked in _check_components with a pointer to its docs
        node = cfg.get(kind)
        comp = registry.resolve(kind, node.name, where=f"{kind}={node.name}")
        if hasattr(comp, "check"):
            try:
                comp.check(node)
            except ValueError as e:
                raise UserError(f"{kind}={node.name}", f"{e}.".replace("..", "."),
                                f"See `apiary show {node.name}` and docs/skills/{node.name}.md.") from None


def _check_components(cfg) -> None:
    """Names that are plain keys (not config groups) must be in registry.yaml and usable here."""
    comm = registry.resolve("moe_comm", cfg.moe.comm, where=f"moe.comm={cfg.moe.comm}")
    comm.check()
    registry.resolve("moe_chunk", cfg.moe.chunk, where=f"moe.chunk={cfg.moe.chunk}").check(
        comm.torchtitan_backend, where=f"moe.chunk={cfg.moe.chunk}")
    state = registry.resolve("state", cfg.state.name, where=f"state={cfg.state.name}")
    if hasattr(state, "check"):
        try:
            state.check(cfg.state)
        except ValueError as e:
            raise UserError(f"state={cfg.state.name}", f"{e}.", "See docs/skills/fsdp2.md and docs/skills/zero1.md "
                            "for each backend's options.") from None


def _check_inputs(cfg, facts, for_training: bool) -> None:
    if cfg.training.dtype not in ("bfloat16", "float32"):
        raise UserError(f"training.dtype={cfg.training.dtype}", "must be bfloat16 or float32.")
    if cfg.data.num_workers not in (0, 1):
        raise UserError(f"data.num_workers={cfg.data.num_workers}", "each rank's loader is one ordered stream "
                        "(text windows or rollout rows dealt in blocks); with more than one worker process "
                        "every worker would produce the same batches and the run would train on repeats.",
                        "Set data.num_workers=1 to load in one background process, or 0 to load in the "
                        "training process.")
    if cfg.training.on_nonfinite not in ("stop", "skip"):
        raise UserError(f"training.on_nonfinite={cfg.training.on_nonfinite}", "must be stop or skip.",
                        "stop: exit 76 at the first NaN/Inf loss or grad norm; skip: skip that update "
                        "(at most training.max_skips in a row).")
    if cfg.training.max_skips < 0:
        raise UserError(f"training.max_skips={cfg.training.max_skips}", "must be >= 0 (0: the first "
                        "non-finite step stops the run, as on_nonfinite=stop).")
    if not for_training:
        return
    limit = getattr(facts, "max_seq_len", 0)
    if limit and cfg.training.seq_len > limit:
        src = (f"max_position_embeddings of {cfg.model.hf_checkpoint}" if cfg.model.hf_checkpoint
               else f"model.flavor={cfg.model.flavor}")
        raise UserError(f"training.seq_len={cfg.training.seq_len}", f"exceeds the model's RoPE length {limit} "
                        f"({src}).", f"Use training.seq_len <= {limit}.")
    why = getattr(model_module(cfg), "unavailable", lambda: None)()
    if why:
        raise UserError(f"model.family={cfg.model.family}", why,
                        "The recipe resolves and prints (`--cfg job`) and plans; pick another family to train now.")
    ck = cfg.checkpoint
    if ck.create_seed and (world_size_from(cfg) != 1 or not ck.enable):
        raise UserError("checkpoint.create_seed=true", "a seed checkpoint is written by one process with "
                        "checkpointing enabled.", "Run it without nproc/torchrun and with checkpoint.enable=true.")
    if ck.load_path is not None and not (Path(ck.load_path) / ".metadata").is_file():
        raise UserError(f"checkpoint.load_path={ck.load_path}", "is not a DCP checkpoint folder (no .metadata).",
                        "Point it at a step folder, e.g. runs/X/checkpoint/step-0.")
    if ck.load_path is not None:
        from framework.integrity import verify

        problem = verify(Path(ck.load_path))
        if problem is not None:
            raise UserError(f"checkpoint.load_path={ck.load_path}", f"{Path(ck.load_path) / problem[0]} "
                            f"{problem[1]}: the checkpoint is corrupt.", "Point it at an intact step folder.")
    d = cfg.data
    _check_rollouts(cfg, facts)
    if d.format == "rollouts":
        return  # rollouts come tokenized
    if d.tokenizer != "byte":
        from components.data.tokenizer import check_hf_tokenizer

        check_hf_tokenizer(str(d.tokenizer), facts.vocab_size)
    elif facts.vocab_size < 258:
        raise UserError("data.tokenizer=byte", f"needs a vocabulary of at least 258; the model has {facts.vocab_size}.",
                        "Set model.vocab_size=320.")


def _check_text_data(cfg) -> str:
    """data.path wins over data.name; every local file parses. Returns the line naming what trains."""
    from components.data.local_text import HUB_FREE_NAMES, PACKAGED_CORPUS, inspect_local, local_data_files

    d = cfg.data
    if d.path is not None and d.name not in HUB_FREE_NAMES:
        raise UserError(f"data.path={d.path} with data.name={d.name}", "both name a source of text (a local path "
                        "and a HuggingFace dataset); apiary will not guess which one you meant.",
                        f"Keep data.path and set data.name=local, or drop data.path to stream {d.name}.")
    if d.path is None and d.name == "local":
        raise UserError("data.name=local", "needs data.path (a jsonl / json / parquet / txt file or a folder of them).",
                        "Set data.path=PATH, or data.name=packaged for the packaged corpus.")
    if d.path is None and d.name not in ("packaged", "", "tiny"):
        return f"data: HuggingFace dataset {d.name} (streamed; size unknown before it is read), tokenizer {d.tokenizer}"
    path = str(PACKAGED_CORPUS) if d.path is None else str(d.path)
    if int(os.environ.get("RANK", "0")) != 0 and local_data_files(path):
        return ""  # a torchrun worker: rank 0 reads every line (and refuses for all); the others start
    try:
        summary = inspect_local(path)
    except ValueError as e:
        msg = str(e)
        if msg.endswith("no such file or folder"):
            msg = "no jsonl, json, parquet or txt file there (nothing at that path)"
        raise UserError(f"data.path={d.path}", f"{msg}.", "Fix the file or point data.path at another "
                        "(jsonl/json: one JSON object with a string 'text' per line; txt: UTF-8, a document "
                        "per line; parquet: a 'text' column).") from None
    kind = "packaged" if d.path is None else "local"
    return f"data: {summary.describe(kind, d.tokenizer)}, tokenizer {d.tokenizer}"


def _check_rollouts(cfg, facts) -> None:
    """data.format and the loss agree; rollout files exist, parse, fit seq_len and the vocabulary."""
    d, loss = cfg.data, cfg.loss.name
    policy = getattr(registry.resolve("loss", loss), "needs_rollouts", False)
    if d.format not in ("text", "rollouts"):
        raise UserError(f"data.format={d.format}", "must be text or rollouts.")
    seq_norm = getattr(cfg.loss, "norm", "token") == "sequence"
    if (policy or seq_norm) and d.format != "rollouts":
        what = ("is a policy objective: it trains on RL rollouts (old log-probs, advantages, loss masks), not "
                "on text." if policy else "with loss.norm=sequence needs the rollouts' sequence boundaries.")
        raise UserError(f"loss={loss}", what,
                        "Add data.format=rollouts data.path=ROLLOUTS (jsonl/parquet records with input_ids, "
                        "loss_mask, old_logprobs, advantages; see docs/skills/rl_objectives.md).")
    if d.format != "rollouts":
        return
    from components.data.rollouts import RolloutIndex, pack_rows, rollout_files, source

    path = source(d.name, d.path)
    if path is None:
        raise UserError("data.format=rollouts", f"needs data.path (data.name={d.name} names no packaged rollouts).",
                        "Set data.path to a rollout .jsonl/.parquet file or a folder of them.")
    if not rollout_files(path):
        raise UserError(f"data.path={path}", "no .jsonl or .parquet rollout file there.",
                        "Point data.path at a rollout file or a folder of them.")
    if cfg.parallel.pp not in (None, 1):
        raise UserError("data.format=rollouts", "policy training runs without pipeline parallelism.",
                        "Set parallel.pp=1.")
    try:
        index = RolloutIndex(path, validate=True)
        pack_rows(index.lengths, cfg.training.seq_len, index.where)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(f"data.path={path}", f"{e}.".replace("pack_to", "training.seq_len"),
                        "Fix the records, or raise training.seq_len above the longest sequence.") from None
    top = index.max_token
    if top >= facts.vocab_size:
        raise UserError(f"data.path={path}", f"token id {top} is outside the model's vocabulary "
                        f"({facts.vocab_size}): the rollouts were tokenized for another model.")
    if getattr(cfg.loss, "kl_coef", 0.0) and not index.with_ref:
        raise UserError(f"loss.kl_coef={cfg.loss.kl_coef}", "needs ref_logprobs in every rollout record.",
                        "Add ref_logprobs to the rollouts, or set loss.kl_coef=0.")


def _check_precision(cfg, facts, for_training: bool) -> None:
    """precision.* options run together (always); this machine can run them (training only)."""
    prec = registry.resolve("precision", cfg.precision.name, where=f"precision={cfg.precision.name}")
    try:
        prec.check(cfg.precision, cfg, facts)
    except ValueError as e:
        raise UserError(f"precision={cfg.precision.name}", f"{e}.", "See docs/skills/fp8.md for what each "
                        "backend and scaling runs.") from None
    if for_training:
        prec.check_runtime(cfg.precision, cfg)


def resolve(recipe: str | None, overrides: list[str], *, world_size: int | None = None,
            for_training: bool = True) -> Resolved:
    cfg = recipes.load(recipe, overrides)
    _check_values(cfg)
    _check_group_options(cfg)
    _check_components(cfg)
    facts = model_facts(cfg)
    _check_inputs(cfg, facts, for_training)
    _check_precision(cfg, facts, for_training)
    world = world_size if world_size is not None else world_size_from(cfg, for_training)
    layout = derive(cfg.parallel, cfg.training, cfg.layout, facts, world)
    check = getattr(model_module(cfg), "check_layout", None)
    if check is not None and for_training:  # planning may explore layouts a family cannot train yet
        check(cfg, layout)
    grad_accum = check_batch(cfg.training, layout)
    OmegaConf.set_struct(cfg, False)
    for dim, value in layout.dims.items():
        cfg.parallel[dim] = value
    data_summary = ""
    if for_training:
        _check_outputs(cfg)
        _check_writable(cfg)
        if cfg.data.format == "text":
            data_summary = _check_text_data(cfg)
    OmegaConf.set_struct(cfg, True)
    r = Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=grad_accum, data_summary=data_summary)
    if for_training:
        from framework.preflight import check_memory

        check_memory(r, recipe, overrides, resolve)
    return r
