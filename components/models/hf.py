"""HuggingFace folders for every model family: config.json, safetensors checks, load, export.

A family that loads HF checkpoints supplies (see qwen3.py, llama3.py, qwen3_5.py):

* ``arch_from_hf(config: dict) -> Arch``: the architecture of a (text) config.json;
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
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import logging
import math
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.attention import FlexAttention, VarlenAttention

from components.adapters.targets import is_adapter_param
from components.models.common import facts_from_config
from framework import contracts
from framework.errors import UserError

KEY = "model.hf_checkpoint"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # safetensors dtypes a weight may have
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _where(path) -> str:
    return f"{KEY}={path}"


# --------------------------------------------------------------------------- config.json

def read_config(path, *, text: bool = True) -> dict:
    """The folder's config.json as a dict; with ``text``, a multimodal config's ``text_config``."""
    if isinstance(path, dict):
        c = path
    else:
        p = Path(path)
        if not p.exists():
            raise UserError(_where(path), "no such folder.", "Point it at a HuggingFace model folder "
                            "(config.json + *.safetensors), e.g. one written by save_pretrained.")
        if p.is_file():
            raise UserError(_where(path), "is a file; apiary loads a HuggingFace model folder "
                            "(config.json + *.safetensors).", f"Point it at the folder, e.g. {p.parent}.")
        cfg = p / "config.json"
        if cfg.exists() and not cfg.is_file():
            raise UserError(_where(path), f"{cfg} is a folder, not a file, so the architecture is unknown.",
                            "Put the model's config.json there (transformers' save_pretrained writes one).")
        if not cfg.is_file():
            raise UserError(_where(path), "no config.json there, so the architecture is unknown.",
                            "Point it at a HuggingFace model folder (config.json + *.safetensors).")
        try:
            c = json.loads(cfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(_where(path), f"{cfg} is not JSON ({e}).",
                            "Restore the file from the model's original folder.") from None
        except OSError as e:
            raise UserError(_where(path), f"{cfg} cannot be read: {e.strerror or e}.",
                            "Give this user read access to it (chmod a+r), or point at a copy it can read.") from None
        if not isinstance(c, dict):
            raise UserError(_where(path), f"{cfg} is not a JSON object.", "Restore the file from the model's "
                            "original folder.")
    if text and isinstance(c.get("text_config"), dict):
        tc = c["text_config"]
        c = {**tc, "tie_word_embeddings": tc.get("tie_word_embeddings", c.get("tie_word_embeddings", False))}
    check_dims(c, path)
    return c


# config.json sizes that must be integers >= 1 when present (null: the family's default); the
# expert counts may be 0 (a dense model) except in an MoE model_type
_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
             "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval")
_NON_NEGATIVE = ("num_experts", "num_local_experts", "shared_expert_intermediate_size")
# config.json reals that must be finite and > 0 (an epsilon of -1 or a RoPE base of 0 made step 1's
# loss NaN: exit 76, blamed on the learning rate)
_POSITIVE_REAL = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "rope_theta")


def check_dims(c: dict, path) -> None:
    """Every size config.json gives is an integer >= 1 (expert counts >= 0, >= 1 in an MoE model_type),
    the attention heads split into the KV heads and top-k is at most the experts: a user error naming
    the file and every bad field (before, a negative size failed deep inside torch)."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    bad = []
    for k in _POSITIVE:
        v = c.get(k)
        if v is not None and not (is_int(v) and v >= 1):
            bad.append(f"{k}={json.dumps(v)} (must be an integer >= 1)")
    moe = "moe" in str(c.get("model_type", ""))
    for k in _NON_NEGATIVE:
        v = c.get(k)
        least = 1 if moe and k in ("num_experts", "num_local_experts") else 0
        if v is not None and not (is_int(v) and v >= least):
            rule = f">= 1 in an MoE model, model_type={c['model_type']}" if least else ">= 0"
            bad.append(f"{k}={json.dumps(v)} (must be an integer {rule})")
    for k in _POSITIVE_REAL:
        v = rope_params(c).get(k) if k == "rope_theta" else c.get(k)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            bad.append(f"{k}={json.dumps(v)} (must be a finite number > 0)")
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    if is_int(heads) and is_int(kv) and heads >= 1 and kv >= 1 and heads % kv:
        bad.append(f"num_attention_heads={heads} with num_key_value_heads={kv} (the query heads must split evenly "
                   "into the key/value heads)")
    experts = c.get("num_experts") or c.get("num_local_experts")
    top_k = c.get("num_experts_per_tok")
    if is_int(experts) and is_int(top_k) and experts >= 1 and top_k > experts:
        bad.append(f"num_experts_per_tok={top_k} with {experts} experts (a token cannot pick more experts than exist)")
    if bad:
        where = "config.json" if isinstance(path, dict) else str(Path(path) / "config.json")
        raise UserError(_where("(config)" if isinstance(path, dict) else path), f"{where} has "
                        f"{'; '.join(bad)}, so apiary cannot build a model from it.",
                        "Use the config.json saved with the weights (transformers' save_pretrained), or correct "
                        "the field.")


