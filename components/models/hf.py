"""HuggingFace folders for every model family: config.json, safetensors checks, load, export.

A family that loads HF checkpoints supplies (see qwen3.py, llama3.py, qwen3_5.py):

* ``arch_from_hf(config: dict) -> Arch``: the architecture of a (text) config.json, in the
  family's torch-free module (reading it with components/models/hf_folder.py, whose config.json
  and safetensors-header readers this module re-exports);
* ``build_config(arch, ...)``: a torchtitan model config whose ``hf_checkpoint`` field makes
  ``init_states`` load the folder after the random init;
* ``STATE_DICT_ADAPTER``: torchtitan's adapter (HF keys <-> torchtitan names);
* ``hf_config(arch) -> dict``: config.json written by ``apiary export``;
* optionally ``hf_key_shapes(key, shape)``: a checkpoint key -> canonical (key, shape) pairs
  (vision weights dropped, fused experts split), identity by default.

Everything here that can fail on the user's input raises ``UserError`` naming
``model.hf_checkpoint``: a missing folder, a config.json that is not JSON, no weights, a
corrupt or truncated ``.safetensors`` file, missing or extra tensors, a wrong shape. The checks
read the safetensors headers only (no tensor data), so they run before any worker starts.
Export (a checkpoint or the live weights -> an HF folder): hf_export.py.

"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.attention import FlexAttention, VarlenAttention

from components.adapters.targets import is_adapter_param
from components.models.hf_folder import (  # noqa: F401  (the folder readers, reachable as hf.NAME)
    FLOAT_DTYPES,
    KEY,
    _where,
    apply_overrides,
    check_dims,
    check_family,
    checkpoint_depth,
    describe,
    layer_of,
    need,
    read_config,
    refuse,
    rope_params,
    weight_index,
)
from framework import contracts
from framework.errors import UserError

# --------------------------------------------------------------------------- checks

def _meta_model(config):
    with torch.device("meta"):
        return copy.deepcopy(config).build()


def _names(model) -> list[str]:
    return [_clean(n) for n, _ in model.named_parameters()]


def _clean(name: str) -> str:
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


def expected_hf(config, adapter_cls) -> dict[str, tuple]:
    """HF key -> shape the model needs, from the adapter's to_hf on a meta build."""
    model = _meta_model(config)
    sd = {n: p for n, p in zip(_names(model), model.parameters())}
    hf = adapter_cls(config, None).to_hf(sd)
    return {k: tuple(v.shape) for k, v in hf.items()}


def canonical_index(index: dict, family_mod) -> dict[str, tuple]:
    fn = contracts.member(family_mod, "model", "hf_key_shapes")
    out = {}
    for k, (_, shape, _) in index.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        for ck, cs in (fn(k, shape) if fn else [(k, shape)]):
            out[ck] = cs
    return out


def check_weights(path, config, family_mod, n_layers: int) -> dict:
    """Missing, extra or wrongly shaped tensors (headers only): a user error naming them."""
    index = weight_index(path)
    have = canonical_index(index, family_mod)
    want = expected_hf(config, family_mod.STATE_DICT_ADAPTER)
    tied = bool(getattr(config, "enable_weight_tying", False))
    have = {k: s for k, s in have.items() if layer_of(k) < n_layers}  # truncation keeps the first layers
    if tied:
        want.pop("lm_head.weight", None)
        have.pop("lm_head.weight", None)
    missing = sorted(set(want) - set(have), key=_natural)
    extra = sorted(set(have) - set(want), key=_natural)
    shapes = [f"{k} {list(have[k])} (the architecture needs {list(want[k])})" for k in sorted(want, key=_natural)
              if k in have and tuple(have[k]) != tuple(want[k])]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing: {_few(missing)}")
    if extra:
        problems.append(f"{len(extra)} tensors the architecture has no place for: {_few(extra)}")
    if shapes:
        problems.append(f"{len(shapes)} with the wrong shape: {_few(shapes)}")
    if problems:
        raise UserError(_where(path), "the weights do not match its config.json: " + "; ".join(problems) + ".",
                        "Use the config.json saved with these weights, or re-save the model with "
                        "save_pretrained.")
    fn = contracts.member(family_mod, "model", "hf_key_shapes")
    ints = [f"{k} ({dtype} in {f.name})" for k, (f, shape, dtype) in sorted(index.items(), key=lambda kv: _natural(kv[0]))
            if dtype not in FLOAT_DTYPES and any(ck in want for ck, _ in (fn(k, shape) if fn else [(k, shape)]))]
    if ints:
        raise UserError(_where(path), f"{len(ints)} weight tensor(s) are not floating point: {_few(ints)}; loaded "
                        "into the model's float parameters their integer values would be the weights (an integer "
                        "tensor of zeros is a model that predicts uniformly).",
                        "Use the model's floating-point (bf16, fp16 or fp32) weights; apiary does not load "
                        "quantized or integer checkpoints.")
    return index


def _few(items, n=4) -> str:
    return ", ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def _natural(k: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)]


# --------------------------------------------------------------------------- load

