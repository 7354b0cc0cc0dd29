"""Adapter checkpoints: the adapters and their optimizer state only, plus the base pointer.

``AdapterCheckpointManager`` is torchtitan's DCP checkpoint manager whose model state is the
adapters (``targets.is_adapter_param``); the optimizer holds nothing else (the base has no
gradient), so its state is the adapters' too. Each saved step gets ``base.BASE_FILE`` (the base's
pointer and the in-memory checksum of its weights), written before apiary's manifest is computed,
so it is checksummed with the rest. A resume loads the adapters and verifies the checksum of the
base it holds against the one saved (exit 2 on a mismatch).

``load_base(model_parts, path)``: a base from a DCP step folder (``checkpoint.load_path``), loaded
at every launch before the adapters (torchtitan's initial load would look for adapters in it).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer.base import ModelWrapper

from components.adapters.base import BASE_FILE, describe
from components.adapters.targets import is_adapter_param

CHECKSUM_RTOL = 1e-9  # float64 sums of the same tensors on the same layout agree to rounding only
_CHECKSUM_ATTR = "_apiary_base_checksum"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class AdapterModelWrapper(ModelWrapper):
    """The model's state as a checkpoint sees it: the adapters only."""

    def _get_state_dict(self) -> dict:
        return {k: v for k, v in super()._get_state_dict().items() if is_adapter_param(k)}


@torch.no_grad()
def weights_checksum(model_parts) -> list[float]:
    """Three float64 numbers over every base tensor of this rank (sum of squares, row- and column-
    weighted sums), summed over ranks: equal for the same weights on the same layout."""
    device = next(iter(model_parts[0].parameters())).device
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for part in model_parts:
        for name, p in sorted(part.named_parameters(), key=lambda kv: kv[0]):
            if is_adapter_param(name):
                continue
            t = p.to_local() if isinstance(p, DTensor) else p
            if t.numel() == 0:
                continue
            t = t.detach().reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().reshape(-1, 1)
            cols = torch.cos(torch.arange(t.shape[1], device=t.device, dtype=torch.float64) * 1.3 + 0.1)
            step = max(1, (1 << 22) // t.shape[1])
            for r0 in range(0, t.shape[0], step):
                c = t[r0:r0 + step].double()
                rows = torch.cos(torch.arange(r0, r0 + c.shape[0], device=t.device, dtype=torch.float64) * 0.7 + 0.3)
                acc += torch.stack([(c * c).sum(), (c.sum(1) * rows).sum(), (c.sum(0) * cols).sum()]).to(acc.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc)
    return [float(x) for x in acc.cpu()]


@torch.no_grad()
def load_base(model_parts, path: str) -> None:
    """The base weights from the DCP step folder ``path`` into the model (any sharding): every key of
    the model's state dict except the adapters, through the model's own load hooks."""
    wrapper = ModelWrapper(model_parts)
    sd = {k: v for k, v in wrapper._get_state_dict().items() if not is_adapter_param(k)}
    dcp.load(sd, checkpoint_id=str(path))
    wrapper.load_state_dict(sd)


def remember_base(model_parts, base_path: str | None) -> None:
    """After the model's initialisation: load a DCP base, then record the base's checksum on the model."""
    if base_path:
        load_base(model_parts, base_path)
    setattr(model_parts[0], _CHECKSUM_ATTR, weights_checksum(model_parts))


def _same(a, b) -> bool:
    return all(math.isclose(x, y, rel_tol=CHECKSUM_RTOL, abs_tol=1e-12) for x, y in zip(a, b)) and len(a) == len(b)


class AdapterCheckpointManager(CheckpointManager):
    """torchtitan's checkpoint manager saving the adapters and the base pointer (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        base: dict = field(default_factory=dict)
        """the base pointer (components.adapters.base.pointer) written beside every saved step"""

    def __init__(self, config, *, model_parts, **kwargs):
        super().__init__(config, model_parts=model_parts, **kwargs)
        self._base = dict(config.base)
        self._parts = model_parts
        if self.enable:
            self.states["model"] = AdapterModelWrapper(model_parts)

    def _checksum(self) -> list[float]:
        saved = getattr(self._parts[0], _CHECKSUM_ATTR, None)
        return saved if saved is not None else weights_checksum(self._parts)

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        checksum = self._checksum()  # every rank (a collective when not yet recorded)
        out = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if _rank() == 0:
            body = {"format": 1, "base": self._base, "weights_checksum": checksum,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1}
            (Path(checkpoint_id) / BASE_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))
        return out

    def _load(self, step: int = -1) -> bool:
        load_step = -1
        if Path(self.folder).is_dir():
            load_step = self._find_load_step() if step == -1 else step
        loaded = super()._load(step)
        if loaded and load_step > 0:
            self._verify(Path(self._create_checkpoint_id(load_step)))
        return loaded

    def _verify(self, step_dir: Path) -> None:
        f = step_dir / BASE_FILE
        if not f.is_file():
            return
        saved = json.loads(f.read_text())
        now = self._checksum()
        if _same(saved["weights_checksum"], now):
            return
        if _rank() == 0:
            print(f"error apiary: checkpoint.resume=true: the base weights this run holds ({describe(self._base)}) "
                  f"are not those the adapters in {step_dir} were trained on (checksum {now} now, "
                  f"{saved['weights_checksum']} then). Resume with the base it was trained on, or start a new run on "
                  "this base.", file=sys.stderr, flush=True)
        raise SystemExit(2)
