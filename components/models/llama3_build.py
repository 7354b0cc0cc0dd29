"""Llama 3 family, the torchtitan side: model configs and spec, HF folders and export
(components/models/llama3.py is the family's contract module and imports this on first use)."""

from __future__ import annotations

import sys

from torchtitan.models import llama3 as tt_llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from components.models import common, hf, hf_export
from components.models.family import model_kwargs  # noqa: F401  (hf.py reads it off this module)
from components.models.llama3 import Arch, arch_from_hf, arch_of, hf_config  # noqa: F401

TT_FLAVORS = tt_llama3.llama3_configs  # flavor -> torchtitan config builder (llama3.FLAVORS: their Arch)


def model_config(flavor: str, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 n_layers: int | None = None, vocab_size: int | None = None,
                 load_balance_coeff: float | None = 1e-3, hf_checkpoint: str | None = None):
    """The flavor's config, or with ``hf_checkpoint`` the folder's architecture (flavor: defaults only)."""
    if hf_checkpoint:
        a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
        config = build_config(a, attn_backend=attn_backend, hf_checkpoint=hf_checkpoint)
        hf.check_weights(hf_checkpoint, config, _self(), a.n_layers)
        return common.use_device_attention(config)
    config = TT_FLAVORS[flavor](attn_backend=attn_backend)
    config = common.resize_layers(config, n_layers)
    config = common.set_vocab(config, vocab_size)
    config = common.set_load_balance(config, load_balance_coeff)
    config = common.replace_config(config, HFLlama3Model.Config)  # called without masks (build_model), attend causally
    return common.use_device_attention(config)


def model_spec(flavor: str, **kwargs) -> ModelSpec:
    spec = tt_llama3.model_registry("debugmodel")
    spec.flavor = flavor
    spec.model = model_config(flavor, **kwargs)
    return common.wrap_parallelize(spec)


# --------------------------------------------------------------------------- HuggingFace folders

STATE_DICT_ADAPTER = Llama3StateDictAdapter
HFLlama3Model = hf.model_class(Llama3Model, STATE_DICT_ADAPTER, "HFLlama3Model", __name__)


def build_config(a: Arch, *, attn_backend: str = "flex", hf_checkpoint: str | None = None) -> HFLlama3Model.Config:
    """Arch -> torchtitan Llama 3 config (separate q/k/v projections, the HF layout)."""
    rope = ComplexRoPE.Config(dim=a.head_dim, max_seq_len=a.max_seq_len, theta=a.rope_theta, scaling=a.rope_scaling,
                              scaling_factor=a.scaling_factor, low_freq_factor=a.low_freq_factor,
                              high_freq_factor=a.high_freq_factor,
                              original_max_position_embeddings=a.original_max_position_embeddings)
    norm = dict(param_init=tt_llama3._NORM_INIT, eps=a.norm_eps)
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=a.dim, **norm),
        ffn_norm=RMSNorm.Config(normalized_shape=a.dim, **norm),
        attention=make_gqa_config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                  wqkv_param_init=tt_llama3._LINEAR_INIT, wo_param_init=tt_llama3._depth_init(i),
                                  inner_attention=get_attention_config(attn_backend), fuse_qkv=False, rope=rope),
        feed_forward=make_ffn_config(dim=a.dim, hidden_dim=a.ffn_hidden_dim, w1_param_init=tt_llama3._LINEAR_INIT,
                                     w2w3_param_init=tt_llama3._depth_init(i)),
    ) for i in range(a.n_layers)]
    return HFLlama3Model.Config(
        dim=a.dim, vocab_size=a.vocab_size, enable_weight_tying=a.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab_size, embedding_dim=a.dim,
                                        param_init=tt_llama3._EMBEDDING_SKIP_INIT if a.tie_embeddings
                                        else tt_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=a.dim, **norm),
        lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab_size,
                              param_init=tt_llama3._output_linear_init(a.dim)),
        layers=layers, hf_checkpoint=hf_checkpoint)


def arch_from_config(config) -> Arch:
    """The Arch of a torchtitan Llama 3 config (a flavor's or an HF folder's), for export."""
    attn = config.layers[0].attention
    r = attn.rope
    return Arch(dim=config.dim, n_layers=len(config.layers), n_heads=attn.n_heads,
                n_kv_heads=attn.n_kv_heads or attn.n_heads, head_dim=attn.head_dim or config.dim // attn.n_heads,
                vocab_size=config.vocab_size, ffn_hidden_dim=config.layers[0].feed_forward.w1.out_features,
                rope_theta=r.theta, rope_scaling=r.scaling, scaling_factor=r.scaling_factor,
                low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                original_max_position_embeddings=r.original_max_position_embeddings, max_seq_len=r.max_seq_len,
                norm_eps=config.norm.eps, tie_embeddings=bool(config.enable_weight_tying))


def export_hf(run_dir: str, out_path: str, *, step: int | None = None, dtype: str = "bfloat16",
              shard_bytes: int | None = None):
    """`apiary export RUN_DIR --hf OUT [--step N] [--dtype D]` for this family (hf_export.export_run: streamed)."""
    return hf_export.export_run(run_dir, out_path, _self(), step=step, dtype=dtype, shard_bytes=shard_bytes)


def _self():
    return sys.modules[__name__]


def hf_writer(options, ctx) -> hf_export.HFWriter:
    """state dict -> (HF tensors, config.json) for weight publication (framework/contracts/protocols.py)."""
    return hf_export.hf_writer(_self(), options, ctx)
