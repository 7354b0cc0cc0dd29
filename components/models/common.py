"""Helpers shared by the model families: architecture edits on torchtitan model configs,
and the facts (sizes, experts, heads) the planner and validator need."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import FlexAttention, GQAttention
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.protocols.model_spec import ModelSpec

from components.models.dense_mask_attention import DenseMaskAttention

# the torch-free half (families' contract modules import it directly)
from components.models.family import (  # noqa: F401
    ModelFacts,
    ModelOptions,
    apply_model,
    check_model,
    family_contract,
    model_kwargs,
)
from components.moe import gloo_alltoall
from framework import devices

devices.on_cpu_parallelize(gloo_alltoall.install)  # CPU: torchtitan's EP all-to-all through gloo


def resize_layers(config, n_layers: int | None):
    """Keep the first n layers, or repeat the last layer's config to grow the stack."""
    if n_layers is None or n_layers == len(config.layers):
        return config
    layers = list(config.layers[:n_layers])
    while len(layers) < n_layers:
        layers.append(copy.deepcopy(config.layers[len(layers) % len(config.layers)]))
    config.layers = layers
    return config


def set_vocab(config, vocab_size: int | None):
    if vocab_size is None:
        return config
    config.vocab_size = vocab_size
    config.tok_embeddings.num_embeddings = vocab_size
    if config.lm_head is not None:
        config.lm_head.out_features = vocab_size
    return config


def set_load_balance(config, coeff: float | None):
    """Auxiliary-loss-free load balancing strength of every MoE layer (None disables it)."""
    for _, moe, _, _ in config.traverse(MoE.Config):
        moe.load_balance_coeff = coeff
    return config


def use_device_attention(config):
    """Swap flex attention for a dense-mask SDPA where flex attention cannot train (CPU)."""
    if devices.flex_attention_trains():
        return config
    devices.uncompiled_block_masks()
    replacement = DenseMaskAttention.Config
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = replacement()
        else:
            setattr(parent, attr, replacement())
    return config


def wrap_parallelize(spec: ModelSpec) -> ModelSpec:
    fn = spec.parallelize_fn

    def parallelize(model, **kwargs):
        return devices.after_parallelize(fn(model, **kwargs))

    return replace(spec, parallelize_fn=parallelize)


def facts_from_config(family: str, flavor: str, config) -> ModelFacts:
    """Count parameters by building the model on the meta device (no memory)."""
    with torch.device("meta"):
        model = copy.deepcopy(config).build()
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name or name.endswith("_EFD") or name.endswith("_EDF"):
            expert += p.numel()
    moes = [c for _, c, _, _ in config.traverse(MoE.Config)]
    attns = [c for _, c, _, _ in config.traverse(GQAttention.Config)]
    num_experts = moes[0].num_experts if moes else 0
    top_k = moes[0].router.top_k if moes else 0
    moe_hidden = moes[0].routed_experts.inner_experts.hidden_dim if moes else 0
    active = total - expert + (expert * top_k // num_experts if num_experts else 0)
    ffn_hidden = 0
    for layer in config.layers:
        ff = getattr(layer, "feed_forward", None)
        if ff is not None:
            ffn_hidden = ff.w1.out_features
            break
    a = attns[0]
    return ModelFacts(
        family=family,
        flavor=flavor,
        n_layers=len(config.layers),
        dim=config.dim,
        vocab_size=config.vocab_size,
        n_params=total,
        n_active_params=active,
        n_expert_params=expert,
        num_experts=num_experts,
        top_k=top_k,
        moe_hidden_dim=moe_hidden,
        ffn_hidden_dim=ffn_hidden,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads or a.n_heads,
        head_dim=a.head_dim or config.dim // a.n_heads,
        n_attention_layers=len(attns),
        max_seq_len=int(getattr(a.rope, "max_seq_len", 0) or 0) if getattr(a, "rope", None) is not None else 0,
    )


class ExactGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts computing in the activations' dtype.

    torchtitan casts expert GEMMs to bf16 always; with bf16 activations (mixed precision)
    this is the same computation, with fp32 activations it stays fp32 (HF parity, CPU tests).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if x_RD.dtype == torch.bfloat16:
            return super().forward(x_RD, num_tokens_per_expert_E)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        w1, w2, w3 = (w.to(x_RD.dtype) for w in (w1, w2, w3))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        try:
            h = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offs)) \
                * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        except (RuntimeError, NotImplementedError):  # no grouped GEMM for this dtype here: loop
            outs = []
            for e, xe in enumerate(x_RD.split(num_tokens_per_expert_E.tolist())):
                outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
            return torch.cat(outs) if outs else x_RD.new_zeros(0, w2.shape[1])


def replace_config(cfg, new_cls, **changes):
    """Rebuild a torchtitan config dataclass as a subclass config (same fields, plus changes)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    values.update(changes)
    return new_cls(**values)


