"""HuggingFace folders out of a run: a state dict converted to HF names and written (``save``, the
family's ``hf_writer`` for weight publication), and `apiary export`, which streams a checkpoint into an
HF folder a layer at a time (``export_streamed``, ``export_run``).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import save_file

from components.models.hf import _meta_model, _names
from components.models.hf_folder import layer_of
from framework.errors import UserError


def to_hf_tensors(state_dict: dict, config, adapter_cls) -> dict:
    """A torchtitan state dict (full tensors; buffers such as the routing bias are ignored by the
    adapters) -> HF name -> contiguous CPU tensor, through the family's state-dict adapter."""
    return {k: v.detach().to("cpu").contiguous() for k, v in adapter_cls(config, None).to_hf(state_dict).items()}


def write_folder(tensors: dict, hf_config: dict, out_path) -> Path:
    """HF tensors + config dict -> folder (config.json + model.safetensors); shared by `apiary export`
    and weight publication (framework/train/publish.py writes its own files around the same tensors)."""
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
    """A family's ``hf_writer(options, ctx)`` (framework/contracts/protocols.py ``ModelFamily``): called with a
    full torchtitan state dict of the trained model, returns ``(hf_tensors, hf_config)`` that
    transformers, vLLM and SGLang load (framework/train/publish.py writes them as a folder)."""

    config: object  # the torchtitan model config the run builds
    adapter_cls: type  # the family's state-dict adapter (torchtitan <-> HF names)
    hf_config: dict  # config.json
    warned: bool = False  # the routing-bias warning was given (once a run)

    def __call__(self, state_dict: dict) -> tuple[dict, dict]:
        # the routing bias starts at zero (nothing is left out of the starting weights): the warning
        # comes at the first version whose bias has moved, and only there
        if not self.warned and any(k.endswith("expert_bias_E") and bool(v.any()) for k, v in state_dict.items()):
            self.warned = True
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


def checkpoint_step(run_dir, step: int | None = None) -> Path:
    """checkpoint/step-N of a run: its latest complete one (DCP's .metadata written), or ``step``,
    refused when that step is not complete (naming those that are)."""
    run = Path(run_dir)
    steps = {int(p.name.split("-")[1]): p for p in (run / "checkpoint").glob("step-*")
             if (p / ".metadata").is_file() and p.name.split("-")[1].isdigit()}
    if not steps:
        raise UserError(f"apiary export {run_dir}", "holds no complete checkpoint (checkpoint/step-N/.metadata).",
                        "Train with checkpoint.enable=true first.")
    if step is None:
        return steps[max(steps)]
    if step not in steps:
        raise UserError(f"apiary export {run_dir} --step {step}", "no complete checkpoint of that step; complete: "
                        f"{', '.join(map(str, sorted(steps)))}.", "Pick one of those steps.")
    return steps[step]


def latest_step(run_dir) -> Path:
    return checkpoint_step(run_dir)


# the folder's weight dtypes (`apiary export --dtype`) and their safetensors names
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def export_dtype(dtype: str) -> torch.dtype:
    """``bfloat16`` | ``float16`` | ``float32`` -> the torch dtype (ValueError otherwise)."""
    t = getattr(torch, str(dtype), None)
    if t not in _SAFETENSORS_DTYPE:
        raise ValueError(f"export dtype {dtype!r}: one of bfloat16, float16, float32")
    return t


def export_groups(keys) -> list[list[str]]:
    """State-dict keys in groups that convert to HF alone, in the keys' order: a layer's keys together
    (an adapter fuses or splits tensors within a layer: Qwen3.5's in_proj_qkv, stacked experts), every
    other key by itself."""
    groups, at = [], {}
    for k in keys:
        n = layer_of(k)
        if n < 0:
            groups.append([k])
        elif n in at:
            groups[at[n]].append(k)
        else:
            at[n] = len(groups)
            groups.append([k])
    return groups


def shard_plan(sizes: list[tuple[str, int]], shard_bytes: int | None) -> list[list[str]]:
    """Names in order, split into shards of at most ``shard_bytes`` (a tensor larger than that alone);
    publication's rule (framework/train/publish.py ``write_version``); None: one shard."""
    shards, cur, size = [], [], 0
    for name, n in sizes:
        if cur and shard_bytes is not None and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    shards.append(cur)
    return shards


