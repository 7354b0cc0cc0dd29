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
from dataclasses import dataclass

import torch
from torchtitan.models.common import Embedding, Linear

from components.models import common
from components.models.common import ModelFacts

UNAVAILABLE = None  # trains on CPU and CUDA


@dataclass(frozen=True)
class Arch:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    vocab_size: int
    num_experts: int = 0  # 0: dense SwiGLU of ffn_hidden_dim in every layer
    top_k: int = 0
    moe_hidden_dim: int = 0
    shared_expert_hidden_dim: int = 0
    ffn_hidden_dim: int = 0
    full_attention_interval: int = 4  # every Nth layer is full attention, the rest GatedDeltaNet
    conv_kernel: int = 4
    rope_theta: float = 10_000_000.0
    mrope_section: tuple = (11, 11, 10)
    max_seq_len: int = 262144
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    @property
    def linear_head_dim(self) -> int:  # older callers; key and value head dims are equal in Qwen3.5
        return self.linear_key_head_dim


_BIG = dict(head_dim=256, rotary_dim=64, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248_320)
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")  # config.json model_type values this family reads (model.hf_checkpoint)
FLAVORS = {
    # MoE (torchtitan qwen3_5 config_registry: _35b_a3b, _122b_a10b, _397b_a17b)
    "35B-A3B": Arch(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, linear_key_heads=16, linear_value_heads=32,
                    num_experts=256, top_k=8, moe_hidden_dim=512, shared_expert_hidden_dim=512, **_BIG),
    "122B-A10B": Arch(dim=3072, n_layers=48, n_heads=32, n_kv_heads=2, linear_key_heads=16, linear_value_heads=64,
                      num_experts=256, top_k=8, moe_hidden_dim=1024, shared_expert_hidden_dim=1024, **_BIG),
    "397B-A17B": Arch(dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, linear_key_heads=16, linear_value_heads=64,
                      num_experts=512, top_k=10, moe_hidden_dim=1024, shared_expert_hidden_dim=1024, **_BIG),
    # dense (torchtitan: _27b, _9b, _4b, _2b, _0_8b; the small three tie embeddings on the hub,
    # torchtitan keeps a separate lm_head and so do we)
    "27B": Arch(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, linear_key_heads=16, linear_value_heads=48,
                ffn_hidden_dim=17408, **_BIG),
    "9B": Arch(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, linear_key_heads=16, linear_value_heads=32,
               ffn_hidden_dim=12288, **_BIG),
    "4B": Arch(dim=2560, n_layers=32, n_heads=16, n_kv_heads=4, linear_key_heads=16, linear_value_heads=32,
               ffn_hidden_dim=9216, **_BIG),
    "2B": Arch(dim=2048, n_layers=24, n_heads=8, n_kv_heads=2, linear_key_heads=16, linear_value_heads=16,
               ffn_hidden_dim=6144, **_BIG),
    "0.8B": Arch(dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, linear_key_heads=16, linear_value_heads=16,
                 ffn_hidden_dim=3584, **_BIG),
    # CPU-sized, same layer kinds (3 GatedDeltaNet : 1 attention), byte vocabulary
    "debug_moe": Arch(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=4,
                      linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      num_experts=8, top_k=2, moe_hidden_dim=32, shared_expert_hidden_dim=32, vocab_size=320,
                      mrope_section=(1, 1, 0), max_seq_len=4096),
    "debug_dense": Arch(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=4,
                        linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        ffn_hidden_dim=128, vocab_size=320, mrope_section=(1, 1, 0), max_seq_len=4096),
}
# Flavor names in torchtitan's registry that share our numbers (checked by the tests).
TORCHTITAN_FLAVORS = ("35B-A3B", "122B-A10B", "397B-A17B", "27B", "9B", "4B", "2B", "0.8B")


