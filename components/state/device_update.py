"""state.offload_update=device: the optimizer step on the GPU, a window of chunks at a time, with the
Adam moments kept on the host between steps (fetched and written back while the previous chunk computes).
components/state/offload.py explains both offload modes and holds their shared state-dict helpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.optimizer import OptimizersContainer

from components.state.common import local
from components.state.offload import _like, flat_state_dict, load_flat_state_dict
from framework import devices


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
