"""Qwen3 family (dense and MoE) on torchtitan's Qwen3 model, plus CPU-sized flavors.

Flavors: torchtitan's (0.6B ... 32B, 30B-A3B, 235B-A22B, debugmodel, debugmodel_moe),
``30B-A3B-yarn`` / ``235B-A22B-yarn`` (the same weights with the YaRN RoPE scaling the Qwen3 model
cards publish for long context: factor 4 over 32768 positions, RoPE length 131072) and
``tiny_moe`` / ``tiny_dense``: a few hundred thousand parameters, byte vocabulary, for
CPU tests and the embedded default recipe.

This module is the family's contract and imports no torch: ``FLAVORS`` holds each flavor's
architecture numbers (tests/test_model_facts.py checks them against torchtitan's configs) and
``facts`` sizes a model from them. Building it (``model_spec``), HF folders and export live in
qwen3_build.py, imported on first use; its public names are reachable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from components.models import family, hf_folder, layer_kinds

# names of the torchtitan side (qwen3_build) this module hands out on first use (PEP 562);
# tests/test_model_facts.py checks the list against that module
BUILD_NAMES = ("model_config", "build_config", "arch_from_config", "export_hf",
               "STATE_DICT_ADAPTER", "HFQwen3Model", "YaRNRoPE", "yarn_attention_factor", "with_yarn", "TT_FLAVORS")


_build, __getattr__ = family.build_side("components.models.qwen3_build", __name__, BUILD_NAMES)


@dataclass(frozen=True)
class YaRN:
    """YaRN RoPE scaling as a HF config.json's ``rope_parameters`` states it (``rope_type: yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    @property
    def max_seq_len(self) -> int:
        """The RoPE length it extends to: original positions x factor."""
        return int(self.original_max_position_embeddings * self.factor)


# The Qwen3 model cards' long-context setting (config.json of Qwen3-30B-A3B and Qwen3-235B-A22B:
# max_position_embeddings 40960; their cards add rope_scaling yarn, factor 4.0, original 32768 -> 131072)
QWEN3_YARN = YaRN(factor=4.0, original_max_position_embeddings=32768)


