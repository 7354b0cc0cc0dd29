"""Qwen3.5 architecture numbers: ``Arch`` and the flavors (no torch, no torchtitan), shared by the
family module (components.models.qwen3_5) and its HF reader/writer (qwen3_5_hf).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # debug_moe's layer kinds at head dims vLLM's GPU kernels take (attention 128, GatedDeltaNet 64)
    "vllm_debug_moe": Arch(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=128, rotary_dim=32,
                           linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                           num_experts=8, top_k=2, moe_hidden_dim=128, shared_expert_hidden_dim=128, vocab_size=320,
                           mrope_section=(6, 5, 5), max_seq_len=4096),
    "debug_dense": Arch(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=4,
                        linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        ffn_hidden_dim=128, vocab_size=320, mrope_section=(1, 1, 0), max_seq_len=4096),
}
# Flavor names in torchtitan's registry that share our numbers (checked by the tests).
TORCHTITAN_FLAVORS = ("35B-A3B", "122B-A10B", "397B-A17B", "27B", "9B", "4B", "2B", "0.8B")