def need(c: dict, path, *keys):
    """Values of required config.json keys (a missing one is a user error naming it)."""
    missing = [k for k in keys if k not in c]
    if missing:
        raise UserError(_where(path), f"config.json has no {', '.join(missing)}.",
                        "Use the config.json saved with the weights (transformers' save_pretrained).")
    return [c[k] for k in keys]


def rope_params(c: dict) -> dict:
    """transformers 5 ``rope_parameters`` merged with the older top-level keys / ``rope_scaling``."""
    rope = dict(c.get("rope_parameters") or {})
    for k, v in (c.get("rope_scaling") or {}).items():
        rope.setdefault(k, v)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    for k in ("rope_theta", "partial_rotary_factor", "mrope_section"):
        if k in c and k not in rope:
            rope[k] = c[k]
    return rope


def refuse(path, what: str, fix: str = "") -> None:
    raise UserError(_where(path), f"{what}; apiary cannot build this architecture.",
                    fix or "Use a checkpoint without it, or another model.family.")


def family_of(model_type: str) -> str | None:
    if model_type.startswith("qwen3_5"):
        return "qwen3_5"
    if model_type in ("qwen3", "qwen3_moe"):
        return "qwen3"
    if model_type == "llama":
        return "llama3"
    return None


def check_family(c: dict, path, family: str) -> None:
    mt = str(c.get("model_type", ""))
    if not mt:
        return
    other = family_of(mt)
    if other == family:
        return
    # the packaged family module of that model_type (family_of names components/models/<family>.py)
    flavors = list(getattr(importlib.import_module(f"components.models.{other}"), "FLAVORS", {})) if other else []
    fix = (f"Set model.family={other} model.flavor={flavors[0]} (with hf_checkpoint the flavor only supplies "
           "defaults; the architecture comes from config.json)." if other else
           "apiary loads qwen3, qwen3_moe, llama and qwen3_5(_moe) checkpoints.")
    raise UserError(_where(path), f"config.json has model_type={mt}, which model.family={family} does not "
                    "read.", fix)


def apply_overrides(arch, path, *, n_layers=None, vocab_size=None):
    """The checkpoint's architecture with the user's explicit model.n_layers / model.vocab_size.

    Both are None unless the user set them (no packaged recipe sets them). A vocabulary that
    differs, or more layers than the checkpoint holds, contradicts the weights; fewer layers
    keep the first ones.
    """
    if vocab_size is not None and vocab_size != arch.vocab_size:
        raise UserError(f"model.vocab_size={vocab_size}", f"contradicts {KEY}={path}, whose vocabulary is "
                        f"{arch.vocab_size} (config.json vocab_size).",
                        f"Drop model.vocab_size (the checkpoint sets it) or set model.vocab_size={arch.vocab_size}.")
    if n_layers is not None and n_layers > arch.n_layers:
        raise UserError(f"model.n_layers={n_layers}", f"is more than the {arch.n_layers} layers of {KEY}={path}; "
                        "the extra layers would have no weights.",
                        f"Drop model.n_layers, or set it to at most {arch.n_layers} to load the first layers.")
    if n_layers is not None and n_layers < arch.n_layers:
        return dataclasses.replace(arch, n_layers=n_layers)
    return arch


# --------------------------------------------------------------------------- safetensors headers

