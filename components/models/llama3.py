"""Llama 3 family (dense) on torchtitan's Llama 3 model.

This module is the family's contract and imports no torch: ``FLAVORS`` holds each flavor's
architecture numbers (tests/test_model_facts.py checks them against torchtitan's configs) and
``facts`` sizes a model from them. Building it (``model_spec``), HF folders and export live in
llama3_build.py, imported on first use; its public names are reachable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from components.models import family, hf_folder, layer_kinds

# names of the torchtitan side (llama3_build) this module hands out on first use (PEP 562);
# tests/test_model_facts.py checks the list against that module
BUILD_NAMES = ("model_config", "build_config", "arch_from_config", "export_hf", "STATE_DICT_ADAPTER", "HFLlama3Model",
               "TT_FLAVORS")


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
    """Sizes from the architecture (no model built, no torch): the flavor's, or an HF folder's
    config.json with the user's overrides (its tensors are checked against it before a launch:
    family.check_model)."""
    source = ""
    if hf_checkpoint:
        a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
        source = hf_folder.describe(a, hf_checkpoint, hf_folder.checkpoint_depth(hf_folder.weight_index(hf_checkpoint)))
    else:
        a = FLAVORS[flavor]
        a = replace(a, n_layers=n_layers or a.n_layers, vocab_size=vocab_size or a.vocab_size)
    layer = family.params_per_layer(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                    qk_norm=False, ffn_hidden_dim=a.ffn_hidden_dim)
    return family.facts_from_counts(
        family="llama3", flavor=flavor, n_layers=a.n_layers, dim=a.dim, vocab_size=a.vocab_size,
        tie_embeddings=a.tie_embeddings, layer=layer, moe_hidden_dim=0, ffn_hidden_dim=a.ffn_hidden_dim,
        n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, n_attention_layers=a.n_layers,
        max_seq_len=a.max_seq_len, source=source)


# -- HF folders (config.json, read without torch) --------------------------------------------

def arch_from_hf(path) -> Arch:
    c = hf_folder.read_config(path)
    hf_folder.check_family(c, path, "llama3", HF_MODEL_TYPES)
    dim, n, heads, vocab, ffn = hf_folder.need(c, path, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "vocab_size", "intermediate_size")
    rope = hf_folder.rope_params(c)
    kind = rope.get("rope_type") or "default"
    if kind not in ("default", "llama3"):
        hf_folder.refuse(path, f"rope type {kind!r}", "apiary's llama3 reads default and llama3 RoPE.")
    for k in ("attention_bias", "mlp_bias"):
        if c.get(k):
            hf_folder.refuse(path, f"{k}=true")
    if c.get("hidden_act", "silu") != "silu":
        hf_folder.refuse(path, f"hidden_act={c['hidden_act']}")
    scaled = {}
    if kind == "llama3":
        scaled = dict(rope_scaling="llama", scaling_factor=float(rope.get("factor", 8.0)),
                      low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                      original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)))
    return Arch(dim=dim, n_layers=n, n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads,
                head_dim=c.get("head_dim") or dim // heads, vocab_size=vocab, ffn_hidden_dim=ffn,
                rope_theta=float(rope.get("rope_theta", 10000.0)), max_seq_len=c.get("max_position_embeddings", 8192),
                norm_eps=c.get("rms_norm_eps", 1e-6), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                **scaled)


def arch_of(flavor: str, *, n_layers=None, vocab_size=None, hf_checkpoint=None) -> Arch | None:
    if not hf_checkpoint:
        return None
    return hf_folder.apply_overrides(arch_from_hf(hf_checkpoint), hf_checkpoint, n_layers=n_layers, vocab_size=vocab_size)


def model_spec(flavor: str, **kwargs):
    """torchtitan's ModelSpec of this recipe's model (imports the torchtitan side)."""
    return _build().model_spec(flavor, **kwargs)


def hf_writer(options, ctx):
    """state dict -> (HF tensors, config.json) for weight publication (framework/contracts/protocols.py)."""
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


# -- the component contract (framework/contracts/protocols.py, kind ``model``) --------------------------
Options = family.ModelOptions
# apiary compare: another family is another model (its options: compare's own table of model.* keys)
NUMERICS = {"": "any"}
# the planner: its layer kinds' calibrated constants (docs/skills/planner.md)
PLAN_CONSTANTS = layer_kinds.PLAN_CONSTANTS
SKILL = "models"  # docs/skills/models.md
model_kwargs, check, apply = family.family_contract(__name__)
