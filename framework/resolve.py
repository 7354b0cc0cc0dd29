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
                            "Drop model.hf_checkpoint, or use a family that loads them (qwen3_5).") from None
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
    runs = [p for p in root.glob("*") if (p / "checkpoint").is_dir()] if root.is_dir() else []
    runs.sort(key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def checkpoint_steps(run_dir: Path) -> list[int]:
    ck = Path(run_dir) / "checkpoint"
    steps = []
    for p in ck.glob("step-*") if ck.is_dir() else []:
        try:
            steps.append(int(p.name.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(steps)


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
        steps = checkpoint_steps(Path(cfg.output_dir))
        if not steps:
            raise UserError("checkpoint.resume=true", f"{cfg.output_dir} holds no checkpoint (checkpoint/step-N).",
                            "Check output_dir, or start a fresh run without checkpoint.resume.")
        last = Path(cfg.output_dir) / "checkpoint" / f"step-{steps[-1]}"
        if not (last / ".metadata").is_file():
            raise UserError("checkpoint.resume=true", f"the latest checkpoint {last} is incomplete or corrupt "
                            "(no .metadata).", f"Move it aside to resume from step {steps[-2]}." if len(steps) > 1
                            else "Move it aside and start a fresh run.")
        if steps[-1] >= cfg.training.steps:
            raise UserError("checkpoint.resume=true", f"{cfg.output_dir} is already at step {steps[-1]} of "
                            f"training.steps={cfg.training.steps}.", "Raise training.steps to train further.")
    else:
        if cfg.output_dir is None:
            cfg.output_dir = default_output_dir(cfg.recipe)
        elif checkpoint_steps(Path(cfg.output_dir)):
            raise UserError(f"output_dir={cfg.output_dir}", "already holds checkpoints of an earlier run; a fresh "
                            "run would load or overwrite them.", "Pass checkpoint.resume=true to continue it, or "
                            "choose another output_dir.")


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
    if cfg.training.steps < 1 or cfg.training.seq_len < 2 or cfg.training.local_batch < 1:
        raise UserError("training", "steps, local_batch must be >= 1 and seq_len >= 2.")
    if cfg.data.num_workers not in (0, 1):
        raise UserError(f"data.num_workers={cfg.data.num_workers}", "each rank's loader is one ordered stream "
                        "(text windows or rollout rows dealt in blocks); with more than one worker process "
                        "every worker would produce the same batches and the run would train on repeats.",
                        "Set data.num_workers=1 to load in one background process, or 0 to load in the "
                        "training process.")
    if not for_training:
        return
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
    d = cfg.data
    _check_rollouts(cfg, facts)
    if d.path is not None and d.format == "text":
        from components.data.text import local_data_files

        if not local_data_files(d.path):
            raise UserError(f"data.path={d.path}", "no jsonl, json, parquet or txt file there.",
                            "Point data.path at a file or a folder of them.")
    if d.format == "rollouts":
        return  # rollouts come tokenized
    if d.tokenizer != "byte":
        if not Path(d.tokenizer).is_dir():
            raise UserError(f"data.tokenizer={d.tokenizer}", "no tokenizer folder there (tokenizer.json and "
                            "tokenizer_config.json).", "Download the model's tokenizer files there, or use "
                            "data.tokenizer=byte.")
    elif facts.vocab_size < 258:
        raise UserError("data.tokenizer=byte", f"needs a vocabulary of at least 258; the model has {facts.vocab_size}.",
                        "Set model.vocab_size=320.")


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
    if for_training:
        _check_outputs(cfg)
    OmegaConf.set_struct(cfg, True)
    return Resolved(cfg=cfg, facts=facts, layout=layout, grad_accum=grad_accum)
