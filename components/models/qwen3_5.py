"""Qwen3.5 family, text only (hybrid GatedDeltaNet + gated attention; MoE or dense).

Flavors carry the architecture numbers of torchtitan 0.3.0's ``qwen3_5`` registry (the
decoder part; tests/test_qwen35.py checks every shared flavor against it) plus CPU-sized
``debug_moe`` / ``debug_dense``. The model is ``qwen3_5_model.Qwen35TextModel``: torchtitan's
Qwen3.5 blocks without the vision encoder, GatedDeltaNet on a torch path (CPU) or fla's
kernels (CUDA) as framework.devices decides, context parallelism for both layer kinds.
``n_layers`` keeps the pattern: layer i is full attention when (i + 1) % interval == 0.
``hf_checkpoint`` (a HF folder): its config.json is the architecture, loaded after init.

This module is the family's contract and imports no torch: sizes, checks and flavors come from
qwen3_5_arch.py. Building the model (``model_spec``), HF folders and export live in
qwen3_5_build.py, imported on first use; its public names are reachable from here too.
"""

from __future__ import annotations

import dataclasses
import sys

from components.models import family, hf_folder, layer_kinds
from components.models.family import ModelFacts

# the family's names (FLAVORS, HF_MODEL_TYPES, TORCHTITAN_FLAVORS are read through this module)
from components.models.qwen3_5_arch import FLAVORS, HF_MODEL_TYPES, TORCHTITAN_FLAVORS, Arch, arch_from_hf_config  # noqa: F401
from framework.errors import UserError

# names of the torchtitan side (qwen3_5_build) this module hands out on first use (PEP 562);
# tests/test_startup.py checks the list against that module
BUILD_NAMES = ("build_config", "model_config", "hf_key_shapes", "export_hf", "STATE_DICT_ADAPTER", "save_hf",
               "Qwen35TextModel", "TextBlock", "parallelize_qwen35_text", "canonical_key", "hf_text_config")


_build, __getattr__ = family.build_side("components.models.qwen3_5_build", __name__, BUILD_NAMES)


def arch_of(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None,
            hf_checkpoint: str | None = None) -> Arch:
    """The flavor's architecture with the recipe's overrides; with ``hf_checkpoint`` the folder's
    config.json is the architecture (the flavor supplies nothing) and the user's explicit
    ``n_layers`` (fewer: the first layers) / ``vocab_size`` (equal) are checked against it."""
    if hf_checkpoint:  # config.json read without torch (qwen3_5_arch.arch_from_hf_config)
        return hf_folder.apply_overrides(arch_from_hf_config(hf_checkpoint), hf_checkpoint, n_layers=n_layers,
                                         vocab_size=vocab_size)
    a = FLAVORS[flavor]
    changes = {k: v for k, v in (("n_layers", n_layers), ("vocab_size", vocab_size)) if v is not None}
    return dataclasses.replace(a, **changes) if changes else a


def model_spec(flavor: str, **kwargs):
    """torchtitan's ModelSpec of this recipe's model (imports the torchtitan side)."""
    return _build().model_spec(flavor, **kwargs)


def analytic_counts(a: Arch) -> tuple[int, int]:
    """(total, routed-expert) parameters from the formulas (the tests check them against the model)."""
    d = a.dim
    n_attn = a.n_layers // a.full_attention_interval
    n_lin = a.n_layers - n_attn
    attn = d * 2 * a.n_heads * a.head_dim + 2 * d * a.n_kv_heads * a.head_dim + a.n_heads * a.head_dim * d \
        + 2 * a.head_dim  # q (+ output gate), k, v, o; q/k norms
    kd, vd = a.linear_key_heads * a.linear_key_head_dim, a.linear_value_heads * a.linear_value_head_dim
    lin = d * (2 * kd + 2 * vd) + 2 * d * a.linear_value_heads + (2 * kd + vd) * a.conv_kernel \
        + 2 * a.linear_value_heads + a.linear_value_head_dim + vd * d  # q,k,v,z; a,b; conv; A_log, dt_bias; norm; out
    if a.num_experts:
        experts = a.num_experts * 3 * d * a.moe_hidden_dim
        ffn = experts + d * a.num_experts + 3 * d * a.shared_expert_hidden_dim + d
    else:
        experts, ffn = 0, 3 * d * a.ffn_hidden_dim
    emb = a.vocab_size * d * (1 if a.tie_embeddings else 2)
    total = emb + d + n_attn * attn + n_lin * lin + a.n_layers * (ffn + 2 * d)
    return total, a.n_layers * experts


