"""Qwen3.5 architecture numbers: ``Arch``, the flavors and ``arch_from_hf_config`` (an HF folder's
config.json -> Arch), no torch, no torchtitan; shared by the family module (components.models.qwen3_5)
and its HF reader/writer (qwen3_5_hf).
"""

from __future__ import annotations

from dataclasses import dataclass

from components.models import hf_folder
from framework.errors import UserError


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


_BIG = dict(head_dim=256, rotary_dim=64, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248_320)
# config.json model_type values this family reads (model.hf_checkpoint)
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
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
    # debug_moe's layer kinds at head dims vLLM's GPU kernels take (attention 128; GatedDeltaNet 128: vLLM
    # 0.33's GatedDeltaNet kernel refused 64 on an H200, "DSL kernel only supports D=128")
    "vllm_debug_moe": Arch(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=128, rotary_dim=32,
                           linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                           num_experts=8, top_k=2, moe_hidden_dim=128, shared_expert_hidden_dim=128, vocab_size=320,
                           mrope_section=(6, 5, 5), max_seq_len=4096),
    "debug_dense": Arch(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=4,
                        linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        ffn_hidden_dim=128, vocab_size=320, mrope_section=(1, 1, 0), max_seq_len=4096),
}
# Flavor names in torchtitan's registry that share our numbers (checked by the tests).
TORCHTITAN_FLAVORS = ("35B-A3B", "122B-A10B", "397B-A17B", "27B", "9B", "4B", "2B", "0.8B")


def arch_from_hf_config(config):
    """Arch of a Qwen3.5 HF config (path to config.json or its folder, or the dict)."""
    c = hf_folder.read_config(config)
    hf_folder.check_family(c, config if not isinstance(config, dict) else "(config)", "qwen3_5", HF_MODEL_TYPES)
    hf_folder.need(c, config, "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim")
    rope = hf_folder.rope_params(c)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    interval = c.get("full_attention_interval", 4)
    if types:
        full = [i for i, t in enumerate(types[:n]) if t == "full_attention"]
        interval = full[0] + 1 if full else n + 1
        want = [i for i in range(n) if (i + 1) % interval == 0]
        if full != want:
            raise UserError("model.hf_checkpoint", f"layer_types {types[:n]} is not 'full attention every Nth "
                            "layer'; apiary's Qwen3.5 builds that pattern only.")
    moe = bool(c.get("num_experts"))
    return Arch(
        dim=c["hidden_size"], n_layers=n, n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
        head_dim=head_dim, rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        linear_key_heads=c["linear_num_key_heads"], linear_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
        vocab_size=c["vocab_size"],
        num_experts=c["num_experts"] if moe else 0, top_k=c.get("num_experts_per_tok", 0) if moe else 0,
        moe_hidden_dim=c.get("moe_intermediate_size", 0) if moe else 0,
        shared_expert_hidden_dim=c.get("shared_expert_intermediate_size", 0) if moe else 0,
        ffn_hidden_dim=0 if moe else c["intermediate_size"], full_attention_interval=interval,
        conv_kernel=c.get("linear_conv_kernel_dim", 4), rope_theta=float(rope.get("rope_theta", 10000.0)),
        mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
        max_seq_len=c.get("max_position_embeddings", 262144), norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
