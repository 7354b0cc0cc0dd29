"""LoRA adapters in a built model: finding them, turning them off for a base-only forward, their
parameters, and merging trained adapters into the base weights (``merge_into``). The adapted
modules themselves: components/adapters/modules.py.
"""

from __future__ import annotations

import contextlib

import torch

from components.adapters.modules import _Adapted
from components.adapters.targets import is_adapter_param

# ---------------------------------------------------------------------------- at run time


def adapter_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, _Adapted)]


@contextlib.contextmanager
def adapters_disabled(model):
    """Forwards inside run the frozen base alone (every adapter of ``model`` switched off)."""
    mods = adapter_modules(model)
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, b in zip(mods, before):
            m.lora_enabled = b


def adapter_parameters(model) -> dict:
    return {n: p for n, p in model.named_parameters() if is_adapter_param(n)}


# ---------------------------------------------------------------------------- merging


def base_key(adapter_key: str) -> tuple[str, str]:
    """A state-dict adapter key -> (the base weight key it adapts, its part: "", q, k, v, w1, w2, w3)."""
    prefix, leaf = adapter_key.rsplit(".", 1)
    part = leaf[len("lora_A"):].lstrip("_")
    if part in ("w1", "w3"):
        return f"{prefix}.{part}_EFD", part
    if part == "w2":
        return f"{prefix}.w2_EDF", part
    if part in ("q", "k", "v"):  # a fused wqkv: its state dict holds the stock wq / wk / wv
        parent = prefix.rsplit(".", 1)[0] + "." if "." in prefix else ""
        return f"{parent}w{part}.weight", part
    return f"{prefix}.weight", part


def merge_into(state_dict: dict, scale: float) -> dict:
    """Base weights with every adapter folded in (``W + s B A``, in the base weights' dtype; batched over
    experts for their 3-D weights), adapters dropped. Differentiable (tests take it as a reference)."""
    out = {k: v.clone() for k, v in state_dict.items() if not is_adapter_param(k)}
    for k, a in state_dict.items():
        leaf = k.rsplit(".", 1)[1]
        if not leaf.startswith("lora_A"):
            continue
        b = state_dict[k.rsplit(".", 1)[0] + "." + leaf.replace("lora_A", "lora_B")]
        key, _ = base_key(k)
        w = out[key]
        out[key] = w + torch.matmul(b.to(w.dtype), a.to(w.dtype)) * scale
    return out
