"""Resolved recipe -> torchtitan ``Trainer.Config``. The only place apiary meets torchtitan's
trainer configuration; components contribute their parts through their registry entries."""

from __future__ import annotations

import os
from pathlib import Path

from framework import contracts
from framework.resolve import Resolved, context


def trainer_config(r: Resolved):
    """torchtitan's Trainer.Config: the framework's common part, then each component's
    ``apply(options, tc, ctx)`` in ``contracts.APPLY_ORDER``."""
    from torchtitan.components.checkpoint import CheckpointManager  # reason: start-up time of the CLI (apiary ls; ~0.6s)
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig  # reason: as above
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig  # reason: as above
    from torchtitan.config.configs import DebugConfig  # reason: as above

    from framework.metrics import ApiaryMetrics  # reason: as above
    from framework.trainer import ApiaryTrainer  # reason: as above

    cfg, lay = r.cfg, r.layout
    out = Path(cfg.output_dir)
    ctx = r.ctx
    if ctx is None:  # a Resolved built by hand (the planner's search): components chosen now
        ctx = context(cfg, for_training=False)
    ctx.cfg, ctx.facts, ctx.layout = cfg, r.facts, lay

    o = cfg.optimizer
    optimizer = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name=o.name,
        optimizer_kwargs={"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay},
    )])
    lr = LRSchedulersContainer.Config(
        warmup_steps=min(cfg.lr.warmup_steps, max(cfg.training.steps - 1, 0)),
        decay_ratio=cfg.lr.decay_ratio, decay_type=cfg.lr.decay_type, min_lr_factor=cfg.lr.min_lr_factor,
    )
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
            keep_latest_k=cfg.checkpoint.keep_latest_k,
            last_save_model_only=cfg.checkpoint.model_only_last,
            initial_load_path=cfg.checkpoint.load_path,
            initial_load_model_only=cfg.checkpoint.load_path is not None,
            create_seed_checkpoint=cfg.checkpoint.create_seed,
            load_step=cfg.checkpoint.load_step if cfg.checkpoint.load_step is not None else -1,
        ),
        on_nonfinite=cfg.training.on_nonfinite,
        max_skips=cfg.training.max_skips,
        resume_hint=f"`train recipe={cfg.recipe} output_dir={out} checkpoint.resume=true`",
        compile=CompileConfig(enable=False),
        comm=CommConfig(),
        debug=DebugConfig(seed=cfg.training.seed, deterministic=cfg.training.deterministic),
    )
    for kind in contracts.APPLY_ORDER:
        ctx.components[kind].apply(ctx.options[kind], tc, ctx)
    if cfg.publish.interval > 0:  # the weights as HF folders for a generator (framework/publish.py)
        from framework.publish import settings as publish_settings  # reason: as above (only runs that publish)

        tc.publish = publish_settings(cfg, ctx, r.facts)
    return tc
