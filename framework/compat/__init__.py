"""Every change apiary makes to a third-party library's internals, and every private name of
Hydra it calls, in one place.

Each function is one patch, in one file per library (torch_patches.py, torchtitan_patches.py,
triton_patches.py, hydra_calls.py; re-exported here: callers use ``compat.NAME``): its docstring
says what it changes, why, and the version it was written against (torch 2.14.1, torchtitan 0.3.0,
Triton 3.8.0, hydra-core 1.3.8; pyproject.toml pins the first three and keeps hydra-core below
1.4). Each is idempotent (a second call changes nothing) and is called from where apiary needs it
(the device shims, the trainer, a component's ``apply``). ``TARGETS`` lists what each patch
replaces or reads; tests/test_compat.py checks that every target still exists with the signature
the patch expects, so an upgrade that moves one fails there rather than in a run.

Importing this package imports nothing heavy: torch, torchtitan, Triton and Hydra's internals are
imported inside the functions, so ``import framework`` and the command line's start-up stay free
of them (docs/skills/startup.md).
"""

from __future__ import annotations

from framework.compat.hydra_calls import (
    hydra_args_parser,
    hydra_for_config_dir,
    hydra_sanitized_cfg,
    hydra_split_sweep,
)
from framework.compat.originals import (
    original,
)
from framework.compat.torch_patches import (
    eager_cp_block_masks,
    patch_torch_cpu_module,
    plain_cuda_segments,
    report_cpu_device_type,
    set_cp_block_mask_load_balance,
)
from framework.compat.torchtitan_patches import (
    GRAD_CLIP_OWNER,
    GRAD_SCALE_OWNER,
    LAST_GRAD_NORM,
    compile_flex_attention,
    eager_block_masks,
    extend_metrics_log,
    fsdp_wrappers_disabled,
    gate_training_loop,
    guard_trainer_steps,
    hook_trainer_train,
    init_weights_from_seed,
    keep_frozen_through_distribute,
    no_closing_sleep,
    observe_checkpoint_saves,
    patch_clip_grad_norm,
    plain_checkpoint_state_dict,
    route_token_exchange,
    wrap_checkpoint_saves,
)
from framework.compat.triton_patches import (
    cache_existing_autotuners,
    lock_autotune_disk_cache,
    prune_autotune_configs,
    set_autotuning_listener,
)

# patch -> the third-party names it replaces or reads ("module:attribute.path")
TARGETS: dict[str, tuple[str, ...]] = {
    "patch_torch_cpu_module": ("torch.cpu:current_device",),
    "report_cpu_device_type": ("torch._utils:_get_available_device_type",),
    "eager_cp_block_masks": ("torch.distributed.tensor.experimental._context_parallel._attention:"
                             "_compiled_create_block_mask",),
    "set_cp_block_mask_load_balance": ("torch.distributed.tensor.experimental._context_parallel._attention:"
                                       "_cp_options.enable_load_balance",),
    "eager_block_masks": ("torchtitan.models.common.attention:_compiled_create_block_mask",),
    "compile_flex_attention": ("torchtitan.models.common.attention:FlexAttention._compiled_flex_attn",
                               "torchtitan.models.common.attention:FlexAttention.inductor_configs"),
    "init_weights_from_seed": ("torchtitan.distributed.utils:set_determinism",
                               "torchtitan.protocols.model:BaseModel.init_weights"),
    "patch_clip_grad_norm": ("torchtitan.distributed.utils:clip_grad_norm_", "torch.nn.utils:clip_grads_with_norm_"),
    "fsdp_wrappers_disabled": ("torchtitan.distributed.fsdp:apply_fsdp_to_decoder",),
    "hook_trainer_train": ("torchtitan.trainer:Trainer.train",),
    "no_closing_sleep": ("torchtitan.trainer:time",),  # a context manager: the module global, for one call
    # instance-level: these replace a method on one object the trainer built, never on the class
    "guard_trainer_steps": ("torchtitan.components.optimizer:OptimizersContainer.step",
                            "torchtitan.components.optimizer.lr_scheduler:LRSchedulersContainer.step"),
    "extend_metrics_log": ("torchtitan.components.metrics:MetricsProcessor.log",),
    "wrap_checkpoint_saves": ("torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_save",
                              "torchtitan.components.checkpointer.dcp:CheckpointManager.save"),
    "gate_training_loop": ("torchtitan.trainer:Trainer.should_continue_training",),
    "observe_checkpoint_saves": ("torchtitan.components.checkpointer.dcp:CheckpointManager.save",),
    "plain_checkpoint_state_dict": ("torchtitan.components.checkpointer.base:ModelWrapper._get_state_dict",
                                    "torchtitan.components.checkpointer.base:_shares_storage"),
    "route_token_exchange": ("torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._dispatch_token_exchange",
                             "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._combine_token_exchange"),
    "keep_frozen_through_distribute": ("torchtitan.protocols.module:Module._spmd_distribute_state",),
    "prune_autotune_configs": ("triton.runtime.autotuner:Autotuner.prune_configs",),
    "lock_autotune_disk_cache": ("triton.runtime.autotuner:Autotuner.check_disk_cache",),
    "set_autotuning_listener": ("triton.knobs:autotuning.listener",),
    "cache_existing_autotuners": ("triton.runtime.autotuner:Autotuner",),
    "plain_cuda_segments": ("torch.cuda.memory:_set_allocator_settings",),  # a context manager, not a patch
    "hydra_args_parser": ("hydra._internal.utils:get_args_parser",),
    "hydra_for_config_dir": ("hydra._internal.hydra:Hydra.create_main_hydra2",
                             "hydra._internal.utils:create_config_search_path"),
    "hydra_sanitized_cfg": ("hydra._internal.hydra:Hydra.get_sanitized_hydra_cfg",),
    "hydra_split_sweep": ("hydra._internal.core_plugins.basic_sweeper:BasicSweeper.split_arguments",),
}


