"""ZeRO-1's layout of the parameters: each parameter's slot in a flat bucket per (pipeline stage,
dtype), the rank-major blocks every rank owns, and the DTensor views a checkpoint sees. The
optimizer that reduces, steps and gathers over them: components/state/zero1_optimizer.py.
"""

from __future__ import annotations

import math
import re

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torchtitan.components.checkpointer.utils import canonical_fqn

from components.state.common import local

# --------------------------------------------------------------------------------------
# the sharded optimizer
# --------------------------------------------------------------------------------------

class _Slot:
    """One parameter in a bucket: where its gradient lives, which rows this rank owns."""

    __slots__ = ("fqn", "param", "module", "pname", "expert", "d0", "row", "c", "off", "rows", "lo", "rest",
                 "global_shape", "global_offset", "weight", "master", "grad", "master_dt", "lay")


class _Bucket:
    def __init__(self, slots, mesh, param_dtype, reduce_dtype, device):
        self.slots, self.mesh = slots, mesh
        self.group = mesh.get_group()
        self.W, self.r = mesh.size(), mesh.get_local_rank()
        self.param_dtype, self.device = param_dtype, device
        off = 0
        for s in slots:
            s.c = -(-s.d0 // self.W)
            s.off = off
            s.lo = self.r * s.c
            s.rows = max(0, min(s.c, s.d0 - s.lo))
            off += s.c * s.row
        self.S = off
        self.main_grad = torch.zeros(self.W * self.S, dtype=reduce_dtype, device=device)
        self.master_flat = None
        self.host_grad = None

    # views -----------------------------------------------------------------------------
    def rank_major(self, flat, s):
        """(W, c, row) view of ``s`` in a rank-major buffer of W x S elements."""
        return flat.as_strided((self.W, s.c, s.row), (self.S, s.row, 1), flat.storage_offset() + s.off)

    def own(self, flat, s):
        """The rows this rank owns of ``s`` inside a flat S-element (own-region) buffer."""
        return flat[s.off: s.off + s.rows * s.row].view(s.rows, *s.rest)

    def own_region(self, flat):
        return flat[self.r * self.S: (self.r + 1) * self.S]

    # data movement ---------------------------------------------------------------------
    def _blocks(self, s):
        """(rank, first row, rows) of each rank's valid rows of ``s`` (the last rank's may be short)."""
        for q in range(self.W):
            lo = q * s.c
            n = min(s.c, s.d0 - lo)
            if n <= 0:
                break
            yield q, lo, n

    def scatter_rows(self, dst_rank_major, s, src2d, op):
        """dst[(rank, row)] op= src2d[rank * c + row] for the valid rows of ``s``."""
        dst = self.rank_major(dst_rank_major, s)
        if s.d0 == self.W * s.c:
            op(dst, src2d.view(self.W, s.c, s.row))
            return
        for q, lo, n in self._blocks(s):
            op(dst[q, :n], src2d[lo: lo + n])

    def gather_rows(self, src_rank_major, s, dst2d):
        src = self.rank_major(src_rank_major, s)
        if s.d0 == self.W * s.c:
            dst2d.view(self.W, s.c, s.row).copy_(src)
            return
        for q, lo, n in self._blocks(s):
            dst2d[lo: lo + n].copy_(src[q, :n])


def _checkpointable(t, global_shape, global_offset):
    """Mark ``t`` (one owned chunk) as a shard of a global tensor for DCP."""
    t.global_shape = tuple(global_shape)
    if t.numel() == 0:
        t.global_offsets, t.local_offsets, t.local_sizes = (), (), ()
    else:
        t.global_offsets = (tuple(global_offset),)
        t.local_offsets = ((0,) * t.dim(),)
        t.local_sizes = (tuple(t.shape),)
    return t


class _Layout:
    """Which parameters go into which bucket: one ``_Slot`` per trainable parameter, grouped by
    (data-parallel mesh, param group) in model order, cut into buckets of ``bucket_mb``."""

    def __init__(self, config, model_parts, layouts, ranks_per_stage: int):
        self.config, self.model_parts, self.layouts = config, model_parts, layouts
        self.ranks_per_stage = ranks_per_stage  # world // pp
        self.patterns = [re.compile(pg.pattern) for pg in config.param_groups]
        self.meshes: dict[int, object] = {}

    def groups(self) -> dict[tuple[int, int], list[_Slot]]:
        """Slots by (id of their data-parallel mesh, param-group index), in model order."""
        groups: dict[tuple[int, int], list] = {}
        for part, lay in zip(self.model_parts, self.layouts):
            for name, p in part.named_parameters():
                if not p.requires_grad:
                    continue
                gi = next((i for i, pat in enumerate(self.patterns) if pat.search(name)), None)
                if gi is None:
                    raise ValueError(f"no optimizer param_groups pattern matches {canonical_fqn(name)}")
                s = self.slot(part, lay, name, p)
                mesh = lay["expert"] if s.expert else lay["dense"]
                self.meshes[id(mesh)] = mesh
                groups.setdefault((id(mesh), gi), []).append(s)
        return groups

    def slot(self, part, lay, name: str, p) -> _Slot:
        """Shape, owner module, global placement and norm weight of one parameter."""
        s = _Slot()
        is_dt = isinstance(p, DTensor)
        s.fqn, s.param, s.lay = canonical_fqn(name), p, lay
        s.expert = is_dt and "ep" in (p.device_mesh.mesh_dim_names or ())
        mesh = lay["expert"] if s.expert else lay["dense"]
        mod_path, _, s.pname = name.rpartition(".")
        s.module = part.get_submodule(mod_path) if mod_path else part
        t = local(p)
        if t.dim() == 0:
            raise ValueError(f"state=zero1 does not shard 0-dim parameters ({s.fqn})")
        s.d0, s.rest = t.shape[0], tuple(t.shape[1:])
        s.row = t.numel() // s.d0 if s.d0 else 0
        s.global_shape = tuple(p.shape)
        if is_dt:
            _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            s.global_offset = tuple(offsets)
            sharded = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard())
        else:
            s.global_offset = (0,) * t.dim()
            sharded = 1
        holders = self.ranks_per_stage // (mesh.size() * sharded)
        s.weight = 1.0 / max(1, holders)  # ranks holding the same rows (norm counts them once)
        return s

    def buckets(self, param_dtype, reduce_dtype) -> tuple[list[_Bucket], list[int]]:
        """The buckets (bounded by bucket_mb of fp32) and the param-group index of each."""
        cap = max(1, int(self.config.bucket_mb * 2**20 / 4))
        buckets, bucket_group = [], []
        for (mesh_id, gi), slots in self.groups().items():
            mesh = self.meshes[mesh_id]
            cur, size = [], 0
            for s in slots + [None]:
                n = 0 if s is None else local(s.param).numel()
                if cur and (s is None or size + n > cap):
                    buckets.append(_Bucket(cur, mesh, param_dtype, reduce_dtype, local(cur[0].param).device))
                    bucket_group.append(gi)
                    cur, size = [], 0
                if s is not None:
                    cur.append(s)
                    size += n
        return buckets, bucket_group


def chunk_offset(s: _Slot) -> tuple:
    """Where the owned rows of ``s`` start in the parameter's global tensor."""
    return (s.global_offset[0] + s.lo,) + tuple(s.global_offset[1:])

def master_dtensor(b: _Bucket, s: _Slot):
    """The owned fp32 rows of ``s`` as a DTensor of the parameter's global shape."""
    p = s.param
    if isinstance(p, DTensor):
        names = tuple(p.device_mesh.mesh_dim_names or ())
        dp_name = "efsdp" if s.expert else "fsdp"
        mesh = s.lay["parallel_dims"].get_mesh([dp_name, *names])
        split = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements)
                          if isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0)
        placements = [_StridedShard(0, split_factor=split) if split > 1 else Shard(0), *p.placements]
    else:
        mesh, placements = b.mesh, [Shard(0)]
    stride = [math.prod(s.global_shape[i + 1:]) for i in range(len(s.global_shape))]
    return DTensor.from_local(s.master, mesh, placements, shape=s.global_shape, stride=tuple(stride),
                              run_check=False)
