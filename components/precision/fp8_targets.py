"""Which linears fp8 converts, and the config swap both backends use (torchao in
components.precision.policies, TransformerEngine in components.precision.te). No torch import.
"""

from __future__ import annotations

PAD_MULTIPLE = 16  # FP8 GEMM alignment: 16 bytes = 16 e4m3 elements


def keep_bf16(fqn: str) -> bool:
    """Linears that stay bf16 under fp8 (see the module docstring)."""
    return fqn == "lm_head" or fqn.endswith(("router.gate", "shared_experts.gate"))


def fp8_linear(fqn: str, in_features: int, out_features: int) -> bool:
    return not keep_bf16(fqn) and in_features % PAD_MULTIPLE == 0 and out_features % PAD_MULTIPLE == 0


def swap_config(model_config, parent, attr, new):
    """Put ``new`` where ``parent[attr]`` (a list) or ``parent.attr`` was; the root config when no parent."""
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return model_config
