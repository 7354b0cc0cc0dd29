"""Qwen3.5 family, the torchtitan side: the model config, spec, HF folders and export
(components/models/qwen3_5.py is the family's contract module and imports this on first use).

The model is ``qwen3_5_model.Qwen35TextModel`` (the family's docstring says what it is).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models import qwen3_5 as tt
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.qwen3_5.model import OffsetRMSNorm, RMSNormGated
from torchtitan.models.qwen3_5.rope import MRoPE
from torchtitan.protocols.model_spec import ModelSpec

from components.models import common, hf, hf_export
from components.models.common import ExactGroupedExperts, replace_config
from components.models.gated_deltanet import ApiaryGatedDeltaNet, GatedDeltaRule
from components.models.qwen3_5 import arch_of, model_kwargs
from components.models.qwen3_5_arch import Arch
from components.models.qwen3_5_hf import (  # noqa: F401  (save_hf: one of BUILD_NAMES)
    TextStateDictAdapter,
    canonical_key,
    hf_text_config,
    save_hf,
)
from components.models.qwen3_5_model import Qwen35TextModel, TextBlock, parallelize_qwen35_text
from framework import devices
from framework.errors import UserError

STATE_DICT_ADAPTER = TextStateDictAdapter


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


def export_hf(run_dir: str, out_path: str, *, step: int | None = None, dtype: str = "bfloat16",
              shard_bytes: int | None = None) -> Path:
    """`apiary export RUN_DIR --hf OUT`: a checkpoint of the run (the latest, or ``step``) -> a HF
    text-only folder in ``dtype``, streamed a layer at a time in shards of at most ``shard_bytes``
    (hf_export.export_streamed)."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UserError(f"apiary export {run_dir}", "is not a run folder (no config.yaml).",
                        "Point it at runs/RECIPE/TIMESTAMP.")
    cfg = OmegaConf.load(run / "config.yaml")
    if cfg.model.family != "qwen3_5":
        raise UserError(f"apiary export {run_dir}", f"model.family={cfg.model.family}: this exporter writes Qwen3.5.")
    step_dir = hf_export.checkpoint_step(run, step)
    a = arch_of(cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size,
                hf_checkpoint=cfg.model.get("hf_checkpoint"))
    config = build_config(a)
    with torch.device("meta"):
        model = Qwen35TextModel(config)
    # torchtitan's DCP checkpoints hold the model's parameters at top level, fp32 master weights
    keys = {k: tuple(p.shape) for k, p in model.named_parameters()}
    hf_export.warn_routing_bias(model, step_dir)
    return hf_export.export_streamed(step_dir, out_path, config=config, adapter_cls=TextStateDictAdapter,
                              hf_config=hf_text_config(a), keys=keys, dtype=dtype, shard_bytes=shard_bytes)


def hf_writer(options, ctx) -> hf_export.HFWriter:
    """state dict -> (HF text-only tensors, config.json) for weight publication (framework/contracts/protocols.py)."""
    kw = model_kwargs(options, ctx)
    a = arch_of(options.flavor, n_layers=kw.get("n_layers"), vocab_size=kw.get("vocab_size"),
                hf_checkpoint=kw.get("hf_checkpoint"))
    return hf_export.HFWriter(model_config(options.flavor, **kw), STATE_DICT_ADAPTER, hf_text_config(a))
