"""The private names of third-party libraries apiary reads or overrides outside framework/compat/,
each with the files that do and why it stays there rather than moving here.

A read (``PRIVATE_NAMES``: an import of a private name, ``module._name``, ``obj._name``) or an
override (``PRIVATE_OVERRIDES``: a method ``_name`` of a subclass that the library's class defines
too) changes nothing in the library, but an upgrade that renames the name breaks it; it stays in the
code that uses it, listed here, where moving it would only add a function that forwards. Targets are
"module:attribute.path" as of torch 2.14.1, torchtitan 0.3.0 and omegaconf 2.3;
tests/test_compat.py checks that each still exists, and tests/test_compat_scan.py that every such
read or override in framework/, components/ and toolkit/ is listed here (a patch, an assignment to
a library's module, class or object, is never listed: it moves into framework/compat/).
"""

from __future__ import annotations

_MODEL_BUILD = "torchtitan's own layer builders and initialisers, called to build the same model its registry builds"
_OPTIMIZERS = "the state backend's containers reuse torchtitan's OptimizersContainer's construction steps"

# "module:attribute.path" -> (the files that read it, why)
PRIVATE_NAMES: dict[str, tuple[tuple[str, ...], str]] = {
    "torch:_grouped_mm": (("components/models/common.py", "components/moe/chunked_experts.py",
                           "components/adapters/modules.py"), "the grouped GEMM torchtitan's experts run"),
    "torch:_foreach_norm": (("components/state/zero1_optimizer.py",), "the global norm over flat buckets"),
    "torch:_foreach_mul_": (("components/state/zero1_optimizer.py",), "the clip over flat buckets"),
    "torch._dynamo.utils:compilation_time_metrics": (("framework/train/first_step.py",),
                                                     "compile time in the log (the module read from sys.modules)"),
    "torch._inductor.runtime.cache_dir_utils:default_cache_dir": (("framework/train/kernel_cache.py",),
                                                                 "inductor's cache folder"),
    "torch.utils._python_dispatch:is_traceable_wrapper_subclass": (("components/precision/checkpoint_storage.py",),
                                                                   "torchao's wrapper tensors"),
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset": (
        ("components/state/zero1_layout.py",), "a DTensor's local slice, as DCP computes it"),
    "torch.distributed.tensor.placement_types:_StridedShard": (("components/state/zero1_layout.py",),
                                                              "FSDP's strided placement in a layout"),
    "torch.distributed.tensor._dtensor_spec:TensorMeta": (("components/state/offload.py",),
                                                          "_like: a DTensor of host state without from_local's "
                                                          "copy to the mesh's device"),
    "torch.distributed.tensor:DTensor._local_tensor": (("components/precision/checkpoint_storage.py",),
                                                       "the local shard itself (to_local() makes a view that "
                                                       "autograd tracks)"),
    "torch.nn:Module._parameters": (("components/adapters/modules.py", "components/state/zero1_optimizer.py"),
                                    "a module's own parameters in registration order, held aside and put back "
                                    "around the base's initialisation; ZeRO-1 swaps them for views"),
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointWrapper._checkpoint_wrapped_module": (
        ("components/models/qwen3_5_model.py",), "the block inside torch's checkpoint wrapper"),
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper": (
        ("components/recompute/per_block.py",), "the wrapper torchtitan's FullAC uses"),
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointImpl": (
        ("components/recompute/per_block.py",), "the rerun mark a block switched to recompute at run time carries "
        "(recompute=auto's fallback), as torchtitan's wrapped blocks carry it"),
    "torch.cuda.memory:_set_allocator_settings": (("framework/devices.py",),
                                                  "the allocator settings of a process already running"),
    "torchtitan.components.lora:_make_frozen_config": (("components/adapters/modules.py",),
                                                       "the frozen base's config, as torchtitan's LoRA makes it"),
    "torchtitan.components.loss:_DecoderOutputGradientBackProp": (("components/losses/lm_head/head_loss.py",),
                                                                  "a piecewise loss's gradient hand-back"),
    "torchtitan.models.qwen3_5.sharding:_GROUPED_EXPERTS_PARAM_LAYOUT": (("components/models/qwen3_5_model.py",),
                                                                        "the experts' placements"),
    "torchtitan.components.quantization.float8:_get_float8_grouped_experts_cls": (
        ("components/precision/torchao_fp8.py",), "torchtitan's FP8 experts"),
    "torchtitan.components.quantization.mx:_get_mxfp8_grouped_experts_cls": (("components/precision/torchao_fp8.py",),
                                                                             "torchtitan's MXFP8 experts"),
    "torchtitan.distributed.activation_checkpoint:_disable_dynamo_lru_cache": (("components/recompute/per_block.py",),
                                                                               "as torchtitan's own AC does"),
    "torchtitan.distributed.activation_checkpoint:FullAC._wrap_block": (("components/recompute/per_block.py",),
                                                                        "one block wrapped as FullAC/SelectiveAC "
                                                                        "wrap each"),
    "torchtitan.components.checkpoint:CheckpointManager._find_load_step": (("components/adapters/checkpoint.py",),
                                                                           "the step a resume loads"),
    "torchtitan.components.checkpoint:CheckpointManager._create_checkpoint_id": (
        ("components/adapters/checkpoint.py",), "the folder of that step"),
    "torchtitan.components.optimizer:OptimizersContainer._build_param_groups": (("components/state/offload.py",),
                                                                                _OPTIMIZERS),
    "torchtitan.components.optimizer:OptimizersContainer._build_impl_kwargs": (("components/state/zero1_optimizer.py",),
                                                                               _OPTIMIZERS),
    "torchtitan.components.optimizer:OptimizersContainer._resolve_optimizer_factory": (
        ("components/state/zero1_optimizer.py",), _OPTIMIZERS),
    "torchtitan.components.optimizer:OptimizersContainer._register_bf16_optimizer_state_hook": (
        ("components/state/zero1_optimizer.py",), _OPTIMIZERS),
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._unpermute": (
        ("components/moe/lean_combine.py",), "the lean combine runs the dispatcher's own steps before its scoring"),
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._combine_token_exchange": (
        ("components/moe/lean_combine.py",), "as above"),
    "torchtitan.models.common.decoder:Decoder._skip_lm_head": (("components/models/qwen3_5_model.py",),
                                                              "Qwen3.5's forward honours the flag as Decoder's does"),
    "torchtitan.models.common.moe:GroupedExperts._grouped_mm": (("components/adapters/modules.py",),
                                                               "LoRA's experts call the base's GEMM path"),
    "torchtitan.protocols.module:Module.Config._owner": (("components/adapters/modules.py",
                                                          "components/precision/torchao_fp8.py"),
                                                         "the module class a config builds (the class to derive from)"),
    "omegaconf:DictConfig._get_node": (("framework/compose/recipes.py",), "a key's node, to ask it is Optional"),
    "omegaconf:Node._is_optional": (("framework/compose/recipes.py",), "whether a schema key takes null"),
    "omegaconf:Node._get_parent": (("framework/contracts/options.py",), "a node's path, for the message"),
    **{f"torchtitan.models.llama3:{n}": (("components/models/llama3_build.py",), _MODEL_BUILD) for n in (
        "_NORM_INIT", "_LINEAR_INIT", "_depth_init", "_EMBEDDING_SKIP_INIT", "_EMBEDDING_INIT", "_output_linear_init")},
    **{f"torchtitan.models.qwen3:{n}": (("components/models/qwen3_build.py",), _MODEL_BUILD) for n in (
        "_build_qwen3_moe_layers", "_build_qwen3_layers", "_qwen3_norm", "_EMBEDDING_INIT", "_LINEAR_INIT",
        "_EMBEDDING_SKIP_INIT")},
    **{f"torchtitan.models.qwen3_5:{n}": (("components/models/qwen3_5_build.py",), _MODEL_BUILD) for n in (
        "_build_qwen35_moe_layers", "_build_qwen35_layers", "_offset_norm", "_EMBEDDING_INIT", "_output_linear_init")},
}

# "module:Class._method" -> (the files whose subclass overrides it, why)
PRIVATE_OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "torchtitan.components.checkpointer.base:ModelWrapper._get_state_dict": (
        ("components/adapters/checkpoint.py",), "the adapters-only checkpoint saves the adapters alone"),
    "torchtitan.components.checkpoint:CheckpointManager._load": (("components/adapters/checkpoint.py",),
                                                                 "a resume loads the adapters, the base stays frozen"),
    "torchtitan.components.optimizer:OptimizersContainer._build_param_groups": (("components/state/offload.py",),
                                                                                "groups of the host copies"),
    "torchtitan.components.optimizer:OptimizersContainer._validate_params": (("components/state/offload.py",),
                                                                             "host parameters pass"),
    "torchtitan.components.metrics:MetricsProcessor._build_metric_logger": (("framework/report/metrics.py",),
                                                                            "metrics.jsonl beside torchtitan's loggers"),
    "torchtitan.models.common:CosSinRoPE._precompute_cache": (("components/models/qwen3_build.py",),
                                                              "YaRN's frequencies in torchtitan's cache"),
    "torchtitan.protocols.module:Module._init_self_parameters": (("components/adapters/modules.py",),
                                                                 "the base's initialisation, then the adapters'"),
}