@torch.no_grad()
def load_into(model: torch.nn.Module, path, adapter, *, canonical=None) -> None:
    """Copy a HF folder's weights into ``model`` (plain, FSDP- or EP-sharded), one layer at a time.

    Layers at or beyond the model's depth are skipped (``model.n_layers`` below the checkpoint's).
    ``canonical(key)`` renames a checkpoint key or drops it (None).
    """
    index = {k: v[0] for k, v in weight_index(path).items()}
    params = {_clean(n): p for n, p in model.named_parameters() if not is_adapter_param(n)}  # adapters: not in HF
    n_layers = len(model.layers)
    groups = defaultdict(list)
    for key in index:
        if key.endswith("rotary_emb.inv_freq"):
            continue
        ck = canonical(key) if canonical else key
        if ck is None:
            continue
        g = layer_of(ck)
        if g < n_layers:
            groups[g].append(key)
    tied = bool(getattr(model.config, "enable_weight_tying", False))
    seen, handles = set(), {}
    try:
        for g in sorted(groups):
            raw = {}
            for key in groups[g]:
                f = index[key]
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt")
                raw[key] = handles[f].get_tensor(key)
                check_finite(raw[key], key, f, path)
            if tied:  # torchtitan's adapters insist on an output head when embeddings are tied
                raw["lm_head.weight"] = raw.get("model.embed_tokens.weight")
            for name, value in adapter.from_hf(raw).items():
                if tied and name == "lm_head.weight":
                    continue
                if name not in params:
                    raise UserError(_where(path), f"checkpoint weight {name} has no parameter in the model.",
                                    "Use the config.json saved with these weights.")
                p = params[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise UserError(_where(path), f"{name} has shape {tuple(value.shape)}, the model "
                                    f"{tuple(p.shape)}.", "Use the config.json saved with these weights.")
                value = value.to(dtype=p.dtype)
                if isinstance(p, DTensor):
                    local = distribute_tensor(value.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                              src_data_rank=None).to_local()
                    p.to_local().copy_(local)
                else:
                    p.copy_(value)
                seen.add(name)
    finally:
        handles.clear()
    missing = sorted(set(params) - seen)
    if missing:
        raise UserError(_where(path), f"no weights for {len(missing)} parameters, e.g. {missing[:4]}.",
                        "Use the config.json saved with these weights.")


def check_finite(t: torch.Tensor, key: str, file, path) -> None:
    """A checkpoint tensor must be floating point and hold no NaN or Inf: a user error naming the
    tensor and its file (a NaN weight would make step 1's loss NaN, which reads like divergence).
    Checked as each tensor is loaded, in 16M-element pieces (a small temporary)."""
    if not t.is_floating_point():
        raise UserError(_where(path), f"tensor {key} in {Path(file).name} is {t.dtype}, not floating point.",
                        "Use the model's floating-point (bf16, fp16 or fp32) weights.")
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), 1 << 24):
        piece = flat[start:start + (1 << 24)]
        if piece.element_size() == 1:  # float8: isfinite is not implemented for it everywhere
            piece = piece.float()
        if not bool(torch.isfinite(piece).all()):
            bad = int((~torch.isfinite(flat)).sum())
            raise UserError(_where(path), f"tensor {key} in {Path(file).name} holds {bad:,} NaN or Inf value(s) "
                            f"(of {flat.numel():,}); training from it would give a NaN loss at step 1, which is "
                            "the checkpoint's fault, not the learning rate's.",
                            "Download or export the weights again (compare checksums with the source); if the "
                            "source itself holds them, use another checkpoint of the model.")


def causal_masks(model, tokens, positions=None):
    """The causal attention masks a torchtitan decoder whose attention needs them (flex, varlen, the
    CPU dense-mask path) gets from the trainer, for a call outside it; None when it needs none."""
    first = getattr(model.config, "first_attention", None)
    if first is None or not isinstance(first.inner_attention, (FlexAttention.Config, VarlenAttention.Config)):
        return None
    B, L = tokens.shape[0], tokens.shape[1]
    pos = positions if positions is not None else torch.arange(L, device=tokens.device).expand(B, L)
    return model.get_attention_masks(pos)


class CausalMasksByDefault:
    """Mixin for torchtitan decoders: called outside the trainer (no masks), attend causally."""

    def forward(self, tokens, positions=None, attention_masks=None, **kwargs):
        if attention_masks is None:
            attention_masks = causal_masks(self, tokens, positions)
        return super().forward(tokens, positions, attention_masks, **kwargs)


def model_class(base: type, adapter_cls: type, name: str, module: str) -> type:
    """torchtitan's decoder ``base`` for a family that reads HF folders: its Config gains
    ``hf_checkpoint`` (a HF folder, loaded through ``adapter_cls`` after the random init, by
    ``init_states``) and a call without masks attends causally (``CausalMasksByDefault``).
    ``name`` / ``module``: where the class is bound (so its configs pickle by reference)."""

    class HFModel(CausalMasksByDefault, base):
        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            hf_checkpoint: str | None = None

        def init_states(self, *, buffer_device=None) -> None:
            super().init_states(buffer_device=buffer_device)
            if self.config.hf_checkpoint:
                load_into(self, self.config.hf_checkpoint, adapter_cls(self.config, None))

    HFModel.__name__ = HFModel.__qualname__ = name
    HFModel.Config.__qualname__ = f"{name}.Config"
    HFModel.__module__ = HFModel.Config.__module__ = module
    HFModel.__doc__ = f"torchtitan's {base.__name__} that loads ``config.hf_checkpoint`` after its random init."
    return HFModel
