"""Resolved recipe -> torchtitan ``Trainer.Config``. The only place apiary meets torchtitan's
trainer configuration; components contribute their parts through their registry entries."""

from __future__ import annotations

import os
from pathlib import Path

from framework import compat, contracts, devices
from framework.errors import UserError
from framework.plan import planner
from framework.resolve import resume
from framework.resolve.resolver import Resolved


def _held_schedule_config(base):
    """torchtitan's schedule config whose steps past ``total_steps`` keep the final rate (torchtitan's
    own formula would go on decaying below it, to negative rates): lr.total_steps < training.steps
    extends a run on the schedule it was trained with (framework/resolve/resume.py)."""

    class HeldSchedule(base):
        __slots__ = ()

        def build(self, *, optimizers, training_steps):
            container = base.build(self, optimizers=optimizers, training_steps=training_steps)
            total = self.total_steps if self.total_steps is not None else training_steps
            for sch in container.schedulers:
                compat.hold_final_rate(sch, total)

            def sync_rates():
                for sch in container.schedulers:
                    for group, rate in zip(sch.optimizer.param_groups, sch.get_last_lr()):
                        group["lr"] = rate

            # torchtitan's scheduler load recomputes the resumed step's rate, but the optimizer's load
            # (after it) puts back the rate the checkpoint saved (the old schedule's, the old
            # optimizer.lr's): the first resumed step would log one rate and use another. After
            # either load, the optimizer's groups get the schedule's rate.
            for obj in (container, optimizers):  # torchtitan's containers (a plain list in unit tests)
                compat.after_state_load(obj, sync_rates)
            return container

    return HeldSchedule


def initial_load_path(cfg) -> str | None:
    """checkpoint.load_path as torchtitan's checkpointer takes it: absolute (it refuses a relative path;
    one given relative is the working folder's, as every other path of the recipe)."""
    path = cfg.checkpoint.load_path
    return str(Path(path).absolute()) if path is not None else None


def trainer_config(r: Resolved):
    """torchtitan's Trainer.Config: the framework's common part (``common_config``), then each component's
    ``apply(options, tc, ctx)`` in ``contracts.APPLY_ORDER``, then the validator and publication the
    config asks for."""
    ctx = r.ctx  # resolve() built it and ran every component's check with it
    ctx.cfg, ctx.facts, ctx.layout = r.cfg, r.facts, r.layout
    tc = common_config(r)
    for kind in contracts.APPLY_ORDER:
        ctx.components[kind].apply(ctx.options[kind], tc, ctx)
    _add_validation_and_publishing(tc, r)
    return tc


def common_config(r: Resolved):
    """What every run's Trainer.Config shares, whatever its components: optimizer, LR schedule
    (framework/resolve/resume.py ``schedule``), metrics (with the planner's FLOPs per token), training,
    parallelism dims, checkpoint, the non-finite guard, the device's flight recorder."""
    from torchtitan.components.checkpoint import CheckpointManager  # reason: start-up time of the CLI (apiary ls; ~0.6s)
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig  # reason: as above
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig  # reason: as above
    from torchtitan.config.configs import DebugConfig  # reason: as above

    from framework.report.metrics import ApiaryMetrics  # reason: as above
    from framework.train.trainer import ApiaryTrainer  # reason: as above

    cfg, lay = r.cfg, r.layout
    out = Path(cfg.output_dir)
    o = cfg.optimizer
    optimizer = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name=o.name,
        optimizer_kwargs={"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay},
    )])
    lr = _held_schedule_config(LRSchedulersContainer.Config)(**resume.schedule(cfg))
    if cfg.logging.wandb:
        os.environ.setdefault("WANDB_PROJECT", cfg.logging.wandb_project)
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")

    tc = ApiaryTrainer.Config(
        dump_folder=str(out),
        optimizer=optimizer,
        lr_scheduler=lr,
        metrics=ApiaryMetrics.Config(
            log_freq=cfg.logging.log_freq, enable_tensorboard=cfg.logging.tensorboard,
            enable_wandb=cfg.logging.wandb, disable_color_printing=not cfg.logging.color,
            jsonl_path=str(out / "metrics.jsonl"), total_steps=cfg.training.steps,
            # the logged TFLOPs/GPU and MFU: the planner's model FLOPs per token, counted once here
            flops_per_token=planner.model_flops_per_token(r),
        ),
        training=TrainingConfig(
            local_batch_size=cfg.training.local_batch,
            global_batch_size=cfg.training.global_batch if cfg.training.global_batch is not None else -1,
            seq_len=cfg.training.seq_len,
            steps=cfg.training.steps,
            max_norm=cfg.training.max_norm,
            mixed_precision_param=cfg.training.dtype,
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=lay.dp_replicate,
            data_parallel_shard_degree=lay.dp_shard,
            context_parallel_degree=lay.cp,
            tensor_parallel_degree=lay.tp,
            pipeline_parallel_degree=lay.pp,
            expert_parallel_degree=lay.ep,
            context_parallel_load_balancer=(None if str(cfg.parallel.cp_load_balancer).lower() in ("none", "null", "")
                                            else cfg.parallel.cp_load_balancer),
            pipeline_parallel_schedule=cfg.parallel.pp_schedule,
            pipeline_parallel_microbatch_size=cfg.parallel.pp_microbatch_size,
        ),
        checkpoint=CheckpointManager.Config(
            enable=cfg.checkpoint.enable,
            folder="checkpoint",
            interval=cfg.checkpoint.interval,
            keep_latest_k=0,  # apiary prunes once a step is complete (framework/train/atomic_save.py): keep_checkpoints
            last_save_model_only=cfg.checkpoint.model_only_last,
            initial_load_path=initial_load_path(cfg),
            initial_load_model_only=cfg.checkpoint.load_path is not None,
            create_seed_checkpoint=cfg.checkpoint.create_seed,
            load_step=cfg.checkpoint.load_step if cfg.checkpoint.load_step is not None else -1,
        ),
        on_nonfinite=cfg.training.on_nonfinite,
        max_skips=cfg.training.max_skips,
        keep_checkpoints=cfg.checkpoint.keep_latest_k,
        resume_hint=f"`train recipe={cfg.recipe} output_dir={out} checkpoint.resume=true`",
        compile=CompileConfig(enable=False),
        # torchtitan's NCCL flight recorder dumps to comm_traces/ on a timeout; gloo (CPU) has none to dump
        comm=CommConfig() if devices.has_accelerator() else CommConfig(trace_buf_size=0),
        debug=DebugConfig(seed=cfg.training.seed, deterministic=cfg.training.deterministic),
    )
    return tc


def _add_validation_and_publishing(tc, r: Resolved) -> None:
    """With ``validation.interval``: the validator on the data component's held-out loader; with
    ``publish.interval``: the publication settings."""
    cfg = r.cfg
    if cfg.validation.interval > 0:  # validation loss on the data component's held-out text
        from framework.train.validation import validator_config  # reason: as above

        if tc.validation_dataloader is None:
            raise UserError(f"validation.interval={cfg.validation.interval}", f"data.format={cfg.data.format} sets "
                            "no held-out loader (its apply leaves tc.validation_dataloader unset).",
                            "Drop the validation.* keys for this data component.")
        tc.validator = validator_config(tc.validation_dataloader, cfg.validation.interval, cfg.validation.steps,
                                        cfg.training.steps)
    if cfg.publish.interval > 0:  # the weights as HF folders for a generator (framework/train/publish.py)
        from framework.train.publish import settings as publish_settings  # reason: as above (only runs that publish)

        tc.publish = publish_settings(cfg, r.ctx, r.facts)