def arch_of(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None,
            hf_checkpoint: str | None = None) -> Arch:
    """The flavor's architecture with the recipe's overrides; with ``hf_checkpoint`` the folder's
    config.json is the architecture (the flavor supplies nothing) and the user's explicit
    ``n_layers`` (fewer: the first layers) / ``vocab_size`` (equal) are checked against it."""
    if hf_checkpoint:
        from components.models import hf
        from components.models.qwen3_5_hf import arch_from_hf_config

        return hf.apply_overrides(arch_from_hf_config(hf_checkpoint), hf_checkpoint, n_layers=n_layers,
                                  vocab_size=vocab_size)
    a = FLAVORS[flavor]
    changes = {k: v for k, v in (("n_layers", n_layers), ("vocab_size", vocab_size)) if v is not None}
    return dataclasses.replace(a, **changes) if changes else a


def build_config(a: Arch, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 linear_backend: str = "torch", hf_checkpoint: str | None = None):
    """Arch -> Qwen35TextModel.Config from torchtitan's Qwen3.5 layer builders."""
    from torchtitan.models import qwen3_5 as tt
    from torchtitan.models.qwen3_5.model import OffsetRMSNorm, RMSNormGated
    from torchtitan.models.qwen3_5.rope import MRoPE

    from components.models.gated_deltanet import ApiaryGatedDeltaNet, GatedDeltaRule
    from components.models.qwen3_5_model import ExactGroupedExperts, Qwen35TextModel, TextBlock, replace_config

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
    from framework import devices

    a = arch_of(flavor, n_layers=n_layers, vocab_size=vocab_size, hf_checkpoint=hf_checkpoint)
    config = build_config(a, attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                          linear_backend=linear_backend or devices.linear_attention_backend(),
                          hf_checkpoint=hf_checkpoint)
    if hf_checkpoint:
        from components.models import hf

        hf.check_weights(hf_checkpoint, config, sys.modules[__name__], a.n_layers)
    config = common.set_load_balance(config, load_balance_coeff)
    return common.use_device_attention(config)


def hf_key_shapes(key: str, shape: tuple) -> list[tuple[str, tuple]]:
    """A checkpoint key -> its canonical text-only keys and shapes (see hf.check_weights)."""
    from components.models.qwen3_5_hf import canonical_key

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


def __getattr__(name):  # the adapter's import pulls torchtitan's Qwen3.5 package: only when asked
    if name == "STATE_DICT_ADAPTER":
        from components.models.qwen3_5_hf import TextStateDictAdapter

        return TextStateDictAdapter
    raise AttributeError(name)


def model_spec(flavor: str, **kwargs):
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.protocols.model_spec import ModelSpec

    from components.models.qwen3_5_hf import TextStateDictAdapter
    from components.models.qwen3_5_model import parallelize_qwen35_text

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
    from components.models.qwen3_5_model import Qwen35TextModel

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
    from components.models import hf

    return hf.describe(a, hf_checkpoint, hf.checkpoint_depth(hf.weight_index(hf_checkpoint)))


def check_layout(cfg, layout) -> None:
    """What this family supports of a derived layout (framework.resolve calls it before spawn).

    CP: attention layers all-gather K/V (torchtitan's CP, flex or the CPU dense-mask attention)
    and GatedDeltaNet passes its state along the chain of contiguous parts, so the balancer
    must keep contiguous parts: "headtail" (two per rank, fla's zigzag) or "none".
    """
    from framework.errors import UserError

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


def export_hf(run_dir: str, out_path: str):
    """`apiary export RUN_DIR --hf OUT` for this family (see qwen3_5_hf.export_hf)."""
    from components.models.qwen3_5_hf import export_hf as _export

    return _export(run_dir, out_path)


def unavailable() -> str | None:
    """Why this family cannot train (None: it can)."""
    return UNAVAILABLE


# -- the component contract (framework/contracts.py, kind ``model``) --------------------------
Options = common.ModelOptions


def model_kwargs(options, ctx) -> dict:
    return common.model_kwargs(options, ctx)


def check(options, ctx) -> None:
    common.check_model(options, ctx)
    if ctx.for_training and ctx.layout is not None:  # planning may explore layouts it cannot train yet
        check_layout(ctx.cfg, ctx.layout)


def apply(options, tc, ctx) -> None:
    common.apply_model(sys.modules[__name__], options, tc, ctx)
