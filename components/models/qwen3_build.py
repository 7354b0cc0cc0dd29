"""Qwen3 family, the torchtitan side: model configs and spec, YaRN RoPE, HF folders and export
(components/models/qwen3.py is the family's contract module and imports this on first use).

Flavors: torchtitan's (0.6B ... 32B, 30B-A3B, 235B-A22B, debugmodel, debugmodel_moe),
``30B-A3B-yarn`` / ``235B-A22B-yarn`` (the same weights with the YaRN RoPE scaling the Qwen3 model
cards publish for long context: factor 4 over 32768 positions, RoPE length 131072) and
``tiny_moe`` / ``tiny_dense``: a few hundred thousand parameters, byte vocabulary, for
CPU tests and the embedded default recipe.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from torchtitan.models import qwen3 as tt_qwen3
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from components.models import common, hf, hf_export
from components.models.common import ExactGroupedExperts, replace_config
from components.models.family import model_kwargs  # noqa: F401  (hf.py reads it off this module)
from components.models.qwen3 import (  # noqa: F401  (the torch-free side's names, reachable here too)
    MOE_FLAVORS,
    QWEN3_YARN,
    Arch,
    YaRN,
    arch_from_hf,
    arch_of,
    hf_config,
)


class YaRNRoPE(CosSinRoPE):
    """torchtitan's cos/sin RoPE with YaRN frequencies (``scaling="yarn"``, torchtitan's own formula)
    and YaRN's attention factor m folded into the cache: cos and sin times m, so q.k is scaled by
    m^2, as transformers' Qwen3 applies it. torchtitan's rope is a pure rotation that leaves m to
    the attention, and its Qwen3 attention does not apply it; this class does. The cache is a
    non-persistent buffer: checkpoints are the same as with CosSinRoPE."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        attention_factor: float | None = None
        """cos/sin multiplier m; None: 0.1 ln(rope_factor) + 1 (YaRN's default, transformers' too)"""

    def _precompute_cache(self):
        return super()._precompute_cache() * yarn_attention_factor(self.config)


def yarn_attention_factor(rope) -> float:
    """YaRN's m of a rope config (1.0 without YaRN scaling)."""
    if getattr(rope, "scaling", "none") != "yarn":
        return 1.0
    m = getattr(rope, "attention_factor", None)
    if m is not None:
        return float(m)
    return 0.1 * math.log(rope.rope_factor) + 1.0 if rope.rope_factor > 1.0 else 1.0


def yarn_rope(y: YaRN, dim: int, theta: float, max_seq_len: int) -> YaRNRoPE.Config:
    """torchtitan's RoPE config with ``y``'s YaRN frequencies over ``dim`` and ``theta``."""
    return YaRNRoPE.Config(dim=dim, theta=theta, max_seq_len=max(max_seq_len, y.max_seq_len), scaling="yarn",
                           rope_factor=y.factor, original_seq_len=y.original_max_position_embeddings,
                           beta_fast=y.beta_fast, beta_slow=y.beta_slow, truncate=y.truncate,
                           attention_factor=y.attention_factor)


def with_yarn(config, yarn: YaRN):
    """Every attention layer's RoPE replaced by ``yarn`` over the same head dim and theta."""
    for layer in config.layers:
        r = layer.attention.rope
        layer.attention.rope = yarn_rope(yarn, r.dim, r.theta, r.max_seq_len)
    return config


def _tiny(moe: bool, attn_backend: str, moe_comm_backend: str = "standard", flavor: str | None = None
          ) -> Qwen3Model.Config:
    """apiary's small flavors (tiny_moe, tiny_dense, vllm_tiny_moe) from their Arch in qwen3.FLAVORS."""
    from components.models.qwen3 import FLAVORS  # reason: the family module imports this one
    a = FLAVORS[flavor or ("tiny_moe" if moe else "tiny_dense")]
    dim, head_dim, vocab, n_layers = a.dim, a.head_dim, a.vocab_size, a.n_layers
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=a.max_seq_len, theta=a.rope_theta)
    shared = dict(n_layers=n_layers, dim=dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=head_dim,
                  attn_backend=attn_backend, rope=rope, fuse_qkv=True)
    if moe:
        layers = tt_qwen3._build_qwen3_moe_layers(
            moe_hidden_dim=a.moe_hidden_dim, num_experts=a.num_experts, top_k=a.top_k,
            moe_comm_backend=moe_comm_backend, **shared)
    else:
        layers = tt_qwen3._build_qwen3_layers(hidden_dim=a.ffn_hidden_dim, **shared)
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=tt_qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=tt_qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt_qwen3._LINEAR_INIT),
        layers=layers,
    )


TT_FLAVORS = {  # flavor -> torchtitan config builder (qwen3.FLAVORS holds the same flavors' Arch)
    **tt_qwen3.qwen3_configs,
    "tiny_moe": lambda attn_backend, moe_comm_backend="standard": _tiny(True, attn_backend, moe_comm_backend),
    "tiny_dense": lambda attn_backend: _tiny(False, attn_backend),
    "vllm_tiny_moe": lambda attn_backend, moe_comm_backend="standard": _tiny(True, attn_backend, moe_comm_backend,
                                                                             "vllm_tiny_moe"),
    **{f"{base}-yarn": (lambda base: lambda attn_backend, moe_comm_backend="standard": with_yarn(
        tt_qwen3.qwen3_configs[base](attn_backend=attn_backend, moe_comm_backend=moe_comm_backend), QWEN3_YARN))(base)
       for base in ("30B-A3B", "235B-A22B")},
}


