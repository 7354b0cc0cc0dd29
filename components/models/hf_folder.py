"""An HF model folder read without torch: config.json (its values checked) and the safetensors
headers (names, shapes, dtypes, each file's size checked against them; no tensor data read).

The print-only commands (`apiary show DIR`, `apiary plan ... model.hf_checkpoint=DIR`, `train --cfg
job`) size a folder's model from these alone; components/models/hf.py (torch) builds on them to
check the tensors against the architecture, load, and export. Every failure on the user's input is
a ``UserError`` naming ``model.hf_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from pathlib import Path

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


def check_family(c: dict, path, family: str, model_types) -> None:
    """Refuse a config.json whose ``model_type`` is not one of ``model_types`` (the reading family's
    declared ``HF_MODEL_TYPES``), raising the contract's ``ModelTypeNotRead``: the framework names in
    its fix the registry's family that does read it (framework/compose/registry.py ``family_of``)."""
    mt = str(c.get("model_type", ""))
    if mt and mt not in model_types:
        raise contracts.ModelTypeNotRead(_where(path), mt, family)


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
            nbytes = _DTYPE_BYTES.get(dtype, 0) * math.prod(shape)
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


def describe(arch, path, depth: int | None = None) -> str:
    """One line for the run's first lines: which checkpoint, which architecture."""
    fields = ", ".join(f"{f.name}={getattr(arch, f.name)}" for f in dataclasses.fields(arch))
    trunc = (f"; loading the first {arch.n_layers} of its {depth} layers (model.n_layers)"
             if depth and depth > arch.n_layers else "")
    return f"HF checkpoint {path}: {fields}{trunc}"
