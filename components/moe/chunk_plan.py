"""The chunk plan of chunked MoE experts (components/moe/chunked_experts.py): routed rows sorted by
(chunk, expert), the per-chunk counts exchanged over the EP group once, the splits and permutations
each chunk's all-to-all and grouped GEMM use; and the asynchronous variable-split all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torchtitan's GroupedExperts runs its grouped GEMMs in bf16 whatever the activation dtype.


class _Pending:
    """A launched all-to-all; ``wait()`` returns its output once the caller may use it."""

    __slots__ = ("work", "out")

    def __init__(self, work, out: torch.Tensor):
        self.work, self.out = work, out

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def _exchange(group, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
              out: torch.Tensor | None = None) -> _Pending:
    """Variable-split all-to-all launched asynchronously (no group: EP=1, a local copy)."""
    inp = inp.contiguous()
    if group is None:
        if out is None:
            return _Pending(None, inp)
        out.copy_(inp)
        return _Pending(None, out)
    if out is None:
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    return _Pending(work, out)


@dataclass
class ChunkPlan:
    """Everything the chunk schedule needs; built once per forward (and once per recompute)."""

    num_chunks: int
    group: object | None  # the EP process group, None for EP=1
    order_N: torch.Tensor  # routed row r of the (chunk, expert)-sorted layout is flat (t*K + k) order_N[r]
    send_splits: list[list[int]]  # [chunk][dest rank]: rows this rank sends
    recv_splits: list[list[int]]  # [chunk][src rank]: rows this rank receives
    send_bounds: list[tuple[int, int]]  # [chunk]: row range in the sender-side (sorted) layout
    perms: list[torch.Tensor | None]  # [chunk]: expert-major row i = received (rank-major) row perms[c][i]
    offsets: list[torch.Tensor]  # [chunk]: int32 cumulative rows per local expert (grouped GEMM offs)


def build_plan(ids_TK: torch.Tensor, num_chunks: int, num_experts: int, group, ep_size: int) -> ChunkPlan:
    """Sort routed rows by (chunk, expert), exchange per-chunk counts, derive splits and permutations."""
    T, K = ids_TK.shape
    n, e = num_chunks, num_experts // ep_size
    device = ids_TK.device
    chunk_T = torch.div(torch.arange(T, device=device) * n, T, rounding_mode="floor")  # contiguous, balanced
    key_N = (chunk_T.unsqueeze(1) * num_experts + ids_TK).reshape(-1)
    order_N = torch.argsort(key_N, stable=True)
    counts = torch.bincount(key_N, minlength=n * num_experts).view(n, ep_size, e)
    if group is None:
        recv = counts  # [n, 1, e]; no exchange and no host sync: chunk c is tokens [ceil(cT/n), ceil((c+1)T/n))
        bounds = [(-(-c * T // n)) * K for c in range(n + 1)]
        send_splits = [[bounds[c + 1] - bounds[c]] for c in range(n)]
        recv_splits = [list(s) for s in send_splits]
    else:
        send = counts.permute(1, 0, 2).contiguous()  # [dest rank, chunk, local expert]
        got = torch.empty_like(send)  # [src rank, chunk, local expert]
        dist.all_to_all_single(got, send, group=group)
        recv = got.permute(1, 0, 2)  # [chunk, src rank, local expert]
        host = torch.cat([counts.sum(-1).reshape(-1), recv.sum(-1).reshape(-1)]).tolist()  # the one host sync
        send_splits = [host[c * ep_size:(c + 1) * ep_size] for c in range(n)]
        recv_splits = [host[(n + c) * ep_size:(n + c + 1) * ep_size] for c in range(n)]
        bounds = [0]
        for c in range(n):
            bounds.append(bounds[-1] + sum(send_splits[c]))
    send_bounds = [(bounds[c], bounds[c + 1]) for c in range(n)]
    recv_rows = [sum(s) for s in recv_splits]
    offs = torch.cumsum(recv.sum(1), dim=1, dtype=torch.int32)  # [chunk, local expert]
    offsets = [offs[c] for c in range(n)]
    if group is None:
        perms = [None] * n  # one source rank: rank-major is already expert-major
    else:
        # Received rows of chunk c are rank-major (src rank, local expert); the grouped GEMM
        # wants expert-major (local expert, src rank). One vectorised pass for all chunks.
        flat = recv.reshape(n, ep_size * e)
        start_rm = (torch.cumsum(flat, dim=1) - flat).view(n, ep_size, e)  # within-chunk start of (r, j)
        seg_len = recv.transpose(1, 2).reshape(-1)  # segments ordered (chunk, j, r)
        seg_start = start_rm.transpose(1, 2).reshape(-1)
        total = sum(recv_rows)
        seg_id = torch.repeat_interleave(torch.arange(seg_len.numel(), device=device), seg_len, output_size=total)
        seg_out_start = torch.cumsum(seg_len, 0) - seg_len
        perm = seg_start[seg_id] + torch.arange(total, device=device) - seg_out_start[seg_id]
        perms = list(perm.split(recv_rows))
    return ChunkPlan(num_chunks=n, group=group, order_N=order_N, send_splits=send_splits,
                     recv_splits=recv_splits, send_bounds=send_bounds, perms=perms, offsets=offsets)