def model_config(flavor: str, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 n_layers: int | None = None, vocab_size: int | None = None,
                 load_balance_coeff: float | None = 1e-3, hf_checkpoint: str | None = None):
    """The flavor's config, or with ``hf_checkpoint`` the folder's architecture (flavor: defaults only)."""
    if hf_checkpoint:
        a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
        config = build_config(a, attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                              hf_checkpoint=hf_checkpoint)
        hf.check_weights(hf_checkpoint, config, _self(), a.n_layers)
        config = common.set_load_balance(config, load_balance_coeff)
        return common.use_device_attention(config)
    kwargs = {"attn_backend": attn_backend}
    if flavor in MOE_FLAVORS:
        kwargs["moe_comm_backend"] = moe_comm_backend
    config = TT_FLAVORS[flavor](**kwargs)
    config = common.resize_layers(config, n_layers)
    config = common.set_vocab(config, vocab_size)
    config = common.set_load_balance(config, load_balance_coeff)
    config = common.replace_config(config, HFQwen3Model.Config)  # called without masks (build_model), attend causally
    return common.use_device_attention(config)


def model_spec(flavor: str, **kwargs) -> ModelSpec:
    spec = tt_qwen3.model_registry("0.6B")  # reuse torchtitan's callables for the family
    spec.flavor = flavor
    spec.model = model_config(flavor, **kwargs)
    return common.wrap_parallelize(spec)


def _self():
    return sys.modules[__name__]


def hf_writer(options, ctx) -> hf_export.HFWriter:
    """state dict -> (HF tensors, config.json) for weight publication (framework/contracts/protocols.py)."""
    return hf_export.hf_writer(_self(), options, ctx)


# --------------------------------------------------------------------------- HuggingFace folders

STATE_DICT_ADAPTER = Qwen3StateDictAdapter
HFQwen3Model = hf.model_class(Qwen3Model, STATE_DICT_ADAPTER, "HFQwen3Model", __name__)


def build_config(a: Arch, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 hf_checkpoint: str | None = None) -> HFQwen3Model.Config:
    """Arch -> torchtitan Qwen3 config (separate q/k/v projections, the HF layout)."""
    rope = (yarn_rope(a.yarn, a.head_dim, a.rope_theta, a.max_seq_len) if a.yarn else
            CosSinRoPE.Config(dim=a.head_dim, max_seq_len=a.max_seq_len, theta=a.rope_theta))
    shared = dict(n_layers=a.n_layers, dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                  attn_backend=attn_backend, rope=rope, fuse_qkv=False)
    if a.num_experts:
        layers = tt_qwen3._build_qwen3_moe_layers(moe_hidden_dim=a.moe_hidden_dim, num_experts=a.num_experts,
                                                  top_k=a.top_k, moe_comm_backend=moe_comm_backend, **shared)
    else:
        layers = tt_qwen3._build_qwen3_layers(hidden_dim=a.ffn_hidden_dim, **shared)
    config = HFQwen3Model.Config(
        vocab_size=a.vocab_size, dim=a.dim, norm=tt_qwen3._qwen3_norm(a.dim), enable_weight_tying=a.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab_size, embedding_dim=a.dim,
                                        param_init=tt_qwen3._EMBEDDING_SKIP_INIT if a.tie_embeddings
                                        else tt_qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab_size, param_init=tt_qwen3._LINEAR_INIT),
        layers=layers, hf_checkpoint=hf_checkpoint)
    for _, norm, _, _ in config.traverse(RMSNorm.Config):
        norm.eps = a.norm_eps
    for _, moe, _, _ in config.traverse(MoE.Config):
        moe.router.route_norm = a.route_norm
        moe.routed_experts.inner_experts = replace_config(moe.routed_experts.inner_experts,
                                                          ExactGroupedExperts.Config)
    return config


def export_hf(run_dir: str, out_path: str, *, step: int | None = None, dtype: str = "bfloat16",
              shard_bytes: int | None = None):
    """`apiary export RUN_DIR --hf OUT [--step N] [--dtype D]` for this family (hf_export.export_run: streamed)."""
    return hf_export.export_run(run_dir, out_path, _self(), step=step, dtype=dtype, shard_bytes=shard_bytes)


def arch_from_config(config) -> Arch:
    """The Arch of a torchtitan Qwen3 config (a flavor's or an HF folder's), for export."""
    attn = config.layers[0].attention
    moes = [m for _, m, _, _ in config.traverse(MoE.Config)]
    ff = config.layers[0].feed_forward
    norm = [n for _, n, _, _ in config.traverse(RMSNorm.Config)][0]
    return Arch(dim=config.dim, n_layers=len(config.layers), n_heads=attn.n_heads,
                n_kv_heads=attn.n_kv_heads or attn.n_heads, head_dim=attn.head_dim or config.dim // attn.n_heads,
                vocab_size=config.vocab_size, ffn_hidden_dim=ff.w1.out_features if ff is not None else 0,
                num_experts=moes[0].num_experts if moes else 0, top_k=moes[0].router.top_k if moes else 0,
                moe_hidden_dim=moes[0].routed_experts.inner_experts.hidden_dim if moes else 0,
                route_norm=moes[0].router.route_norm if moes else True, rope_theta=attn.rope.theta,
                max_seq_len=attn.rope.max_seq_len, norm_eps=norm.eps,
                tie_embeddings=bool(config.enable_weight_tying), yarn=_yarn_of_rope(attn.rope))


def _yarn_of_rope(r) -> YaRN | None:
    if getattr(r, "scaling", "none") != "yarn":
        return None
    return YaRN(factor=r.rope_factor, original_max_position_embeddings=r.original_seq_len, beta_fast=r.beta_fast,
                beta_slow=r.beta_slow, truncate=r.truncate, attention_factor=getattr(r, "attention_factor", None))
