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

``state.offload=all`` is torchtitan's ``training.enable_cpu_offload`` (FSDP2's
CPUOffloadPolicy: parameters and gradients live on the host too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer

from components.state.common import host_threads, local, materialize_state, torch_threads
from framework import devices


def _like(template, t):
    """``t`` (a local shard) wrapped with ``template``'s DTensor placements, or ``t``."""
    if isinstance(template, DTensor):
        return DTensor.from_local(t, template.device_mesh, template.placements, shape=template.shape,
                                  stride=template.stride(), run_check=False)
    return t


class HostOptimizers(OptimizersContainer):
    """torchtitan's optimizer container stepping host-resident fp32 masters."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        threads: int = 0  # CPU threads of the host update (0: auto, components.state.common.host_threads)

    def __init__(self, config: Config, *, model_parts) -> None:
        self.threads = host_threads(config.threads)
        self._pairs: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []  # (device param, master, staging)
        self._param_of: dict[int, nn.Parameter] = {}
        super().__init__(config, model_parts=model_parts)
        for part in model_parts:  # torch sets attributes on hooks: a plain function, not a bound method
            part.register_load_state_dict_post_hook(lambda m, keys: self._masters_from_params())

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
        out = {}
        for opt in self.optimizers:
            for g in opt.param_groups:
                for master, fqn in zip(g["params"], g["param_names"]):
                    p = self._param_of[id(master)]
                    for k, v in opt.state[master].items():
                        out[f"state.{fqn}.{k}"] = _like(p, v) if isinstance(v, torch.Tensor) and v.dim() else v
                    for k, v in g.items():
                        if k not in ("params", "param_names"):
                            out[f"param_groups.{fqn}.{k}"] = v
        return out

    def load_state_dict(self, state_dict) -> None:
        materialize_state(self.optimizers)
        for opt in self.optimizers:
            for g in opt.param_groups:
                for master, fqn in zip(g["params"], g["param_names"]):
                    for k, v in opt.state[master].items():
                        key = f"state.{fqn}.{k}"
                        if key not in state_dict:
                            raise KeyError(f"optimizer state {key} missing from the checkpoint")
                        src = local(state_dict[key]) if isinstance(state_dict[key], torch.Tensor) else state_dict[key]
                        if isinstance(v, torch.Tensor) and not (src.numel() and src.data_ptr() == v.data_ptr()):
                            v.copy_(src)
                if g["param_names"]:
                    for k in [k for k in g if k not in ("params", "param_names")]:
                        key = f"param_groups.{g['param_names'][0]}.{k}"
                        if key not in state_dict:
                            raise KeyError(f"optimizer param group key {key} missing from the checkpoint")
                        g[k] = state_dict[key]

    def static_tensors(self) -> dict[str, list]:
        states = [t for opt in self.optimizers for st in opt.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor)]
        return {"optimizer": [], "host": [m for _, m, _ in self._pairs] + [s for _, _, s in self._pairs] + states}
