"""Llama 3 family (dense) on torchtitan's Llama 3 model.

This module is the family's contract and imports no torch: ``FLAVORS`` holds each flavor's
architecture numbers (tests/test_model_facts.py checks them against torchtitan's configs) and
``facts`` sizes a model from them. Building it (``model_spec``), HF folders and export live in
llama3_build.py, imported on first use; its public names are reachable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from components.models import family, layer_kinds

# names of the torchtitan side (llama3_build) this module hands out on first use (PEP 562);
# tests/test_model_facts.py checks the list against that module
BUILD_NAMES = ("model_config", "build_config", "arch_from_hf", "arch_from_config", "arch_of", "export_hf",
               "STATE_DICT_ADAPTER", "HFLlama3Model", "TT_FLAVORS")


_build, __getattr__ = family.build_side("components.models.llama3_build", __name__, BUILD_NAMES)


# --------------------------------------------------------------------------- architectures

@dataclass(frozen=True)
class Arch:
    """A Llama architecture read from a HF config.json (``model_type: llama``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_hidden_dim: int
    rope_theta: float = 500_000.0
    rope_scaling: str = "none"  # "llama" for rope_type llama3
    scaling_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_seq_len: int = 131072
    norm_eps: float = 1e-5
    tie_embeddings: bool = False


def _arch(dim, n_layers, n_heads, n_kv_heads, head_dim, vocab, ffn, tied=False) -> Arch:
    return Arch(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                vocab_size=vocab, ffn_hidden_dim=ffn, rope_theta=500_000.0, rope_scaling="llama",
                tie_embeddings=tied)


HF_MODEL_TYPES = ("llama",)  # config.json model_type values this family reads (model.hf_checkpoint)
FLAVORS: dict[str, Arch] = {  # torchtitan 0.3.0's llama3 flavors
    "debugmodel": _arch(256, 6, 16, 16, 16, 2048, 768),
    "1B": _arch(2048, 16, 32, 8, 64, 128256, 8192, tied=True),
    "3B": _arch(3072, 28, 24, 8, 128, 128256, 8192, tied=True),
    "8B": _arch(4096, 32, 32, 8, 128, 128256, 14336),
    "70B": _arch(8192, 80, 64, 8, 128, 128256, 28672),
    "405B": _arch(16384, 126, 128, 8, 128, 128256, 53248),
}


def facts(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None,
          hf_checkpoint: str | None = None, **kwargs) -> family.ModelFacts:
    """Sizes from the architecture (no model built); an HF folder's through the torchtitan side."""
    if hf_checkpoint:
        return _build().facts_of_hf(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint,
                                    **kwargs)
    a = FLAVORS[flavor]
    a = replace(a, n_layers=n_layers or a.n_layers, vocab_size=vocab_size or a.vocab_size)
    layer = family.params_per_layer(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                    qk_norm=False, ffn_hidden_dim=a.ffn_hidden_dim)
    return family.facts_from_counts(
        family="llama3", flavor=flavor, n_layers=a.n_layers, dim=a.dim, vocab_size=a.vocab_size,
        tie_embeddings=a.tie_embeddings, layer=layer, moe_hidden_dim=0, ffn_hidden_dim=a.ffn_hidden_dim,
        n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, n_attention_layers=a.n_layers,
        max_seq_len=a.max_seq_len)


def model_spec(flavor: str, **kwargs):
    """torchtitan's ModelSpec of this recipe's model (imports the torchtitan side)."""
    return _build().model_spec(flavor, **kwargs)


def hf_writer(options, ctx):
    """state dict -> (HF tensors, config.json) for weight publication (framework/contracts.py)."""
    return _build().hf_writer(options, ctx)


def hf_config(a: Arch) -> dict:
    rope = dict(rope_type="default", rope_theta=a.rope_theta)
    if a.rope_scaling == "llama":
        rope.update(rope_type="llama3", factor=a.scaling_factor, low_freq_factor=a.low_freq_factor,
                    high_freq_factor=a.high_freq_factor,
                    original_max_position_embeddings=a.original_max_position_embeddings)
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=a.dim,
                num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                head_dim=a.head_dim, vocab_size=a.vocab_size, intermediate_size=a.ffn_hidden_dim,
                rms_norm_eps=a.norm_eps, hidden_act="silu", max_position_embeddings=a.max_seq_len,
                tie_word_embeddings=a.tie_embeddings, attention_bias=False, mlp_bias=False, rope_parameters=rope)


# -- the component contract (framework/contracts.py, kind ``model``) --------------------------
Options = family.ModelOptions
# apiary compare: another family is another model (its options: compare's own table of model.* keys)
NUMERICS = {"": "any"}
# the planner: its layer kinds' calibrated constants (docs/skills/planner.md)
PLAN_CONSTANTS = layer_kinds.PLAN_CONSTANTS
SKILL = "models"  # docs/skills/models.md
model_kwargs, check, apply = family.family_contract(__name__)