class _StreamedSafetensors:
    """One .safetensors file written tensor by tensor: the header (names, shapes, offsets) is known
    in advance, so no tensor is held after it is written (safetensors' save_file takes them all)."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple]], dtype: torch.dtype):
        self.path, self.dtype, self.todo = path, dtype, list(reversed(entries))
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # safetensors aligns the data to 8 bytes
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(head)) + head)

    def write(self, name: str, t: torch.Tensor) -> None:
        want, shape = self.todo.pop()
        if name != want or tuple(t.shape) != shape or t.dtype != self.dtype:
            raise RuntimeError(f"{self.path.name}: got {name} {tuple(t.shape)} {t.dtype}, the header says {want} "
                               f"{shape} {self.dtype}")
        self.f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        if not self.todo:
            self.f.close()


@torch.no_grad()
def export_streamed(step_dir, out_path, *, config, adapter_cls, hf_config: dict, keys: dict[str, tuple],
                    dtype: str = "bfloat16", shard_bytes: int | None = None) -> Path:
    """A DCP checkpoint -> HF folder, a group of tensors at a time (``export_groups``: one layer, or
    one tensor outside the layers): each group is loaded from ``step_dir`` straight into ``dtype``
    (DCP reads only those keys), converted by the family's state-dict adapter and appended to its
    shard, so the host holds one group, never the model. ``keys``: the torchtitan state-dict names to
    export -> shape. Shards of at most ``shard_bytes`` as publication writes them
    (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``; one shard:
    ``model.safetensors``); config.json names the dtype."""
    want = export_dtype(dtype)
    adapter = adapter_cls(config, None)
    groups = export_groups(keys)
    plan = []  # per group: [(HF name, shape)], from the adapter on meta tensors (names and shapes only)
    for g in groups:
        meta = adapter.to_hf({k: torch.empty(keys[k], dtype=want, device="meta") for k in g})
        plan.append([(n, tuple(t.shape)) for n, t in meta.items()])
    entries = [e for p in plan for e in p]
    shards = shard_plan([(n, math.prod(s) * want.itemsize) for n, s in entries], shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    file_of = {n: f for f, names in zip(files, shards) for n in names}
    shapes = dict(entries)
    out = Path(out_path)
    out.mkdir(parents=True, exist_ok=True)
    writer = None
    try:
        for g, p in zip(groups, plan):
            sd = {k: torch.empty(keys[k], dtype=want) for k in g}
            dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
            converted = adapter.to_hf(sd)
            for name, _ in p:
                if writer is None or writer.path.name != file_of[name]:
                    names = shards[files.index(file_of[name])]
                    writer = _StreamedSafetensors(out / file_of[name], [(n, shapes[n]) for n in names], want)
                writer.write(name, converted[name])
            del sd, converted
    finally:
        if writer is not None and not writer.f.closed:  # stopped part-way: the file is closed, not whole
            writer.f.close()
    if len(shards) > 1:
        total = sum(math.prod(s) * want.itemsize for _, s in entries)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": file_of}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": dtype, "dtype": dtype}, indent=2))
    return out


def export_run(run_dir, out_path, family_mod, *, step: int | None = None, dtype: str = "bfloat16",
               shard_bytes: int | None = None) -> Path:
    """`apiary export RUN_DIR --hf OUT` for a torchtitan-adapter family: a checkpoint (the latest, or
    ``step``) -> HF folder in ``dtype``, streamed (``export_streamed``)."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UserError(f"apiary export {run_dir}", "is not a run folder (no config.yaml).",
                        "Point it at runs/RECIPE/TIMESTAMP.")
    cfg = OmegaConf.load(run / "config.yaml")
    step_dir = checkpoint_step(run, step)
    config = family_mod.model_config(cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=cfg.model.vocab_size,
                                     hf_checkpoint=cfg.model.get("hf_checkpoint"))
    arch = family_mod.arch_from_config(config)
    model = _meta_model(config)
    # DCP holds the model's state_dict names (a fused QKV split by torchtitan's hooks), fp32
    params = set(_names(model))
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items()
            if k in params or k.endswith((".wq.weight", ".wk.weight", ".wv.weight"))}
    warn_routing_bias(model, step_dir)
    return export_streamed(step_dir, out_path, config=config, adapter_cls=family_mod.STATE_DICT_ADAPTER,
                           hf_config=family_mod.hf_config(arch), keys=keys, dtype=dtype, shard_bytes=shard_bytes)


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
