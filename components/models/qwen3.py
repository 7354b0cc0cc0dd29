"""Qwen3 family (dense and MoE) on torchtitan's Qwen3 model, plus CPU-sized flavors.

Flavors: torchtitan's (0.6B ... 32B, 30B-A3B, 235B-A22B, debugmodel, debugmodel_moe) and
``tiny_moe`` / ``tiny_dense``: a few hundred thousand parameters, byte vocabulary, for
CPU tests and the embedded default recipe.
"""

from __future__ import annotations

from torchtitan.models import qwen3 as tt_qwen3
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.protocols.model_spec import ModelSpec

from components.models import common


def _tiny(moe: bool, attn_backend: str, moe_comm_backend: str = "standard") -> Qwen3Model.Config:
    dim, head_dim, vocab, n_layers = 64, 16, 320, 2
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1_000_000.0)
    shared = dict(n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim,
                  attn_backend=attn_backend, rope=rope, fuse_qkv=True)
    if moe:
        layers = tt_qwen3._build_qwen3_moe_layers(
            moe_hidden_dim=64, num_experts=8, top_k=2, moe_comm_backend=moe_comm_backend, **shared)
    else:
        layers = tt_qwen3._build_qwen3_layers(hidden_dim=192, **shared)
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=tt_qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=tt_qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt_qwen3._LINEAR_INIT),
        layers=layers,
    )


FLAVORS = {
    **tt_qwen3.qwen3_configs,
    "tiny_moe": lambda attn_backend, moe_comm_backend="standard": _tiny(True, attn_backend, moe_comm_backend),
    "tiny_dense": lambda attn_backend: _tiny(False, attn_backend),
}
MOE_FLAVORS = {"debugmodel_moe", "30B-A3B", "235B-A22B", "tiny_moe"}


def model_config(flavor: str, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 n_layers: int | None = None, vocab_size: int | None = None,
                 load_balance_coeff: float | None = 1e-3):
    kwargs = {"attn_backend": attn_backend}
    if flavor in MOE_FLAVORS:
        kwargs["moe_comm_backend"] = moe_comm_backend
    config = FLAVORS[flavor](**kwargs)
    config = common.resize_layers(config, n_layers)
    config = common.set_vocab(config, vocab_size)
    config = common.set_load_balance(config, load_balance_coeff)
    return common.use_device_attention(config)


def model_spec(flavor: str, **kwargs) -> ModelSpec:
    spec = tt_qwen3.model_registry("0.6B")  # reuse torchtitan's callables for the family
    spec.flavor = flavor
    spec.model = model_config(flavor, **kwargs)
    return common.wrap_parallelize(spec)


def facts(flavor: str, **kwargs) -> common.ModelFacts:
    return common.facts_from_config("qwen3", flavor, model_config(flavor, **kwargs))
