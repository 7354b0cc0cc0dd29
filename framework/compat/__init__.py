"""Every change apiary makes to a third-party library's internals, and every private name of
Hydra it calls, in one place.

Each function is one patch, in one file per library (torch_patches.py, torchtitan_patches.py with
torchtitan_instances.py for the patches of one object, triton_patches.py, rich_patches.py, hydra_calls.py;
re-exported here: callers use ``compat.NAME``): its docstring
says what it changes, why, and the version it was written against (torch 2.14.1, torchtitan 0.3.0,
Triton 3.8.0, hydra-core 1.3.8; pyproject.toml pins the first three and keeps hydra-core below
1.4). Each is idempotent (a second call changes nothing) and is called from where apiary needs it
(the device shims, the trainer, a component's ``apply``). ``TARGETS`` lists what each patch
replaces or reads; tests/test_compat.py checks that every target still exists with the signature
the patch expects, so an upgrade that moves one fails there rather than in a run. ``PRIVATE_NAMES``
and ``PRIVATE_OVERRIDES`` (listed.py) list the private names read or overridden elsewhere, with the
files and why; tests/test_compat_scan.py fails on a patch outside this package, or a private read or
override that is not listed.

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
from framework.compat.listed import PRIVATE_NAMES, PRIVATE_OVERRIDES
from framework.compat.originals import (
    original,
)
from framework.compat.rich_patches import route_broken_pipe
from framework.compat.torch_patches import (
    eager_cp_block_masks,
    hold_final_rate,
    module_forward,
    patch_torch_cpu_module,
    plain_cuda_segments,
    report_cpu_device_type,
    set_cp_block_mask_load_balance,
)
from framework.compat.torchtitan_instances import (
    add_state_shardings,
    after_state_load,
    gate_training_loop,
    guard_trainer_steps,
    hidden_states_only,
    observe_checkpoint_saves,
    replace_token_combine,
    wrap_checkpoint_saves,
)
from framework.compat.torchtitan_patches import (
    LAST_GRAD_NORM,
    compile_flex_attention,
    eager_block_masks,
    fsdp_wrappers_disabled,
    hook_trainer_train,
    init_weights_from_seed,
    keep_frozen_through_distribute,
    no_closing_sleep,
    patch_clip_grad_norm,
    plain_checkpoint_state_dict,
    route_token_exchange,
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
    "after_state_load": ("torchtitan.components.optimizer:OptimizersContainer.load_state_dict",
                         "torchtitan.components.optimizer.lr_scheduler:LRSchedulersContainer.load_state_dict"),
    "replace_token_combine": ("torchtitan.models.common.token_dispatcher:LocalTokenDispatcher.combine",
                              "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher.combine"),
    "add_state_shardings": ("torchtitan.protocols.module:Module._sharding_config",),
    "hidden_states_only": ("torchtitan.models.common.decoder:Decoder._skip_lm_head",),
    "hold_final_rate": ("torch.optim.lr_scheduler:LambdaLR.get_lr",),  # reads the instance's lr_lambdas
    "module_forward": ("torch.nn.modules.module:Module.__call__",),  # runs the instance's forward
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
    "route_broken_pipe": ("rich.console:Console.on_broken_pipe",),
    "hydra_args_parser": ("hydra._internal.utils:get_args_parser",),
    "hydra_for_config_dir": ("hydra._internal.hydra:Hydra.create_main_hydra2",
                             "hydra._internal.utils:create_config_search_path"),
    "hydra_sanitized_cfg": ("hydra._internal.hydra:Hydra.get_sanitized_hydra_cfg",),
    "hydra_split_sweep": ("hydra._internal.core_plugins.basic_sweeper:BasicSweeper.split_arguments",),
}


__all__ = [
    "TARGETS",
    "PRIVATE_NAMES",
    "PRIVATE_OVERRIDES",
    "original",
    "patch_torch_cpu_module",
    "report_cpu_device_type",
    "eager_cp_block_masks",
    "set_cp_block_mask_load_balance",
    "plain_cuda_segments",
    "eager_block_masks",
    "compile_flex_attention",
    "init_weights_from_seed",
    "LAST_GRAD_NORM",
    "patch_clip_grad_norm",
    "fsdp_wrappers_disabled",
    "hook_trainer_train",
    "no_closing_sleep",
    "guard_trainer_steps",
    "after_state_load",
    "replace_token_combine",
    "add_state_shardings",
    "hidden_states_only",
    "hold_final_rate",
    "module_forward",
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
    "route_broken_pipe",
    "hydra_args_parser",
    "hydra_for_config_dir",
    "hydra_sanitized_cfg",
    "hydra_split_sweep",
]