def facts(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None,
          hf_checkpoint: str | None = None, **kwargs) -> ModelFacts:
    """Sizes from the architecture's formulas (no model built; tests/test_qwen35.py checks them
    against the model torchtitan builds)."""
    a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
    total, expert = analytic_counts(a)
    active = total - expert + (expert * a.top_k // a.num_experts if a.num_experts else 0)
    n_attn = a.n_layers // a.full_attention_interval
    linear = dict(key_dim=a.linear_key_heads * a.linear_key_head_dim,
                  value_dim=a.linear_value_heads * a.linear_value_head_dim, conv_kernel=a.conv_kernel,
                  key_heads=a.linear_key_heads, value_heads=a.linear_value_heads, head_dim=a.linear_key_head_dim,
                  value_head_dim=a.linear_value_head_dim)
    return ModelFacts(
        family="qwen3_5", flavor=flavor, n_layers=a.n_layers, dim=a.dim, vocab_size=a.vocab_size,
        n_params=total, n_active_params=active, n_expert_params=expert, num_experts=a.num_experts,
        top_k=a.top_k, moe_hidden_dim=a.moe_hidden_dim, ffn_hidden_dim=a.ffn_hidden_dim, n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, n_attention_layers=n_attn,
        n_linear_attention_layers=a.n_layers - n_attn, linear_attn=linear,
        shared_expert_hidden_dim=a.shared_expert_hidden_dim,
        source=_source(a, hf_checkpoint), max_seq_len=a.max_seq_len if n_attn else 0,
        layer_mixers=tuple("attention" if (i + 1) % a.full_attention_interval == 0 else "linear_attention"
                           for i in range(a.n_layers)),
    )


def _source(a: Arch, hf_checkpoint: str | None) -> str:
    if not hf_checkpoint:
        return ""
    return hf_folder.describe(a, hf_checkpoint, hf_folder.checkpoint_depth(hf_folder.weight_index(hf_checkpoint)))


def check_layout(cfg, layout) -> None:
    """What this family supports of a derived layout (framework.resolve calls it before spawn).

    CP: attention layers all-gather K/V (torchtitan's CP, flex or the CPU dense-mask attention)
    and GatedDeltaNet passes its state along the chain of contiguous parts, so the balancer
    must keep contiguous parts: "headtail" (two per rank, fla's zigzag) or "none".
    """
    if layout.tp > 1:
        raise UserError(f"parallel.tp={layout.tp}", "apiary's text-only Qwen3.5 runs without tensor parallelism.",
                        "Use parallel.tp=1 (the table's default); shard with FSDP2, EP and CP.")
    if layout.pp > 1:
        raise UserError(f"parallel.pp={layout.pp}", "apiary's text-only Qwen3.5 has no pipeline split yet.",
                        "Use parallel.pp=1.")
    if layout.cp == 1:
        return
    balancer = str(cfg.parallel.cp_load_balancer).lower()
    if balancer not in ("headtail", "none", "null"):
        raise UserError(f"parallel.cp_load_balancer={cfg.parallel.cp_load_balancer}", "GatedDeltaNet carries its "
                        "state along the sequence, so each rank must hold contiguous parts of it; a block "
                        "permutation like 'ptrr' breaks that.", "Use headtail (balanced causal attention) or none.")
    if cfg.model.attn_backend != "flex":
        raise UserError(f"model.attn_backend={cfg.model.attn_backend}", "context parallelism for Qwen3.5 "
                        "all-gathers K/V for flex attention (torchtitan has no varlen/SDPA CP here).",
                        "Use model.attn_backend=flex with parallel.cp > 1.")
    seq = int(cfg.training.seq_len)
    if seq % (layout.cp * 128):
        raise UserError(f"training.seq_len={seq}", f"with CP {layout.cp} each rank's attention mask covers "
                        "whole 128-token blocks, so seq_len must be a multiple of cp x 128 = "
                        f"{layout.cp * 128}.", f"Try training.seq_len={(seq // (layout.cp * 128) + 1) * layout.cp * 128}.")


# -- the component contract (framework/contracts/protocols.py, kind ``model``) --------------------------
Options = family.ModelOptions
# apiary compare: another family is another model (its options: compare's own table of model.* keys)
NUMERICS = {"": "any"}
# the planner: its layer kinds' calibrated constants (docs/skills/planner.md)
PLAN_CONSTANTS = layer_kinds.PLAN_CONSTANTS


def model_kwargs(options, ctx) -> dict:
    return family.model_kwargs(options, ctx)


def check(options, ctx) -> None:
    family.check_model(options, ctx)
    if ctx.for_training and ctx.layout is not None:  # planning may explore layouts it cannot train yet
        check_layout(ctx.cfg, ctx.layout)


def apply(options, tc, ctx) -> None:
    family.apply_model(sys.modules[__name__], options, tc, ctx)


def hf_writer(options, ctx):
    """state dict -> (HF text-only tensors, config.json) for weight publication (framework/contracts/protocols.py)."""
    return _build().hf_writer(options, ctx)
