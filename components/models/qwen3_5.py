"""Qwen3.5 family, text only (hybrid GatedDeltaNet + gated attention; MoE or dense).

Flavors carry the architecture numbers of torchtitan 0.3.0's ``qwen3_5`` registry (the
decoder part; tests/test_qwen35.py checks every shared flavor against it) plus CPU-sized
``debug_moe`` / ``debug_dense``. The model is ``qwen3_5_model.Qwen35TextModel``: torchtitan's
Qwen3.5 blocks without the vision encoder, GatedDeltaNet on a torch path (CPU) or fla's
kernels (CUDA) as framework.devices decides, context parallelism for both layer kinds.
``n_layers`` keeps the pattern: layer i is full attention when (i + 1) % interval == 0.
``hf_checkpoint`` (a HF folder): its config.json is the architecture, loaded after init.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models import qwen3_5 as tt
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.qwen3_5.model import OffsetRMSNorm, RMSNormGated
from torchtitan.models.qwen3_5.rope import MRoPE
from torchtitan.protocols.model_spec import ModelSpec

from components.models import common, hf
from components.models.common import ExactGroupedExperts, ModelFacts, replace_config
from components.models.gated_deltanet import ApiaryGatedDeltaNet, GatedDeltaRule

# the family's names (FLAVORS, HF_MODEL_TYPES, TORCHTITAN_FLAVORS are read through this module)
from components.models.qwen3_5_arch import FLAVORS, HF_MODEL_TYPES, TORCHTITAN_FLAVORS, Arch  # noqa: F401
from components.models.qwen3_5_hf import TextStateDictAdapter, arch_from_hf_config, canonical_key, hf_text_config, save_hf
from components.models.qwen3_5_model import Qwen35TextModel, TextBlock, parallelize_qwen35_text
from framework import devices
from framework.errors import UserError

STATE_DICT_ADAPTER = TextStateDictAdapter


def arch_of(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None,
            hf_checkpoint: str | None = None) -> Arch:
    """The flavor's architecture with the recipe's overrides; with ``hf_checkpoint`` the folder's
    config.json is the architecture (the flavor supplies nothing) and the user's explicit
    ``n_layers`` (fewer: the first layers) / ``vocab_size`` (equal) are checked against it."""
    if hf_checkpoint:
        return hf.apply_overrides(arch_from_hf_config(hf_checkpoint), hf_checkpoint, n_layers=n_layers,
                                  vocab_size=vocab_size)
    a = FLAVORS[flavor]
    changes = {k: v for k, v in (("n_layers", n_layers), ("vocab_size", vocab_size)) if v is not None}
    return dataclasses.replace(a, **changes) if changes else a


def build_config(a: Arch, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 linear_backend: str = "torch", hf_checkpoint: str | None = None):
    """Arch -> Qwen35TextModel.Config from torchtitan's Qwen3.5 layer builders."""
    rope = MRoPE.Config(dim=a.rotary_dim, max_seq_len=a.max_seq_len, theta=a.rope_theta,
                        mrope_section=list(a.mrope_section))
    shared = dict(n_layers=a.n_layers, dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                  rotary_dim=a.rotary_dim, rope=rope, n_key_heads=a.linear_key_heads,
                  n_value_heads=a.linear_value_heads, key_head_dim=a.linear_key_head_dim,
                  value_head_dim=a.linear_value_head_dim, full_attention_interval=a.full_attention_interval,
                  attn_backend=attn_backend)
    if a.num_experts:
        layers = tt._build_qwen35_moe_layers(moe_hidden_dim=a.moe_hidden_dim, num_experts=a.num_experts,
                                             top_k=a.top_k, shared_expert_hidden_dim=a.shared_expert_hidden_dim,
                                             moe_comm_backend=moe_comm_backend, **shared)
    else:
        layers = tt._build_qwen35_layers(hidden_dim=a.ffn_hidden_dim, **shared)
    blocks = []
    for layer in layers:
        dn = layer.delta_net
        if dn is not None:
            convs = {n: dataclasses.replace(getattr(dn, n), kernel_size=a.conv_kernel)
                     for n in ("conv_q", "conv_k", "conv_v")}
            dn = replace_config(dn, ApiaryGatedDeltaNet.Config, conv_kernel_size=a.conv_kernel,
                                kernel=GatedDeltaRule.Config(backend=linear_backend), **convs)
        if layer.moe is not None:
            routed = layer.moe.routed_experts
            routed.inner_experts = replace_config(routed.inner_experts, ExactGroupedExperts.Config)
        blocks.append(replace_config(layer, TextBlock.Config, delta_net=dn))
    config = Qwen35TextModel.Config(
        vocab_size=a.vocab_size, dim=a.dim, norm=tt._offset_norm(a.dim),
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab_size, embedding_dim=a.dim,
                                        param_init=tt._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab_size, param_init=tt._output_linear_init(a.dim)),
        layers=blocks, max_positions=a.max_seq_len, hf_checkpoint=hf_checkpoint,
        enable_weight_tying=a.tie_embeddings,
    )
    for _, norm, _, _ in list(config.traverse(OffsetRMSNorm.Config)) + list(config.traverse(RMSNormGated.Config)):
        norm.eps = a.norm_eps
    return config


