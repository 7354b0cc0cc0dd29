"""HuggingFace checkpoints for the text-only Qwen3.5 family: architecture, load, export.

* ``arch_from_hf_config(config.json)`` (defined in qwen3_5_arch.py, torch-free): a text config
  (``qwen3_5_moe_text`` / ``qwen3_5_text``)
  or the ``text_config`` of a multimodal one (``qwen3_5_moe`` / ``qwen3_5``) -> ``Arch``.
* ``load_hf(model, path)``: safetensors -> model parameters (plain, FSDP- or EP-sharded
  DTensors), one layer at a time, through ``TextStateDictAdapter``.
* ``save_hf(state_dict, arch, out_path, model_config)``: a torchtitan state dict -> a HF
  text-only folder (config.json + model.safetensors) that ``Qwen3_5MoeForCausalLM`` /
  ``Qwen3_5ForCausalLM`` and ``load_hf`` read (``apiary export`` is qwen3_5.export_hf).

Key formats read: text-only ``model.layers.*`` and multimodal ``model.language_model.layers.*``
(vision ``model.visual.*`` and ``mtp.*`` are skipped); routed experts either per expert
(``mlp.experts.{e}.gate_proj.weight`` ..., the hub layout) or fused in transformers' in-memory
layout (``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]).
Export writes text-only keys with per-expert weights.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

from components.models import hf, hf_export
from components.models.qwen3_5_arch import Arch, arch_from_hf_config  # noqa: F401  (read without torch there)

_MM = "model.language_model."
_SKIP = ("model.visual.", "mtp.", "model.mtp.")
_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")

# --------------------------------------------------------------------------- architecture

def hf_text_config(a) -> dict:
    """config.json of a HF text-only model with this architecture."""
    d = dict(hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
             num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
             linear_num_key_heads=a.linear_key_heads, linear_num_value_heads=a.linear_value_heads,
             linear_key_head_dim=a.linear_key_head_dim, linear_value_head_dim=a.linear_value_head_dim,
             linear_conv_kernel_dim=a.conv_kernel, rms_norm_eps=a.norm_eps, hidden_act="silu",
             max_position_embeddings=a.max_seq_len, tie_word_embeddings=a.tie_embeddings,
             rope_parameters=dict(rope_type="default", rope_theta=a.rope_theta,
                                  partial_rotary_factor=a.rotary_dim / a.head_dim,
                                  mrope_section=list(a.mrope_section), mrope_interleaved=True),
             layer_types=["full_attention" if (i + 1) % a.full_attention_interval == 0 else "linear_attention"
                          for i in range(a.n_layers)])
    if a.num_experts:
        d.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], num_experts=a.num_experts,
                 num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_hidden_dim,
                 shared_expert_intermediate_size=a.shared_expert_hidden_dim)
    else:
        d.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], intermediate_size=a.ffn_hidden_dim)
    return d


# --------------------------------------------------------------------------- state dict adapter

class TextStateDictAdapter(Qwen35StateDictAdapter):
    """torchtitan's Qwen3.5 adapter for text-only checkpoints (see the module docstring)."""

    def from_hf(self, hf_state_dict: dict) -> dict:
        sd, direct, experts = {}, {}, defaultdict(dict)
        for key, value in hf_state_dict.items():
            key = canonical_key(key)
            if key is None:
                continue
            m = _EXPERT.match(key)
            if m:
                experts[m["pre"]][(m["w"], int(m["e"]))] = value
            elif key.endswith(".mlp.experts.gate_up_proj"):  # transformers layout [E, 2F, D]
                w1, w3 = value.chunk(2, dim=1)
                direct[f"layers.{_layer_of(key)}.moe.routed_experts.inner_experts.w1_EFD"] = w1
                direct[f"layers.{_layer_of(key)}.moe.routed_experts.inner_experts.w3_EFD"] = w3
            elif key.endswith(".mlp.experts.down_proj"):  # [E, D, F]
                direct[f"layers.{_layer_of(key)}.moe.routed_experts.inner_experts.w2_EDF"] = value
            else:
                sd[_MM + key[len("model."):] if key.startswith("model.") else key] = value
        head = "lm_head.weight" in sd or f"{_MM}embed_tokens.weight" in sd
        if not head:  # a group of layer weights only: the parent insists on an output head
            sd["lm_head.weight"] = None
        out = super().from_hf(sd)
        if not head:
            out.pop("lm_head.weight", None)
        out.update(direct)
        for pre, parts in experts.items():
            n = 1 + max(e for _, e in parts)
            for w, name in (("gate_proj", "w1_EFD"), ("up_proj", "w3_EFD"), ("down_proj", "w2_EDF")):
                missing = [e for e in range(n) if (w, e) not in parts]
                if missing:
                    raise ValueError(f"HF checkpoint: {pre}.{{e}}.{w} missing for experts {missing[:8]}")
                out[f"layers.{_layer_of(pre)}.moe.routed_experts.inner_experts.{name}"] = torch.stack(
                    [parts[(w, e)] for e in range(n)])
        return out

    def to_hf(self, state_dict: dict) -> dict:
        dense = {k: v for k, v in state_dict.items() if ".routed_experts." not in k}
        out_sd = {}
        for k, v in super().to_hf(dense).items():
            out_sd["model." + k[len(_MM):] if k.startswith(_MM) else k] = v
        for k, v in state_dict.items():
            m = re.match(r"^layers\.(\d+)\.moe\.routed_experts\.inner_experts\.(w1_EFD|w2_EDF|w3_EFD)$", k)
            if not m:
                continue
            w = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}[m[2]]
            for e in range(v.shape[0]):
                out_sd[f"model.layers.{m[1]}.mlp.experts.{e}.{w}.weight"] = v[e]
        return out_sd


def canonical_key(key: str) -> str | None:
    """HF key -> text-only form ``model.…`` / ``lm_head.weight``; None for vision and MTP weights."""
    if key.startswith(_SKIP):
        return None
    if key.startswith(_MM):
        return "model." + key[len(_MM):]
    return key


def _layer_of(key: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", key + ".")[1])


# --------------------------------------------------------------------------- load

@torch.no_grad()
def load_hf(model: torch.nn.Module, path: str) -> None:
    """Copy a HF checkpoint's text weights into ``model`` (any sharding), one layer at a time."""
    hf.load_into(model, path, TextStateDictAdapter(model.config, None), canonical=canonical_key)


# --------------------------------------------------------------------------- export

def save_hf(state_dict: dict, arch, out_path: str, model_config) -> Path:
    """A torchtitan state dict of this family -> HF text-only folder."""
    return hf_export.save(state_dict, model_config, TextStateDictAdapter, hf_text_config(arch), out_path)
