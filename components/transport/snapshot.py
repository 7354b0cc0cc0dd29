"""The trainer's weights in the published folder's names, packed into buckets for an engine.

An in-memory transport (``publish.transport=vllm_ipc|vllm_nccl``, docs/skills/transport.md) hands
an inference engine the same tensors a published folder holds: the model family's HF names, shapes
and dtype (``publish.dtype``, else the trained dtype). ``plan`` computes them without moving a byte
(the family's converter run on meta tensors, one model layer at a time) and cuts them into buckets
of at most ``bucket_bytes`` (a tensor larger than a bucket gets one of its own). ``Snapshot.fill``
gathers the sharded model (every rank takes part: each DTensor is all-gathered with
``full_tensor``), converts one layer at a time on rank 0's device and copies each tensor into its
place in a bucket; the buckets are allocated once and reused, so a publication allocates nothing.

A bucket is a flat ``uint8`` tensor: its tensors back to back, in order, each ``size`` bytes, so an
engine rebuilds them with ``split(sizes)`` then ``view(dtype).view(shape)`` (vLLM's packed format).
One wire dtype per snapshot keeps every offset aligned to its element size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

LAYER = re.compile(r"^(.*?layers)\.(\d+)\.")


@dataclass
class Entry:
    name: str  # the HF name, as in the published folder's safetensors
    shape: tuple[int, ...]
    size: int  # bytes
    offset: int  # bytes into its bucket


@dataclass
class Bucket:
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(e.shape) for e in self.entries]

    @property
    def sizes(self) -> list[int]:
        return [e.size for e in self.entries]


@dataclass
class Plan:
    buckets: list[Bucket]
    dtype: torch.dtype  # the wire dtype (every tensor)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def entries(self) -> Iterator[Entry]:
        for b in self.buckets:
            yield from b.entries


def layer_groups(keys) -> list[list[str]]:
    """State-dict keys split into the model's layers (``layers.N.``), in first-seen order; the keys
    of no layer (embeddings, final norm, head) form one group before and one after them."""
    pre, post, layers, order = [], [], {}, []
    for k in keys:
        m = LAYER.match(k)
        if m is None:
            (post if order else pre).append(k)
            continue
        key = (m.group(1), int(m.group(2)))
        if key not in layers:
            layers[key] = []
            order.append(key)
        layers[key].append(k)
    return [g for g in (pre, *(layers[k] for k in order), post) if g]


def wire_dtype(publish_dtype: str | None, trained: torch.dtype) -> torch.dtype:
    return getattr(torch, publish_dtype) if publish_dtype else trained


def plan(meta_state: dict, to_hf: Callable[[dict], dict], dtype: torch.dtype, bucket_bytes: int) -> Plan:
    """The buckets of a model whose state dict is ``meta_state`` (shapes only: meta tensors do)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    esize = torch.empty((), dtype=dtype).element_size()
    buckets, cur = [], Bucket()
    for keys in layer_groups(meta_state):
        for name, t in to_hf({k: meta_state[k] for k in keys}).items():
            size = t.numel() * esize
            if cur.entries and cur.nbytes + size > bucket_bytes:
                buckets.append(cur)
                cur = Bucket()
            cur.entries.append(Entry(name, tuple(t.shape), size, cur.nbytes))
            cur.nbytes += size
    if cur.entries:
        buckets.append(cur)
    return Plan(buckets, dtype)


def meta_state(model_parts) -> dict:
    """The model's state dict as meta tensors of the full (unsharded) shapes, names as the
    checkpoint's (``state_dict()``), without gathering anything."""
    out = {}
    for part in model_parts:
        for k, v in part.state_dict().items():
            if isinstance(v, torch.Tensor):
                out[k] = torch.empty(v.shape, dtype=v.dtype, device="meta")
    return out


class Snapshot:
    """The buckets of ``plan`` on ``device`` (rank 0; other ranks hold none and only join the
    gathers) and the fill that copies the model into them."""

    def __init__(self, p: Plan, device: torch.device, holder: bool, allocate: Callable | None = None):
        self.plan = p
        self.holder = holder
        self.device = device
        self._index = {e.name: (i, e) for i, b in enumerate(p.buckets) for e in b.entries}
        alloc = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, device=device))
        self.buffers = [alloc(b.nbytes) for b in p.buckets] if holder else []
        self.copies = 0  # copy_ calls the fills made (consecutive slices of one weight go in one)

    def view(self, name: str) -> torch.Tensor:
        i, e = self._index[name]
        return self.buffers[i][e.offset:e.offset + e.size].view(self.plan.dtype).view(e.shape)

    def tensors(self, bucket: int) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.plan.buckets[bucket].entries:
            yield e.name, self.view(e.name)

    def fill(self, model_parts, to_hf: Callable[[dict], dict]) -> int:
        """Copy the model's current weights into the buckets (a collective: every rank calls it).
        Returns the number of tensors written (rank 0) or 0."""
        state = {}
        for part in model_parts:
            state.update(part.state_dict())
        written = 0
        for keys in layer_groups(state):
            group = {}
            for k in keys:
                v = state[k]
                if isinstance(v, DTensor):
                    v = v.full_tensor()
                if self.holder and isinstance(v, torch.Tensor):
                    group[k] = v.detach()
            if not self.holder:
                continue
            pairs = []
            for name, t in to_hf(group).items():
                if name not in self._index:
                    raise RuntimeError(f"weight {name} is not in the transfer plan (the model changed after "
                                       "the plan was made)")
                dst = self.view(name)
                if tuple(t.shape) != tuple(dst.shape):
                    raise RuntimeError(f"weight {name}: shape {tuple(t.shape)} differs from the plan's "
                                       f"{tuple(dst.shape)}")
                pairs.append((dst, t))
            with torch.no_grad():
                # copy_ casts and moves in one kernel (the same rounding as a cast before the copy); the
                # experts of one stacked weight, one tensor each in the published names, go in one copy
                for dst, src in coalesce(pairs):
                    dst.copy_(src, non_blocking=True)
                    self.copies += 1
            written += len(pairs)
            del group, pairs
        if self.holder and written != len(self._index):
            raise RuntimeError(f"the model filled {written} of the plan's {len(self._index)} weights")
        return written


def _follows(prev: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` starts in memory where ``prev`` ends, in the same storage (both contiguous, one dtype)."""
    return (prev.is_contiguous() and t.is_contiguous() and prev.dtype == t.dtype and prev.device == t.device
            and prev.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            and t.data_ptr() == prev.data_ptr() + prev.numel() * prev.element_size())


def coalesce(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs where consecutive pairs continue one another in memory on both
    sides (a stacked weight's slices into back-to-back places of a bucket) merged into one pair of
    flat views over the run; the rest as they are. Copying the result copies the same elements."""
    out, run = [], []
    for dst, src in pairs:
        if run and _follows(run[-1][0], dst) and _follows(run[-1][1], src):
            run.append((dst, src))
        else:
            if run:
                out.append(_merged(run))
            run = [(dst, src)]
    if run:
        out.append(_merged(run))
    return out


def _merged(run: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(run) == 1:
        return run[0]
    n = sum(d.numel() for d, _ in run)
    (d0, s0) = run[0]
    return d0.as_strided((n,), (1,)), s0.as_strided((n,), (1,))