def model_config(flavor: str, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 n_layers: int | None = None, vocab_size: int | None = None,
                 load_balance_coeff: float | None = 1e-3, linear_backend: str | None = None,
                 hf_checkpoint: str | None = None):
    a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
    config = build_config(a, attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                          linear_backend=linear_backend or devices.linear_attention_backend(),
                          hf_checkpoint=hf_checkpoint)
    if hf_checkpoint:
        hf.check_weights(hf_checkpoint, config, sys.modules[__name__], a.n_layers)
    config = common.set_load_balance(config, load_balance_coeff)
    return common.use_device_attention(config)


def hf_key_shapes(key: str, shape: tuple) -> list[tuple[str, tuple]]:
    """A checkpoint key -> its canonical text-only keys and shapes (see hf.check_weights)."""
    ck = canonical_key(key)
    if ck is None:
        return []
    pre = ck.rsplit(".", 1)[0]
    if ck.endswith(".mlp.experts.gate_up_proj") and len(shape) == 3:  # transformers' fused layout [E, 2F, D]
        E, F2, D = shape
        return [(f"{pre}.{e}.{w}.weight", (F2 // 2, D)) for e in range(E) for w in ("gate_proj", "up_proj")]
    if ck.endswith(".mlp.experts.down_proj") and len(shape) == 3:  # [E, D, F]
        E, D, F = shape
        return [(f"{pre}.{e}.down_proj.weight", (D, F)) for e in range(E)]
    return [(ck, shape)]


def model_spec(flavor: str, **kwargs):
    spec = ModelSpec(name="qwen3_5", flavor=flavor, model=model_config(flavor, **kwargs),
                     parallelize_fn=parallelize_qwen35_text, pipelining_fn=None,
                     post_optimizer_build_fn=register_moe_load_balancing_hook,
                     state_dict_adapter=TextStateDictAdapter)
    return common.wrap_parallelize(spec)


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
    """Sizes counted on the meta device from the model itself."""
    a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
    config = build_config(a)
    with torch.device("meta"):
        model = Qwen35TextModel(copy.deepcopy(config))
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".routed_experts." in name:
            expert += p.numel()
    active = total - expert + (expert * a.top_k // a.num_experts if a.num_experts else 0)
    n_attn = sum(1 for layer in config.layers if layer.attention is not None)
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
    )


def _source(a: Arch, hf_checkpoint: str | None) -> str:
    if not hf_checkpoint:
        return ""
    return hf.describe(a, hf_checkpoint, hf.checkpoint_depth(hf.weight_index(hf_checkpoint)))


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


def export_hf(run_dir: str, out_path: str) -> Path:
    """`apiary export RUN_DIR --hf OUT`: the run's latest checkpoint -> a HF text-only folder."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UserError(f"apiary export {run_dir}", "is not a run folder (no config.yaml).",
                        "Point it at runs/RECIPE/TIMESTAMP.")
    cfg = OmegaConf.load(run / "config.yaml")
    if cfg.model.family != "qwen3_5":
        raise UserError(f"apiary export {run_dir}", f"model.family={cfg.model.family}: this exporter writes Qwen3.5.")
    step_dir = hf.latest_step(run)
    a = arch_of(cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size,
                hf_checkpoint=cfg.model.get("hf_checkpoint"))
    config = build_config(a)
    with torch.device("meta"):
        model = Qwen35TextModel(config)
    # torchtitan's DCP checkpoints hold the model's parameters at top level, fp32 master weights
    sd = {k: torch.empty(p.shape, dtype=torch.float32) for k, p in model.named_parameters()}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    hf.warn_routing_bias(model, step_dir)
    return save_hf(sd, a, out_path, config)


# -- the component contract (framework/contracts.py, kind ``model``) --------------------------
Options = common.ModelOptions
# apiary compare: another family is another model (its options: compare's own table of model.* keys)
NUMERICS = {"": "any"}


def model_kwargs(options, ctx) -> dict:
    return common.model_kwargs(options, ctx)


def check(options, ctx) -> None:
    common.check_model(options, ctx)
    if ctx.for_training and ctx.layout is not None:  # planning may explore layouts it cannot train yet
        check_layout(ctx.cfg, ctx.layout)


def apply(options, tc, ctx) -> None:
    common.apply_model(sys.modules[__name__], options, tc, ctx)


def hf_writer(options, ctx) -> hf.HFWriter:
    """state dict -> (HF text-only tensors, config.json) for weight publication (framework/contracts.py)."""
    kw = model_kwargs(options, ctx)
    a = arch_of(options.flavor, n_layers=kw.get("n_layers"), vocab_size=kw.get("vocab_size"),
                hf_checkpoint=kw.get("hf_checkpoint"))
    return hf.HFWriter(model_config(options.flavor, **kw), STATE_DICT_ADAPTER, hf_text_config(a))
