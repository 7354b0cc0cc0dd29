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
gradients without scaling them (framework.compat ``GRAD_SCALE_OWNER``), and ``scale_grads_``
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
from framework import compat, devices


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
        compat.patch_clip_grad_norm()  # the clip leaves the device gradients to scale_grads_ (GRAD_SCALE_OWNER)
        for m in self.model_parts:
            for p in m.parameters():
                setattr(p, compat.GRAD_SCALE_OWNER, self)
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
        """The trainer's clip (framework.compat ``GRAD_SCALE_OWNER``): ``total_norm`` is torchtitan's,
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


class DeviceUpdateOptimizers(OptimizersContainer):
    """torchtitan's optimizer container with the Adam moments in host memory between steps and the update
    on the device, chunk by chunk (``state.offload_update=device``; module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        chunk_bytes: int = 256 << 20  # fp32 parameter bytes per chunk (its moments travel together)

    WINDOW = 3  # chunks whose moments may be on the device at once: arriving, updating, leaving

    def __init__(self, config: Config, *, model_parts) -> None:
        super().__init__(config, model_parts=model_parts)
        trainable = [p for m in model_parts for p in m.parameters() if p.requires_grad]
        stepped = {id(q) for opt in self.optimizers for g in opt.param_groups for q in g["params"]}
        self._params = [p for p in trainable if id(p) in stepped]  # the model's forward (registration) order
        self._opt_of = {id(q): opt for opt in self.optimizers for g in opt.param_groups for q in g["params"]}
        self._chunks: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self._params):
            n = local(p).numel() * 4
            if self._chunks[-1] and size + n > int(config.chunk_bytes):
                self._chunks.append([])
                size = 0
            self._chunks[-1].append(i)
            size += n
        cuda = devices.has_accelerator() and any(local(p).is_cuda for p in self._params)
        self._h2d = torch.cuda.Stream() if cuda else None  # moments in
        self._d2h = torch.cuda.Stream() if cuda else None  # moments out
        self._written = None  # the last step's final device->host copy (CUDA event)
        self._host: dict = {}  # (id(param), state key) -> its host tensor
        self._grads: list = []
        self.chunk_steps = 0  # chunks stepped so far (tests, benchmarks)

    @staticmethod
    def _moment(p, v) -> bool:
        """A state tensor with one value per element of the local shard (Adam's moments; not ``step``)."""
        return isinstance(v, torch.Tensor) and v.dim() > 0 and local(v).numel() == local(p).numel()

    def _to_host(self, p, st: dict) -> None:
        """Replace ``p``'s device moments in ``st`` by its host tensors (allocated on first use), copied on
        the device->host stream after the current stream's work so far (the caller orders the streams)."""
        for k, v in list(st.items()):
            if not self._moment(p, v) or v is self._host.get((id(p), k)):
                continue
            src = local(v).detach()
            host = self._host.get((id(p), k))
            if host is None:
                host = self._host[(id(p), k)] = devices.host_empty(src.shape, src.dtype)
            if self._d2h is None:
                host.copy_(src)
            else:
                with torch.cuda.stream(self._d2h):
                    host.copy_(src, non_blocking=True)
                src.record_stream(self._d2h)  # its memory is reused only after this copy
            st[k] = host

    def _fetch(self, ci: int):
        """Enqueue chunk ``ci``'s moments host->device: ({parameter index: {key: device state}}, event)."""
        got = {}
        for i in self._chunks[ci]:
            p = self._params[i]
            if self._grads[i] is None:
                continue
            dev = {}
            for k, v in self._opt_of[id(p)].state.get(p, {}).items():
                if not self._moment(p, v):
                    continue
                src = local(v)
                if self._h2d is None:
                    d = src.clone()
                else:
                    if src.is_cuda:  # left on the device by a step that failed mid-chunk
                        self._h2d.wait_stream(torch.cuda.current_stream())
                        src.record_stream(self._h2d)
                    with torch.cuda.stream(self._h2d):
                        d = torch.empty(src.shape, dtype=src.dtype, device=local(p).device)
                        d.copy_(src, non_blocking=True)
                    d.record_stream(torch.cuda.current_stream())  # the update reads and writes it there
                dev[k] = _like(p, d)
            got[i] = dev
        return got, (self._h2d.record_event() if self._h2d is not None else None)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "DeviceUpdateOptimizers does not support closures"
        self._grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        if self._written is not None and self._h2d is not None:
            self._h2d.wait_event(self._written)  # the last step's host copies are complete
        done: dict = {}  # chunk index -> its device->host copies' event
        try:
            nxt = self._fetch(0)
            for ci, chunk in enumerate(self._chunks):
                if ci + 1 < len(self._chunks):
                    self._throttle(done, ci + 1)
                (dev, event), nxt = nxt, (self._fetch(ci + 1) if ci + 1 < len(self._chunks) else None)
                live = [i for i in chunk if self._grads[i] is not None]
                if not live:
                    continue
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
                done[ci] = self._step_chunk(live, lambda i: self._grads[i], dev)
                self.chunk_steps += 1
        finally:
            for p, g in zip(self._params, self._grads):
                p.grad = g
            self._grads = []
            if self._d2h is not None:  # every host copy enqueued so far, also after an error
                self._written = self._d2h.record_event()
        return None

    def host_state_ready(self) -> None:
        """Wait until the moments on the host hold the last step's values (the trainer's finite-state
        check reads them before a checkpoint)."""
        if self._written is not None:
            self._written.synchronize()

    def _step_chunk(self, live: list[int], grad_of, dev: dict | None = None):
        """Step the parameters ``live`` (indices) alone: each gets ``grad_of(i)`` and its device moments
        ``dev[i]`` (none: torch creates them), the optimizers step (a parameter without a gradient is left
        alone), then the moments leave for the host. Returns the device->host copies' event (CUDA)."""
        opts = {}
        for i in live:
            p = self._params[i]
            p.grad = grad_of(i)
            opt = opts.setdefault(id(self._opt_of[id(p)]), self._opt_of[id(p)])
            opt.state[p].update(dev[i] if dev else {})
        for opt in opts.values():
            opt.step()
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream())
        for i in live:
            p = self._params[i]
            p.grad = None
            self._to_host(p, self._opt_of[id(p)].state[p])
        return self._d2h.record_event() if self._d2h is not None else None

    def _throttle(self, done: dict, k: int) -> None:
        """Before chunk ``k``'s moments are allocated on the device: wait (on the host) until chunk
        ``k - WINDOW``'s have left it. The host enqueues far ahead of the device, and the caching allocator
        reuses a freed block only once the copies recorded on it have run, so without this wait every
        chunk's moments would be allocated at once. With it at most WINDOW chunks' are (planner:
        ``offload_device_window_chunks``)."""
        e = done.pop(k - self.WINDOW, None)
        if e is not None:
            e.synchronize()

    @torch.no_grad()
    def _materialize(self) -> None:
        """Create missing Adam state as materialize_state does (one zero-gradient, zero-lr step, so
        checkpoints match offload=none's), one chunk at a time, each chunk's moments moved to the host
        before the next is created (the device never holds more than a chunk's); then wait for every
        host copy (checkpoints read them)."""
        # as materialize_state: only an optimizer without any state yet (a parameter that never had a
        # gradient keeps none, as offload=none's checkpoint has none for it)
        missing = [i for i, p in enumerate(self._params) if not self._opt_of[id(p)].state]
        if missing:
            saved = [p.grad for p in self._params]
            for opt in self.optimizers:
                for g in opt.param_groups:
                    g["_lr"], g["lr"] = g["lr"], (torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0)
            try:
                for p in self._params:
                    p.grad = None
                todo, done = set(missing), {}
                for ci, chunk in enumerate(self._chunks):
                    live = [i for i in chunk if i in todo]
                    if not live:
                        continue
                    self._throttle(done, ci)
                    done[ci] = self._step_chunk(live, lambda i: torch.zeros_like(self._params[i]))
            finally:
                for p, g in zip(self._params, saved):
                    p.grad = g
                for opt in self.optimizers:
                    for g in opt.param_groups:
                        g["lr"] = g.pop("_lr")
                if self._d2h is not None:
                    self._written = self._d2h.record_event()
        self.host_state_ready()

    def state_dict(self):
        self._materialize()
        return flat_state_dict(self.optimizers, lambda q: q)

    def load_state_dict(self, state_dict) -> None:
        self._materialize()
        load_flat_state_dict(self.optimizers, state_dict)

    def static_tensors(self) -> dict[str, list]:
        self._materialize()
        return {"optimizer": [], "host": list(self._host.values())}