def _header(f: Path, path) -> dict:
    """A .safetensors file's header, validated against the file's size (no tensor data read)."""
    size = f.stat().st_size
    bad = None
    try:
        with open(f, "rb") as h:
            head = h.read(8)
            if len(head) < 8:
                bad = f"{f.name} is {size} bytes, too short for a safetensors file"
            else:
                n = struct.unpack("<Q", head)[0]
                if n > size - 8 or n > 100 * 2**20:
                    bad = f"{f.name} is not a safetensors file (header length {n} in a {size}-byte file)"
                else:
                    meta = json.loads(h.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        bad = f"{f.name} has a corrupt header (not JSON)"
    if bad is None and not isinstance(meta, dict):
        bad = f"{f.name} has a corrupt header"
    if bad is None:
        end = 0
        for k, v in meta.items():
            if k == "__metadata__":
                continue
            try:
                b, e = v["data_offsets"]
                shape, dtype = [int(s) for s in v["shape"]], v["dtype"]
            except (KeyError, TypeError, ValueError):
                bad = f"{f.name} has a corrupt header entry for {k}"
                break
            nbytes = _DTYPE_BYTES.get(dtype, 0) * int(torch.Size(shape).numel())
            if dtype in _DTYPE_BYTES and e - b != nbytes:
                bad = f"{f.name}: tensor {k} has {e - b} bytes for shape {shape} {dtype}"
                break
            end = max(end, e)
        if bad is None and 8 + n + end > size:
            bad = (f"{f.name} is truncated: its header describes {8 + n + end} bytes, the file holds {size} "
                   "(an interrupted download or copy)")
    if bad:
        raise UserError(_where(path), bad + ".", "Download or copy the file again (compare its size with "
                        "the source), or point model.hf_checkpoint at an intact folder.")
    return {k: v for k, v in meta.items() if k != "__metadata__"}


def weight_index(path) -> dict[str, tuple[Path, tuple, str]]:
    """HF key -> (file, shape, dtype) from the folder's safetensors headers."""
    p = Path(path)
    idx = p / "model.safetensors.index.json"
    if idx.is_file():
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise UserError(_where(path), f"{idx.name} is not a safetensors index ({e}).",
                            "Restore it from the model's original folder.") from None
        files = sorted({p / f for f in weight_map.values()})
        gone = [f.name for f in files if not f.is_file()]
        if gone:
            raise UserError(_where(path), f"{idx.name} names files that are not there: {', '.join(gone[:4])}.",
                            "Download the missing shards.")
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        other = sorted(x.name for x in p.glob("*.bin")) + sorted(x.name for x in p.glob("*.pt"))
        raise UserError(_where(path), "no *.safetensors weights there" +
                        (f" (found {', '.join(other[:3])}; apiary reads safetensors only)" if other else "") + ".",
                        "Save the model with save_pretrained (safetensors is its default), or download the "
                        "*.safetensors files into the folder.")
    out = {}
    for f in files:
        for k, v in _header(f, path).items():
            out[k] = (f, tuple(int(s) for s in v["shape"]), v["dtype"])
    return out


def layer_of(key: str) -> int:
    m = _LAYER.search(key)
    return int(m[1]) if m else -1


def checkpoint_depth(index: dict) -> int:
    return 1 + max((layer_of(k) for k in index), default=-1)


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


# --------------------------------------------------------------------------- export

def to_hf_tensors(state_dict: dict, config, adapter_cls) -> dict:
    """A torchtitan state dict (full tensors; buffers such as the routing bias are ignored by the
    adapters) -> HF name -> contiguous CPU tensor, through the family's state-dict adapter."""
    return {k: v.detach().to("cpu").contiguous() for k, v in adapter_cls(config, None).to_hf(state_dict).items()}


def write_folder(tensors: dict, hf_config: dict, out_path) -> Path:
    """HF tensors + config dict -> folder (config.json + model.safetensors); shared by `apiary export`
    and weight publication (framework/publish.py writes its own files around the same tensors)."""
    out = Path(out_path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out


def save(state_dict: dict, config, adapter_cls, hf_config: dict, out_path) -> Path:
    """A torchtitan state dict -> HF folder (config.json + model.safetensors)."""
    return write_folder(to_hf_tensors(state_dict, config, adapter_cls), hf_config, out_path)


@dataclass
class HFWriter:
    """A family's ``hf_writer(options, ctx)`` (framework/contracts.py ``ModelFamily``): called with a
    full torchtitan state dict of the trained model, returns ``(hf_tensors, hf_config)`` that
    transformers, vLLM and SGLang load (framework/publish.py writes them as a folder)."""

    config: object  # the torchtitan model config the run builds
    adapter_cls: type  # the family's state-dict adapter (torchtitan <-> HF names)
    hf_config: dict  # config.json
    warned: bool = False

    def __call__(self, state_dict: dict) -> tuple[dict, dict]:
        if not self.warned:
            self.warned = True
            if any(k.endswith("expert_bias_E") and bool(v.any()) for k, v in state_dict.items()):
                logging.getLogger("apiary").warning(
                    "publish: the MoE routing bias that moe.load_balance_coeff trains is not part of the HF "
                    "format and is left out, so a generator loading the published weights may route some "
                    "tokens differently; train with moe.load_balance_coeff=null for routing that matches.")
        return to_hf_tensors(state_dict, self.config, self.adapter_cls), self.hf_config

    def to_hf(self, state_dict: dict) -> dict:
        """HF name -> tensor for (part of) a torchtitan state dict, where the tensors are (no copy to
        the host; meta tensors give the names and shapes): what an in-memory transport sends."""
        return self.adapter_cls(self.config, None).to_hf(state_dict)


def hf_writer(family_mod, options, ctx) -> HFWriter:
    """``hf_writer(options, ctx)`` of a family with ``model_config``, ``arch_from_config``,
    ``hf_config`` and ``STATE_DICT_ADAPTER`` (qwen3, llama3)."""
    config = family_mod.model_config(options.flavor, **family_mod.model_kwargs(options, ctx))
    return HFWriter(config, family_mod.STATE_DICT_ADAPTER, family_mod.hf_config(family_mod.arch_from_config(config)))


def latest_step(run_dir) -> Path:
    run = Path(run_dir)
    steps = sorted((int(p.name.split("-")[1]), p) for p in (run / "checkpoint").glob("step-*")
                   if (p / ".metadata").is_file() and p.name.split("-")[1].isdigit())
    if not steps:
        raise UserError(f"apiary export {run_dir}", "holds no complete checkpoint (checkpoint/step-N/.metadata).",
                        "Train with checkpoint.enable=true first.")
    return steps[-1][1]


def export_run(run_dir, out_path, family_mod) -> Path:
    """`apiary export RUN_DIR --hf OUT` for a torchtitan-adapter family: latest checkpoint -> HF folder."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UserError(f"apiary export {run_dir}", "is not a run folder (no config.yaml).",
                        "Point it at runs/RECIPE/TIMESTAMP.")
    cfg = OmegaConf.load(run / "config.yaml")
    step_dir = latest_step(run)
    config = family_mod.model_config(cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size,
                                     hf_checkpoint=cfg.model.get("hf_checkpoint"))
    arch = family_mod.arch_from_config(config)
    model = _meta_model(config)
    # DCP holds the model's state_dict names (a fused QKV split by torchtitan's hooks), fp32
    params = set(_names(model))
    sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()
          if k in params or k.endswith((".wq.weight", ".wk.weight", ".wv.weight"))}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    warn_routing_bias(model, step_dir)
    return save(sd, config, family_mod.STATE_DICT_ADAPTER, family_mod.hf_config(arch), out_path)


def warn_routing_bias(model, step_dir) -> bool:
    """HF MoE configs have no routing bias: say so when load balancing trained one (it is not exported)."""
    keys = {k: v.shape for k, v in model.state_dict().items() if k.endswith("expert_bias_E")}
    if keys:  # a run with moe.load_balance_coeff=null saved no bias (dcp.load raises a BaseException for it)
        saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        keys = {k: s for k, s in keys.items() if k in saved}
    if not keys:
        return False
    bias = {k: torch.empty(s, dtype=torch.float32) for k, s in keys.items()}
    try:
        dcp.load(bias, checkpoint_id=str(step_dir), no_dist=True)
    except Exception:  # noqa: BLE001 - a checkpoint without the buffers: nothing to warn about
        return False
    if not any(bool(b.any()) for b in bias.values()):
        return False
    logging.getLogger("apiary").warning(
        "apiary export: the run's MoE routing bias (moe.load_balance_coeff, auxiliary-loss-free balancing) is "
        "not part of the HF format and is left out, so the exported model may route some tokens differently; "
        "train with moe.load_balance_coeff=null for routing that exports exactly.")
    return True


def describe(arch, path, depth: int | None = None) -> str:
    """One line for the run's first lines: which checkpoint, which architecture."""
    fields = ", ".join(f"{f.name}={getattr(arch, f.name)}" for f in dataclasses.fields(arch))
    trunc = (f"; loading the first {arch.n_layers} of its {depth} layers (model.n_layers)"
             if depth and depth > arch.n_layers else "")
    return f"HF checkpoint {path}: {fields}{trunc}"


def facts_of_hf(family_mod, family: str, flavor: str, **kwargs):
    """The facts of an HF folder's model (``kwargs["hf_checkpoint"]``), counted on its config, with
    the folder described as their source; building the config checks its weights."""
    config = family_mod.model_config(flavor, **kwargs)
    f = facts_from_config(family, flavor, config)
    path = kwargs["hf_checkpoint"]
    return dataclasses.replace(f, source=describe(family_mod.arch_from_config(config), path,
                                                  checkpoint_depth(weight_index(path))))
