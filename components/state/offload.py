"""Optimizer-only CPU offload for FSDP2 (``state=fsdp2 state.offload=optimizer``).

FSDP2 keeps its sharded fp32 parameters and gradients on the device (forward and backward
are unchanged); the optimizer works on the host: each step copies the sharded gradients
device->host, runs Adam/AdamW on host fp32 masters and host states (plain CPU tensors, so
the update is an ordinary CPU kernel), and copies the updated shards host->device. Host
memory per rank: master + gradient staging + two Adam moments = 16 bytes per locally held
(sharded) parameter; the device no longer holds the 8 bytes of Adam moments. The host update
runs with ``state.offload_threads`` CPU threads (0: this process's CPUs / ranks on the node).

The optimizer state dict is FQN-keyed with each state wrapped in its parameter's DTensor
placements (torchtitan's flat layout: ``state.{fqn}.exp_avg``, ``param_groups.{fqn}.lr``),
so checkpoints are interchangeable with ``offload=none`` and with ``state=zero1``. After a
model checkpoint is loaded into the device parameters the host masters are refreshed.

``state.offload_overlap=true`` (one H200: 1.14x plain offload, bounded by the host AdamW;
docs/skills/fsdp2.md) moves the three transfers off the
step's critical path. Each gradient leaves the device during the backward: a post-accumulate-grad
hook (FSDP2 runs it right after the parameter's reduce-scatter) enqueues, on the last micro-batch
of the step, its device->host copy on a side stream that first waits on the current stream. The
clip runs on the host: the trainer's ``clip_grad_norm_`` computes torchtitan's norm over the device
gradients without scaling them (``contracts.GradScaleOwner``), and ``scale_grads_``
keeps the coefficient, which the step multiplies into the staged gradients (the same fp32 product
the device would form, so bit-equal to the non-overlapped offload). The step then updates the
masters in chunks of ``chunk_bytes`` in the model's forward order; each chunk's shards go back on
the side stream while the host updates the next, and the current stream waits (on the device, the
host does not block) for the last copy before the next forward. A gradient the hooks did not copy
(fewer accumulations than ``grad_accum``) or that accumulated again after its copy is copied by the
step (``late_copies``): a wrong count costs overlap, not correctness.
On CPU the same path runs with synchronous copies.

``state.offload_update=device`` (``DeviceUpdateOptimizers``) keeps only the Adam moments on the host
(pinned) and runs the update on the device: after the backward (and the trainer's clip, on the device as
without offload) the parameters step in chunks of ``chunk_bytes`` in the model's forward order; each
chunk's moments arrive on one side stream while the previous chunk updates and leave on another after
their update, so the host never blocks and no host core computes. The fp32 shards, their gradients and
the optimizer's arithmetic are those of ``offload=none`` (the same torch AdamW kernel on the same device
tensors, one chunk's parameters at a time: Adam is elementwise), so its numerics are offload=none's.
Transfers: the moments' bytes in and out per step (16 bytes per parameter with fp32 moments), which PCIe
bandwidth bounds; the device holds a few chunks' moments at a time.

``state.offload=all`` is torchtitan's ``training.enable_cpu_offload`` (FSDP2's
CPUOffloadPolicy: parameters and gradients live on the host too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer

from components.state.common import host_threads, local, materialize_state, torch_threads
from framework import compat, contracts, devices


def _like(template, t):
    """``t`` (a local shard) wrapped with ``template``'s DTensor placements, or ``t``; ``t`` stays where it
    is. (``DTensor.from_local`` would copy a host tensor to the mesh's device: a checkpoint of offloaded
    state would then build a device copy of every moment, the memory offloading frees, and load into it.
    FSDP2's own CPU offload keeps host shards in DTensors of a CUDA mesh the same way.)"""
    if isinstance(template, DTensor):
        from torch.distributed.tensor._dtensor_spec import TensorMeta  # reason: torch internals, one place

        meta = TensorMeta(template.shape, template.stride(), t.dtype)
        return DTensor(t, dataclasses.replace(template._spec, tensor_meta=meta), requires_grad=False)
    return t


def flat_state_dict(optimizers, device_param) -> dict:
    """torchtitan's flat FQN-keyed optimizer state (``state.{fqn}.{key}``, ``param_groups.{fqn}.{key}``),
    each tensor state wrapped in the placements of its parameter's device DTensor (``device_param(q)``
    for the optimizer's parameter ``q``), so offloaded and on-device checkpoints interchange."""
    out = {}
    for opt in optimizers:
        for g in opt.param_groups:
            for q, fqn in zip(g["params"], g["param_names"]):
                p = device_param(q)
                for k, v in opt.state[q].items():
                    out[f"state.{fqn}.{k}"] = _like(p, v) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in g.items():
                    if k not in ("params", "param_names"):
                        out[f"param_groups.{fqn}.{k}"] = v
    return out


def load_flat_state_dict(optimizers, state_dict) -> None:
    """Copies a ``flat_state_dict`` layout into the optimizers' existing state tensors (in place: DCP
    may already have loaded into them) and param-group values; KeyError naming a missing key."""
    for opt in optimizers:
        for g in opt.param_groups:
            for q, fqn in zip(g["params"], g["param_names"]):
                for k, v in opt.state[q].items():
                    key = f"state.{fqn}.{k}"
                    if key not in state_dict:
                        raise KeyError(f"optimizer state {key} missing from the checkpoint")
                    src = local(state_dict[key]) if isinstance(state_dict[key], torch.Tensor) else state_dict[key]
                    if isinstance(v, torch.Tensor) and not (src.numel() and src.data_ptr() == local(v).data_ptr()):
                        local(v).copy_(src)
            if g["param_names"]:
                for k in [k for k in g if k not in ("params", "param_names")]:
                    key = f"param_groups.{g['param_names'][0]}.{k}"
                    if key not in state_dict:
                        raise KeyError(f"optimizer param group key {key} missing from the checkpoint")
                    g[k] = state_dict[key]


class HostOptimizers(OptimizersContainer):
    """torchtitan's optimizer container stepping host-resident fp32 masters."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        threads: int = 0  # CPU threads of the host update (0: auto, components.state.common.host_threads)
        overlap: bool = False  # state.offload_overlap: transfers overlapped with the device's work
        grad_accum: int = 1  # overlap: micro-batches per step (a gradient is final after this many)
        chunk_bytes: int = 256 << 20  # overlap: fp32 master bytes per host-update chunk (forward order)

    def __init__(self, config: Config, *, model_parts) -> None:
        self.threads = host_threads(config.threads)
        self._pairs: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []  # (device param, master, staging)
        self._param_of: dict[int, nn.Parameter] = {}
        self.overlap, self.grad_accum = bool(config.overlap), max(1, int(config.grad_accum))
        self.copies = self.late_copies = 0  # overlap: gradient copies enqueued by the hooks / by the step
        super().__init__(config, model_parts=model_parts)
        for part in model_parts:  # torch sets attributes on hooks: a plain function, not a bound method
            part.register_load_state_dict_post_hook(lambda m, keys: self._masters_from_params())
        if self.overlap:
            self._init_overlap(int(config.chunk_bytes))

    # ---- overlap (state.offload_overlap) ----
    def _init_overlap(self, chunk_bytes: int) -> None:
        order = {id(p): i for i, p in enumerate(p for m in self.model_parts for p in m.parameters())}
        self._pairs.sort(key=lambda t: order[id(t[0])])  # the model's forward (registration) order
        n = len(self._pairs)
        self._slot = {id(p): i for i, (p, _, _) in enumerate(self._pairs)}
        self._count = [0] * n  # gradient accumulations seen this step
        self._copied = [0] * n  # the accumulation count at this step's copy (0: not copied)
        self._events: list = [None] * n  # the copy's CUDA event (None on CPU: the copy was synchronous)
        self._coef = None  # the clip coefficient scale_grads_ left for this step (a device tensor)
        self._chunks: list[list[int]] = [[]]
        size = 0
        for i, (_, master, _) in enumerate(self._pairs):
            if self._chunks[-1] and size + master.numel() * master.element_size() > chunk_bytes:
                self._chunks.append([])
                size = 0
            self._chunks[-1].append(i)
            size += master.numel() * master.element_size()
        self._stream = torch.cuda.Stream() if devices.has_accelerator() else None
        compat.patch_clip_grad_norm()  # the clip leaves the device gradients to scale_grads_ (contracts.own_gradients)
        for m in self.model_parts:
            for p in m.parameters():
                contracts.own_gradients(p, scale=self)
        for p, _, _ in self._pairs:  # torch may set attributes on hooks: a plain function
            p.register_post_accumulate_grad_hook(lambda q: self._on_grad(q))

    @torch.no_grad()
    def _on_grad(self, p) -> None:
        i = self._slot[id(p)]
        self._count[i] += 1
        if self._count[i] == self.grad_accum:  # the step's last micro-batch: the gradient is final
            self._copy_grad(i)
            self.copies += 1

    def _copy_grad(self, i: int) -> None:
        """Device->host copy of gradient ``i`` into its staging: on the side stream after the current
        stream's work so far (FSDP2 calls the hook on its reduce-scatter stream), or synchronous on CPU."""
        p, _, staging = self._pairs[i]
        g = local(p.grad).detach()
        if self._stream is None:
            staging.copy_(g)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                staging.copy_(g, non_blocking=True)
                g.record_stream(self._stream)  # a gradient freed before the copy ends keeps its memory
                self._events[i] = self._stream.record_event()
        self._copied[i] = self._count[i]

    def scale_grads_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """The trainer's clip (``contracts.GradScaleOwner``): ``total_norm`` is torchtitan's,
        the device gradients stay as they are; keep torch's coefficient min(max_norm / (norm + 1e-6), 1),
        formed with torch's own ops so its fp32 value is the one the device would multiply by."""
        self._coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)

    def _step_overlapped(self) -> None:
        coef, self._coef = self._coef, None
        for i, (p, _, _) in enumerate(self._pairs):
            # not copied, or accumulated again after its copy (grad_accum too small)
            if p.grad is not None and (not self._copied[i] or self._copied[i] != self._count[i]):
                self._copy_grad(i)
                self.late_copies += 1
        coef = None if coef is None else coef.detach().to("cpu", torch.float32)
        scale = coef is not None and float(coef) != 1.0  # x * 1.0 == x exactly: skip that pass
        start = last = None
        if self._stream is not None:  # the shards are written after the device's reads of them so far
            start = torch.cuda.current_stream().record_event()
        with torch_threads(self.threads):
            for chunk in self._chunks:
                live = [i for i in chunk if self._pairs[i][0].grad is not None]
                for i in live:
                    if self._events[i] is not None:
                        self._events[i].synchronize()
                    _, master, staging = self._pairs[i]
                    if scale:
                        staging.mul_(coef)  # the fp32 product the device's clip would form
                    master.grad = staging
                if live:
                    for opt in self.optimizers:  # a parameter without a gradient is left alone
                        opt.step()
                for i in live:
                    p, master, _ = self._pairs[i]
                    master.grad = None
                    if self._stream is None:
                        local(p).detach().copy_(master)
                    else:
                        with torch.cuda.stream(self._stream):
                            if start is not None:
                                self._stream.wait_event(start)
                                start = None
                            local(p).detach().copy_(master, non_blocking=True)
                if live and self._stream is not None:
                    last = self._stream.record_event()
        if last is not None:
            torch.cuda.current_stream().wait_event(last)  # the next forward reads the new shards
        self._reset_overlap()

    def _reset_overlap(self) -> None:
        n = len(self._pairs)
        self._count, self._copied, self._events, self._coef = [0] * n, [0] * n, [None] * n, None

    def _build_param_groups(self, model, param_group_configs, impl_kwargs):
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        for group_list in groups.values():
            for g in group_list:
                g["params"] = [self._host_master(p) for p in g["params"]]
        return groups, patterns

    def _host_master(self, p: nn.Parameter) -> torch.Tensor:
        shard = local(p).detach()
        master = devices.host_empty(shard.shape, torch.float32)
        master.copy_(shard)
        staging = devices.host_empty(shard.shape, torch.float32)
        self._pairs.append((p, master, staging))
        self._param_of[id(master)] = p
        return master

    def _validate_params(self, all_params) -> None:
        trainable = [p for m in self.model_parts for p in m.parameters() if p.requires_grad]
        assert len(all_params) == len(trainable) == len(self._pairs), (
            f"{len(trainable)} trainable params, {len(all_params)} host masters")

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "HostOptimizers does not support closures"
        if self.overlap:
            self._step_overlapped()
            return None
        for p, _, staging in self._pairs:
            if p.grad is not None:
                staging.copy_(local(p.grad), non_blocking=True)
        devices.synchronize()
        for p, master, staging in self._pairs:
            master.grad = staging if p.grad is not None else None
        with torch_threads(self.threads):
            for opt in self.optimizers:  # not super().step(): its hook wrapper would rerun our pre-hooks
                opt.step()
        for p, master, _ in self._pairs:
            master.grad = None
            local(p).detach().copy_(master, non_blocking=True)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.overlap:  # also after a skipped step: the next step counts its micro-batches afresh
            self._reset_overlap()
        for p, master, _ in self._pairs:
            master.grad = None
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def _masters_from_params(self) -> None:
        for p, master, _ in self._pairs:
            master.copy_(local(p))

    # checkpoints: torchtitan's flat FQN layout, states wrapped in the parameters' placements
    def state_dict(self):
        materialize_state(self.optimizers)
        return flat_state_dict(self.optimizers, lambda q: self._param_of[id(q)])

    def load_state_dict(self, state_dict) -> None:
        materialize_state(self.optimizers)
        load_flat_state_dict(self.optimizers, state_dict)

    def static_tensors(self) -> dict[str, list]:
        states = [t for opt in self.optimizers for st in opt.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor)]
        return {"optimizer": [], "host": [m for _, m, _ in self._pairs] + [s for _, _, s in self._pairs] + states}
