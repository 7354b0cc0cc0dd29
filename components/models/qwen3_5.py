"""Qwen3.5 (hybrid GatedDeltaNet + gated attention, MoE), text only: architecture facts.

Sizes are computed from the architecture so recipes resolve, derive their layout and plan
memory today. Training needs the text-only model family on torchtitan's Qwen3.5 blocks
(no vision encoder, a CPU GatedDeltaNet path, context parallelism across both layer
kinds); until it lands, asking to train says so before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.models.common import ModelFacts

UNAVAILABLE = (
    "training Qwen3.5 needs apiary's text-only Qwen3.5 model family, which is not built yet: "
    "torchtitan 0.3.0's qwen3_5 always builds its vision encoder, runs GatedDeltaNet only "
    "through fla's Triton kernels and raises NotImplementedError for context parallelism."
)


@dataclass(frozen=True)
class Arch:
    dim: int
    n_layers: int
    full_attention_interval: int  # every Nth layer is full attention, the rest GatedDeltaNet
    n_heads: int
    n_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    moe_hidden_dim: int
    shared_expert_hidden_dim: int
    vocab_size: int
    tie_embeddings: bool = False


FLAVORS = {
    # Qwen3.5-35B-A3B text model (seed 000, ../shared/FACTS.md).
    "35B-A3B": Arch(dim=2048, n_layers=40, full_attention_interval=4, n_heads=16, n_kv_heads=2, head_dim=256,
                    linear_key_heads=16, linear_value_heads=32, linear_head_dim=128, conv_kernel=4,
                    num_experts=256, top_k=8, moe_hidden_dim=512, shared_expert_hidden_dim=512,
                    vocab_size=248_320),
    # Same layer kinds at CPU size.
    "debug_moe": Arch(dim=64, n_layers=4, full_attention_interval=4, n_heads=4, n_kv_heads=2, head_dim=16,
                      linear_key_heads=2, linear_value_heads=4, linear_head_dim=16, conv_kernel=4,
                      num_experts=8, top_k=2, moe_hidden_dim=32, shared_expert_hidden_dim=32, vocab_size=320),
}


def _counts(a: Arch, n_layers: int) -> tuple[int, int, int, dict]:
    d = a.dim
    n_attn = n_layers // a.full_attention_interval
    n_lin = n_layers - n_attn
    # gated attention: q and its output gate, k, v, o; q/k RMSNorm over head_dim
    attn = d * (2 * a.n_heads * a.head_dim) + 2 * d * a.n_kv_heads * a.head_dim \
        + a.n_heads * a.head_dim * d + 2 * a.head_dim
    key_dim = a.linear_key_heads * a.linear_head_dim
    value_dim = a.linear_value_heads * a.linear_head_dim
    # GatedDeltaNet: q,k,v,z projections, beta/alpha per value head, causal conv over q,k,v,
    # A_log and dt_bias per value head, gated RMSNorm over head dim, output projection
    lin = d * (2 * key_dim + 2 * value_dim) + d * 2 * a.linear_value_heads \
        + (2 * key_dim + value_dim) * a.conv_kernel + 2 * a.linear_value_heads + a.linear_head_dim \
        + value_dim * d
    experts = a.num_experts * 3 * d * a.moe_hidden_dim
    moe_dense = d * a.num_experts + 3 * d * a.shared_expert_hidden_dim + d  # router, shared expert, its gate
    norms = 2 * d
    emb = a.vocab_size * d * (1 if a.tie_embeddings else 2)
    total = emb + d + n_attn * attn + n_lin * lin + n_layers * (experts + moe_dense + norms)
    expert_total = n_layers * experts
    shapes = dict(key_dim=key_dim, value_dim=value_dim, conv_kernel=a.conv_kernel,
                  key_heads=a.linear_key_heads, value_heads=a.linear_value_heads, head_dim=a.linear_head_dim)
    return total, expert_total, n_attn, shapes


def facts(flavor: str, *, n_layers: int | None = None, vocab_size: int | None = None, **_) -> ModelFacts:
    a = FLAVORS[flavor]
    if vocab_size is not None:
        a = Arch(**{**a.__dict__, "vocab_size": vocab_size})
    n = n_layers or a.n_layers
    total, expert, n_attn, shapes = _counts(a, n)
    active = total - expert + expert * a.top_k // a.num_experts
    return ModelFacts(
        family="qwen3_5", flavor=flavor, n_layers=n, dim=a.dim, vocab_size=a.vocab_size,
        n_params=total, n_active_params=active, n_expert_params=expert, num_experts=a.num_experts,
        top_k=a.top_k, moe_hidden_dim=a.moe_hidden_dim, ffn_hidden_dim=0, n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, n_attention_layers=n_attn,
        n_linear_attention_layers=n - n_attn, linear_attn=shapes,
        shared_expert_hidden_dim=a.shared_expert_hidden_dim,
    )


def unavailable() -> str | None:
    """Why this family cannot train yet (None once it can)."""
    return UNAVAILABLE


def model_spec(flavor: str, **kwargs):
    raise RuntimeError(UNAVAILABLE)
