"""The linear kinds ``adapter.targets`` names, and which torchtitan module each one is.

No torch here: ``train --help``, ``--cfg job`` and the pre-launch checks read it. A target is
matched against the fully qualified name of a ``Linear.Config`` (or the routed experts'
``GroupedExperts.Config``) in a model family's config tree, so every family built on torchtitan's
modules (qwen3, llama3, qwen3_5) exposes its linears without code of its own.
"""

from __future__ import annotations

import re

# target -> what it adapts (the docs, `train --help`, the refusals name these)
TARGETS = {
    "q": "attention query projection (wq; the q rows of a fused wqkv)",
    "k": "attention key projection (wk; the k rows of a fused wqkv)",
    "v": "attention value projection (wv; the v rows of a fused wqkv)",
    "o": "attention output projection (wo)",
    "in_proj_q": "GatedDeltaNet query projection (Qwen3.5)",
    "in_proj_k": "GatedDeltaNet key projection (Qwen3.5)",
    "in_proj_v": "GatedDeltaNet value projection (Qwen3.5)",
    "in_proj_z": "GatedDeltaNet output-gate projection (Qwen3.5)",
    "in_proj_a": "GatedDeltaNet decay projection (Qwen3.5; one output per value head)",
    "in_proj_b": "GatedDeltaNet beta projection (Qwen3.5; one output per value head)",
    "out_proj": "GatedDeltaNet output projection (Qwen3.5)",
    "mlp": "dense SwiGLU feed-forward: gate (w1), up (w3), down (w2)",
    "shared_expert": "the MoE shared expert's gate, up and down projections (not its scalar gate)",
    "experts": "the routed experts' gate, up and down projections: one A/B pair per expert and weight",
    "lm_head": "the output projection to the vocabulary",
}
# the targets a recipe gets when it names none: PEFT's usual attention-only choice
DEFAULT_TARGETS = ("q", "k", "v", "o")

# fully qualified config name -> (target, part of a fused linear or None)
_LINEAR_RULES = [
    (re.compile(r"(^|\.)wqkv$"), "fused_qkv", None),
    (re.compile(r"(^|\.)(attention|attn)\.(qkv_linear\.)?wq$"), "q", None),
    (re.compile(r"(^|\.)(attention|attn)\.(qkv_linear\.)?wk$"), "k", None),
    (re.compile(r"(^|\.)(attention|attn)\.(qkv_linear\.)?wkv$"), "kv", None),  # QKVLinear builds wk and wv from it
    (re.compile(r"(^|\.)(attention|attn)\.(qkv_linear\.)?wv$"), "v", None),
    (re.compile(r"(^|\.)(attention|attn)\.wo$"), "o", None),
    (re.compile(r"(^|\.)(delta_net|attn)\.(in_proj_[qkvzab]|out_proj)$"), None, None),  # the last segment
    (re.compile(r"(^|\.)feed_forward\.w[123]$"), "mlp", None),
    (re.compile(r"(^|\.)shared_experts\.w[123]$"), "shared_expert", None),
    (re.compile(r"^lm_head$"), "lm_head", None),
]


def linear_target(fqn: str) -> str | None:
    """The target a linear's config name belongs to: a TARGETS name, ``fused_qkv`` (the q, k and v
    rows of one fused projection), ``kv`` (one config building both k and v), or None."""
    for pattern, target, _ in _LINEAR_RULES:
        if pattern.search(fqn):
            return target if target is not None else fqn.rsplit(".", 1)[-1]
    return None


def is_adapter_param(name: str) -> bool:
    """A parameter or state-dict key of an adapter (its last segment starts with ``lora_``)."""
    return name.rsplit(".", 1)[-1].startswith("lora_")