@dataclass(frozen=True)
class Arch:
    """A Qwen3 architecture read from a HF config.json (``qwen3`` dense or ``qwen3_moe``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_hidden_dim: int = 0  # dense SwiGLU (0 for MoE)
    num_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0
    route_norm: bool = True  # HF norm_topk_prob
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960  # RoPE length: max_position_embeddings (with YaRN at least original x factor)
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    yarn: YaRN | None = None  # rope_type yarn (None: default RoPE)


def _moe(dim, n_layers, n_heads, n_kv_heads, experts, hidden, vocab=151936, **kw) -> Arch:
    return Arch(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=128, vocab_size=vocab,
                num_experts=experts, top_k=8, moe_hidden_dim=hidden, **kw)


def _dense(dim, n_layers, n_heads, ffn, tied, vocab=151936, **kw) -> Arch:
    return Arch(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, vocab_size=vocab,
                ffn_hidden_dim=ffn, tie_embeddings=tied, **kw)


HF_MODEL_TYPES = ("qwen3", "qwen3_moe")  # config.json model_type values this family reads (model.hf_checkpoint)
_DEBUG = _dense(256, 8, 16, 3072, True, vocab=2048, max_seq_len=4096)
_TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=320, max_seq_len=4096)
FLAVORS: dict[str, Arch] = {  # torchtitan 0.3.0's qwen3 flavors, then apiary's
    "debugmodel": _DEBUG,
    "debugmodel_non_fused_qkv": _DEBUG,
    "0.6B": _dense(1024, 28, 16, 3072, True),
    "1.7B": _dense(2048, 28, 16, 6144, True),
    "4B": _dense(2560, 36, 32, 9728, True),
    "8B": _dense(4096, 36, 32, 12288, False),
    "14B": _dense(5120, 40, 40, 17408, False),
    "32B": _dense(5120, 64, 64, 25600, False),
    "debugmodel_moe": _moe(256, 8, 16, 8, 64, 768, vocab=2048, max_seq_len=4096),
    "30B-A3B": _moe(2048, 48, 32, 4, 128, 768),
    "235B-A22B": _moe(4096, 94, 64, 4, 128, 1536, rope_theta=5_000_000.0),
    "tiny_moe": Arch(**_TINY, num_experts=8, top_k=2, moe_hidden_dim=64),
    "tiny_dense": Arch(**_TINY, ffn_hidden_dim=192),
    # tiny_moe with head_dim 64 and dim 256: small enough for a CPU, shaped for vLLM's GPU kernels
    "vllm_tiny_moe": Arch(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=320, max_seq_len=4096,
                          num_experts=8, top_k=2, moe_hidden_dim=128),
}
FLAVORS.update({f"{base}-yarn": replace(FLAVORS[base], max_seq_len=QWEN3_YARN.max_seq_len, yarn=QWEN3_YARN)
                for base in ("30B-A3B", "235B-A22B")})
MOE_FLAVORS = {name for name, a in FLAVORS.items() if a.num_experts}
# flavors with RoPE scaling -> their RoPE length (family.check_model names them when a sequence is too long)
LONG_CONTEXT_FLAVORS = {name: a.max_seq_len for name, a in FLAVORS.items() if a.yarn}


def facts(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None,
          hf_checkpoint: str | None = None, **kwargs) -> family.ModelFacts:
    """Sizes from the architecture (no model built, no torch): the flavor's, or an HF folder's
    config.json with the user's overrides (its tensors are checked against it before a launch:
    family.check_model)."""
    if hf_checkpoint:
        a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
        return facts_of(a, flavor, source=hf_folder.describe(a, hf_checkpoint, hf_folder.checkpoint_depth(
            hf_folder.weight_index(hf_checkpoint))))
    a = FLAVORS[flavor]
    a = replace(a, n_layers=n_layers or a.n_layers, vocab_size=vocab_size or a.vocab_size)
    return facts_of(a, flavor)


def facts_of(a: Arch, flavor: str, source: str = "") -> family.ModelFacts:
    layer = family.params_per_layer(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                    qk_norm=True, ffn_hidden_dim=a.ffn_hidden_dim, num_experts=a.num_experts,
                                    moe_hidden_dim=a.moe_hidden_dim)
    return family.facts_from_counts(
        family="qwen3", flavor=flavor, n_layers=a.n_layers, dim=a.dim, vocab_size=a.vocab_size,
        tie_embeddings=a.tie_embeddings, layer=layer, num_experts=a.num_experts, top_k=a.top_k,
        moe_hidden_dim=a.moe_hidden_dim, ffn_hidden_dim=a.ffn_hidden_dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
        head_dim=a.head_dim, n_attention_layers=a.n_layers, max_seq_len=a.max_seq_len, source=source)


# -- HF folders (config.json, read without torch) --------------------------------------------

def arch_from_hf(path) -> Arch:
    c = hf_folder.read_config(path)
    hf_folder.check_family(c, path, "qwen3", HF_MODEL_TYPES)
    dim, n, heads, vocab = hf_folder.need(c, path, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    rope = hf_folder.rope_params(c)
    yarn = None
    if rope.get("rope_type") == "yarn":
        yarn = _yarn_of(rope, c, path)
    elif rope.get("rope_type", "default") not in ("default", None):
        hf_folder.refuse(path, f"rope type {rope['rope_type']!r} (RoPE scaling)",
                         "apiary's qwen3 reads default and yarn RoPE.")
    if c.get("attention_bias"):
        hf_folder.refuse(path, "attention_bias=true")
    if c.get("use_sliding_window"):
        hf_folder.refuse(path, "use_sliding_window=true")
    if c.get("hidden_act", "silu") != "silu":
        hf_folder.refuse(path, f"hidden_act={c['hidden_act']}")
    experts = c.get("num_experts") or c.get("num_local_experts") or 0  # transformers 5 saves the latter
    moe = bool(experts)
    if moe and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1):
        hf_folder.refuse(path, "dense layers between MoE layers (mlp_only_layers / decoder_sparse_step)")
    return Arch(
        dim=dim, n_layers=n, n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or dim // heads, vocab_size=vocab,
        ffn_hidden_dim=0 if moe else hf_folder.need(c, path, "intermediate_size")[0],
        num_experts=experts, top_k=c.get("num_experts_per_tok", 0) if moe else 0,
        moe_hidden_dim=hf_folder.need(c, path, "moe_intermediate_size")[0] if moe else 0,
        route_norm=bool(c.get("norm_topk_prob", True)), rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_seq_len=max(c.get("max_position_embeddings", 40960), yarn.max_seq_len if yarn else 0),
        norm_eps=c.get("rms_norm_eps", 1e-6), tie_embeddings=bool(c.get("tie_word_embeddings", False)), yarn=yarn)


def _yarn_of(rope: dict, c: dict, path) -> YaRN:
    """rope_parameters of rope_type yarn, read as transformers reads them (original positions default
    to max_position_embeddings); DeepSeek's mscale / mscale_all_dim variant is refused."""
    for k in ("mscale", "mscale_all_dim"):
        if rope.get(k):
            hf_folder.refuse(path, f"yarn RoPE with {k} (DeepSeek's attention-factor variant)")
    if not isinstance(rope.get("factor"), (int, float)) or rope["factor"] < 1:
        hf_folder.refuse(path, f"yarn RoPE with factor {rope.get('factor')!r}", "Set rope_parameters.factor to a number >= 1.")
    original = c.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
        or c.get("max_position_embeddings", 40960)
    af = rope.get("attention_factor")
    return YaRN(factor=float(rope["factor"]), original_max_position_embeddings=int(original),
                beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                truncate=bool(rope.get("truncate", True)), attention_factor=None if af is None else float(af))


def arch_of(flavor: str, *, n_layers=None, vocab_size=None, hf_checkpoint=None) -> Arch | None:
    """The architecture of an HF folder with the user's explicit overrides (None without one)."""
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
    d = dict(hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
             num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
             rms_norm_eps=a.norm_eps, hidden_act="silu", max_position_embeddings=a.max_seq_len,
             tie_word_embeddings=a.tie_embeddings, attention_bias=False,
             rope_parameters=dict(rope_type="default", rope_theta=a.rope_theta))
    if a.yarn:  # max_position_embeddings is then the extended length (transformers' convention)
        y = a.yarn
        d["rope_parameters"].update(rope_type="yarn", factor=y.factor,
                                    original_max_position_embeddings=y.original_max_position_embeddings,
                                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, truncate=y.truncate)
        if y.attention_factor is not None:
            d["rope_parameters"]["attention_factor"] = y.attention_factor
    if a.num_experts:
        d.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=a.num_experts,
                 num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_hidden_dim, norm_topk_prob=a.route_norm,
                 decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=a.moe_hidden_dim)
    else:
        d.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=a.ffn_hidden_dim)
    return d


# -- the component contract (framework/contracts/protocols.py, kind ``model``) --------------------------
Options = family.ModelOptions
# apiary compare: another family is another model (its options: compare's own table of model.* keys)
NUMERICS = {"": "any"}
# the planner: its layer kinds' calibrated constants (docs/skills/planner.md)
PLAN_CONSTANTS = layer_kinds.PLAN_CONSTANTS
SKILL = "models"  # docs/skills/models.md
model_kwargs, check, apply = family.family_contract(__name__)