# Private names apiary reads (imports or calls) without patching them: "module:name" -> where.
# tests/test_compat.py checks that each still exists, and that every private third-party import
# in framework/, components/ and toolkit/ is listed here.
PRIVATE_NAMES: dict[str, str] = {
    "torch:_grouped_mm": "components/models/common.py, components/moe/chunked_experts.py, components/adapters/modules.py",
    "torch:_foreach_norm": "components/state/zero1_optimizer.py",
    "torch:_foreach_mul_": "components/state/zero1_optimizer.py",
    "torch._dynamo.utils:compilation_time_metrics": "framework/train/first_step.py",
    "torch._inductor.runtime.cache_dir_utils:default_cache_dir": "framework/train/kernel_cache.py",
    "torch.utils._python_dispatch:is_traceable_wrapper_subclass": "components/precision/policies.py",
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset": "components/state/zero1_optimizer.py",
    "torch.distributed.tensor.placement_types:_StridedShard": "components/state/zero1_optimizer.py",
    "torch.distributed.tensor._dtensor_spec:TensorMeta": "components/state/offload.py (_like: a DTensor of host state "
                                                         "without from_local's copy to the mesh's device)",
    "torchtitan.components.lora:_make_frozen_config": "components/adapters/modules.py",
    "torchtitan.components.loss:_DecoderOutputGradientBackProp": "components/losses/lm_head/head_loss.py",
    "torchtitan.models.qwen3_5.sharding:_GROUPED_EXPERTS_PARAM_LAYOUT": "components/models/qwen3_5_model.py",
    "torchtitan.components.quantization.float8:_get_float8_grouped_experts_cls": "components/precision/policies.py",
    "torchtitan.components.quantization.mx:_get_mxfp8_grouped_experts_cls": "components/precision/policies.py",
    "torchtitan.distributed.activation_checkpoint:_disable_dynamo_lru_cache": "components/recompute/per_block.py",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper": "components/recompute/per_block.py",
}

__all__ = [
    "TARGETS",
    "PRIVATE_NAMES",
    "original",
    "patch_torch_cpu_module",
    "report_cpu_device_type",
    "eager_cp_block_masks",
    "set_cp_block_mask_load_balance",
    "plain_cuda_segments",
    "eager_block_masks",
    "compile_flex_attention",
    "init_weights_from_seed",
    "GRAD_CLIP_OWNER",
    "GRAD_SCALE_OWNER",
    "LAST_GRAD_NORM",
    "patch_clip_grad_norm",
    "fsdp_wrappers_disabled",
    "hook_trainer_train",
    "no_closing_sleep",
    "guard_trainer_steps",
    "extend_metrics_log",
    "wrap_checkpoint_saves",
    "gate_training_loop",
    "observe_checkpoint_saves",
    "plain_checkpoint_state_dict",
    "route_token_exchange",
    "keep_frozen_through_distribute",
    "prune_autotune_configs",
    "lock_autotune_disk_cache",
    "set_autotuning_listener",
    "cache_existing_autotuners",
    "hydra_args_parser",
    "hydra_for_config_dir",
    "hydra_sanitized_cfg",
    "hydra_split_sweep",
]
