"""ZeRO-1's machinery for state=zero1 (components/state/zero1.py describes the method): the
parallelize wrapper without FSDP and ``Zero1Optimizers``, the sharded fp32 master and optimizer on
torchtitan's OptimizersContainer. Imported when the component is applied (torch, torchtitan), so
that reading the component's Options (`train --help`, `--cfg job`) needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP

from components.state.common import host_threads, local, materialize_state, torch_threads
from components.state.zero1_layout import _Bucket, _checkpointable, _Layout, _Slot, chunk_offset, master_dtensor
from framework import compat, contracts, devices

# --------------------------------------------------------------------------------------
# parallelize: torchtitan's model parallelism (EP/TP/CP/PP, AC, compile) without FSDP
# --------------------------------------------------------------------------------------


def without_fsdp(parallelize_fn):
    """Wrap a torchtitan parallelize_fn: same model parallelism, no data-parallel wrapping;
    records the data-parallel meshes zero1 shards its optimizer over on the model part."""

    def parallelize(model, **kwargs):
        parallel_dims = kwargs["parallel_dims"]
        # torchtitan's parallelize functions (and apiary's model wrappers) call ``apply_fsdp*``
        # helpers they import by name: no-ops for the duration of this call
        with compat.fsdp_wrappers_disabled(("components.models.",)):
            model = parallelize_fn(model, **kwargs)
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise RuntimeError("state=zero1: the model's parallelize_fn applied FSDP through a path apiary "
                               "does not intercept; use state=fsdp2 for this model.")
        dense = parallel_dims.get_mesh("fsdp")  # dp_shard x cp: every rank that holds the same dense params
        expert = parallel_dims.get_mesh("efsdp") if parallel_dims.ep_enabled else dense
        model._apiary_zero1 = {"dense": dense, "expert": expert, "pp": parallel_dims.pp,
                               "world": parallel_dims.world_size, "parallel_dims": parallel_dims}
        return model

    return parallelize


class Zero1Optimizers(OptimizersContainer):
    """torchtitan's optimizer container with ZeRO-1 sharding (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        offload: bool = False
        offload_threads: int = 0  # CPU threads of the host update (0: auto, components.state.common.host_threads)
        grad_reduce: str = "reduce_scatter"
        bucket_mb: float = 256.0
        param_dtype: str = "bfloat16"
        reduce_dtype: str = "float32"

    def __init__(self, config: Config, *, model_parts) -> None:
        layouts = [getattr(m, "_apiary_zero1", None) for m in model_parts]
        if any(lay is None for lay in layouts):
            # Not parallelized (torchtitan's seed-checkpoint path): a plain container.
            self._engine_on = False
            super().__init__(config, model_parts=model_parts)
            return
        self._engine_on = True
        self._build(config, model_parts, layouts)

    # construction ------------------------------------------------------------------------
    def _build(self, config, model_parts, layouts) -> None:
        """The engine, step by step: slots and buckets (``_Layout``), fp32 masters, parameters in
        the compute dtype, gradient hooks, the torch optimizers, checkpoint hooks."""
        self.model_parts = model_parts
        self.config = config
        self.offload = bool(config.offload)
        self.threads = host_threads(config.offload_threads) if self.offload else None
        self.grad_reduce = config.grad_reduce
        self.param_dtype = TORCH_DTYPE_MAP[config.param_dtype]
        reduce_dtype = TORCH_DTYPE_MAP[config.reduce_dtype]
        # A separate fp32 master exists unless the parameters themselves are fp32 on the device.
        self.separate_master = self.offload or self.param_dtype != torch.float32
        impl = self._build_impl_kwargs(config)
        for pg in config.param_groups:
            if pg.optimizer_name not in ("Adam", "AdamW"):
                raise ValueError(f"state=zero1 shards element-wise optimizers only (Adam, AdamW); "
                                 f"got {pg.optimizer_name}. Use state=fsdp2.")
        self._pp, self._world = layouts[0]["pp"], layouts[0]["world"]
        layout = _Layout(config, model_parts, layouts, self._world // self._pp)
        self.buckets, bucket_group = layout.buckets(self.param_dtype, reduce_dtype)
        self._init_masters(reduce_dtype)
        if self.param_dtype != torch.float32 or any(local(s.param).dtype != self.param_dtype
                                                    for b in self.buckets for s in b.slots):
            self._cast_params(self.param_dtype)  # module-level replacement keeps DTensors consistent
        self._install_grad_hooks()
        self._make_optimizers(bucket_group, impl)
        if self.separate_master:
            self._install_checkpoint_hooks()
        self._slot_by_fqn = {s.fqn: (b, s) for b in self.buckets for s in b.slots}
        self._reduced = False
        compat.patch_clip_grad_norm()  # clip_grad_norm_ asks this optimizer for its parameters (contracts.own_gradients)
        torch.optim.Optimizer.__init__(self, [p for m in model_parts for p in m.parameters() if p.requires_grad], {})

    def _init_masters(self, reduce_dtype) -> None:
        """The fp32 rows this rank owns (the masters) and the gradient views the optimizer reads."""
        for b in self.buckets:
            if self.separate_master:
                if self.offload:
                    b.master_flat = devices.host_empty((b.S,), torch.float32)
                    b.host_grad = devices.host_empty((b.S,), reduce_dtype)
                    b.host_grad.zero_()
                else:
                    b.master_flat = torch.empty(b.S, dtype=torch.float32, device=b.device)
            own_grad = b.host_grad if self.offload else b.own_region(b.main_grad)
            for s in b.slots:
                rows = local(s.param).detach().reshape(s.d0, s.row)[s.lo: s.lo + s.rows].view(s.rows, *s.rest)
                if self.separate_master:
                    s.master = b.own(b.master_flat, s)
                    s.master.copy_(rows)
                else:
                    s.master = rows  # the parameter's own rows are the fp32 master
                s.grad = b.own(own_grad, s)
                s.master.grad = s.grad

    def _install_grad_hooks(self) -> None:
        """Accumulate each gradient into the fp32 buckets and free the autograd gradient."""
        self._hooks = []
        for b in self.buckets:
            for s in b.slots:
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._make_hook(b, s)))
                contracts.own_gradients(s.param, clip=self)

    def _make_optimizers(self, bucket_group: list[int], impl: dict) -> None:
        """One torch optimizer per param group, over the owned master chunks."""
        config = self.config
        self.optimizers = []
        for gi, pg in enumerate(config.param_groups):
            owned = [s for b, g in zip(self.buckets, bucket_group) if g == gi for s in b.slots if s.rows > 0]
            factory = self._resolve_optimizer_factory(pg.optimizer_name)
            self.optimizers.append(factory(
                [{"params": [s.master for s in owned], "param_names": [s.fqn for s in owned],
                  **impl, **pg.optimizer_kwargs}],
                **config.optimizer_factory_kwargs_by_name.get(pg.optimizer_name, {})))
        if config.implementation == "fused_opt_states_bf16":
            self._register_bf16_optimizer_state_hook()

    def _install_checkpoint_hooks(self) -> None:
        """With a separate master the model section of a checkpoint holds the fp32 master, as a
        DTensor over (data parallel x the parameter's own mesh) so that module state-dict hooks
        (e.g. the fused-QKV split) see a distributed tensor, as they do under FSDP2. (torch sets
        attributes on hooks: register plain functions, not bound methods.)"""
        owners: dict[int, tuple] = {}
        for b in self.buckets:
            for s in b.slots:
                s.master_dt = master_dtensor(b, s)
                owners.setdefault(id(s.module), (s.module, []))[1].append(s)
        for module, slots in owners.values():
            module.register_state_dict_post_hook(
                lambda m, sd, prefix, meta, slots=slots: self._save_masters(slots, sd, prefix))
            module.register_load_state_dict_pre_hook(
                lambda m, sd, prefix, *a, slots=slots: self._load_masters(slots, sd, prefix))
        for part in self.model_parts:
            part.register_load_state_dict_post_hook(lambda m, keys: self._after_model_load(keys))

    def _cast_params(self, dtype) -> None:
        new_of: dict[int, nn.Parameter] = {}
        for part in self.model_parts:
            for mod in part.modules():
                for pname, p in list(mod._parameters.items()):
                    if p is None or not p.requires_grad:
                        continue
                    if id(p) not in new_of:
                        if isinstance(p, DTensor):
                            local = p.to_local().detach().to(dtype)
                            dt = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                                    stride=p.stride(), run_check=False)
                            new_of[id(p)] = nn.Parameter(dt, requires_grad=True)
                        else:
                            p.data = p.data.to(dtype)
                            new_of[id(p)] = p
                    mod._parameters[pname] = new_of[id(p)]
        for b in self.buckets:
            for s in b.slots:
                s.param = new_of.get(id(s.param), s.param)

    @staticmethod
    def _make_hook(b: _Bucket, s: _Slot):
        def hook(param):
            g = param.grad
            if g is None:
                return
            if isinstance(g, DTensor):
                if tuple(g.placements) != tuple(param.placements):
                    g = g.redistribute(param.device_mesh, param.placements)
                g = g.to_local()
            b.scatter_rows(b.main_grad, s, g.reshape(s.d0, s.row), lambda d, x: d.add_(x))
            param.grad = None

        return hook

    # the step ----------------------------------------------------------------------------
    def _reduce(self) -> None:
        if self._reduced:
            return
        works = []
        for b in self.buckets:
            if b.W == 1:
                continue
            if self.grad_reduce == "all_reduce":
                works.append(dist.all_reduce(b.main_grad, group=b.group, async_op=True))
            else:
                works.append(dist.reduce_scatter_single(b.own_region(b.main_grad), b.main_grad,
                                                        group=b.group, async_op=True))
        for w in works:
            w.wait()
        self._reduced = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Reduce the gradients, return the global norm and clip the owned rows in place. torchtitan's
        trainer calls its ``clip_grad_norm_`` on the model's parameters, but the reduced gradients live
        in this optimizer's buckets: framework.compat's ``patch_clip_grad_norm`` routes the call here
        for parameters that have this optimizer as their ``contracts.GradClipOwner``."""
        if float(norm_type) != 2.0:
            raise NotImplementedError("state=zero1 clips by the 2-norm only")
        self._reduce()
        device = self.buckets[0].main_grad.device if self.buckets else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        grads, weights = [], []
        for b in self.buckets:
            for s in b.slots:
                if s.rows:
                    grads.append(b.own(b.own_region(b.main_grad), s))
                    weights.append(s.weight)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            w = torch.tensor(weights, dtype=torch.float32, device=device)
            total = (torch.stack(norms).float().pow(2) * w).sum()
        dist.all_reduce(total)
        total = total.sqrt()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of the gradients is non-finite ({total.item()})")
        if max_norm and max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        return total

    def step(self, closure=None):
        assert closure is None, "Zero1Optimizers does not support closures"
        if not self._engine_on:
            for opt in self.optimizers:  # not super().step(): its hook wrapper would rerun our pre-hooks
                opt.step()
            return None
        self._reduce()
        if self.offload:
            for b in self.buckets:
                b.host_grad.copy_(b.own_region(b.main_grad), non_blocking=True)
            devices.synchronize()
        with torch_threads(self.threads):
            for opt in self.optimizers:
                opt.step()
        with torch.no_grad():
            self._params_from_masters()
        self._reduced = False
        return None

    def _params_from_masters(self) -> None:
        """Cast the owned master rows to the compute dtype and all-gather every bucket."""
        for b in self.buckets:
            gathered = torch.empty(b.W * b.S, dtype=b.param_dtype, device=b.device)
            send = b.own_region(gathered)
            if b.master_flat is not None and b.master_flat.device != send.device:
                staged = torch.empty(b.S, dtype=b.master_flat.dtype, device=b.device)
                staged.copy_(b.master_flat, non_blocking=True)  # same dtype: a plain DMA from pinned memory
                send.copy_(staged)  # the cast runs on the device, not on the host
                del staged
            elif b.master_flat is not None:
                send.copy_(b.master_flat)
            else:
                for s in b.slots:
                    if s.rows:
                        b.own(send, s).copy_(s.master)
            if b.W > 1:
                dist.all_gather_single(gathered, send, group=b.group)
            for s in b.slots:
                b.gather_rows(gathered, s, local(s.param).detach().view(s.d0, s.row))
            del gathered

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._engine_on:
            return super().zero_grad(set_to_none=set_to_none)
        for b in self.buckets:
            b.main_grad.zero_()
            for s in b.slots:
                s.param.grad = None
        self._reduced = False

    # memory ------------------------------------------------------------------------------
    def static_tensors(self) -> dict[str, list]:
        """Tensors this backend keeps between steps, by role (for components.state.memory)."""
        if not self._engine_on:
            return {}
        out = {"grads": [b.main_grad for b in self.buckets], "optimizer": [], "host": []}
        states = [t for opt in self.optimizers for st in opt.state.values() for t in st.values()
                  if hasattr(t, "untyped_storage")]
        masters = [b.master_flat for b in self.buckets if b.master_flat is not None]
        if self.offload:
            out["host"] = states + masters + [b.host_grad for b in self.buckets]
        else:
            out["optimizer"] = states + masters
        return out

    # checkpoints -------------------------------------------------------------------------
    def _init_state(self) -> None:
        materialize_state(self.optimizers)

    def state_dict(self):
        if not self._engine_on:
            return super().state_dict()
        self._init_state()
        out = {}
        for opt in self.optimizers:
            for g in opt.param_groups:
                for p, fqn in zip(g["params"], g["param_names"]):
                    _, s = self._slot_by_fqn[fqn]
                    for k, v in opt.state[p].items():
                        if hasattr(v, "dim") and v.dim() > 0:
                            v = _checkpointable(v, s.global_shape, chunk_offset(s))
                        out[f"state.{fqn}.{k}"] = v
                    for k, v in g.items():
                        if k not in ("params", "param_names"):
                            out[f"param_groups.{fqn}.{k}"] = v
        return out

    def load_state_dict(self, state_dict) -> None:
        if not self._engine_on:
            return super().load_state_dict(state_dict)
        self._init_state()
        for opt in self.optimizers:
            for g in opt.param_groups:
                for p, fqn in zip(g["params"], g["param_names"]):
                    for k, v in opt.state[p].items():
                        key = f"state.{fqn}.{k}"
                        if key not in state_dict:
                            raise KeyError(f"optimizer state {key} missing from the checkpoint")
                        src = state_dict[key]
                        if src is not v:
                            v.copy_(src.to_local() if hasattr(src, "to_local") else src)
                if g["param_names"]:
                    fqn0 = g["param_names"][0]
                    for k in list(g):
                        if k in ("params", "param_names"):
                            continue
                        key = f"param_groups.{fqn0}.{k}"
                        if key not in state_dict:
                            raise KeyError(f"optimizer param group key {key} missing from the checkpoint")
                        g[k] = state_dict[key]

    def _save_masters(self, slots, state_dict, prefix) -> None:
        for s in slots:
            key = prefix + s.pname
            if key in state_dict:
                state_dict[key] = s.master_dt

    def _load_masters(self, slots, state_dict, prefix) -> None:
        for s in slots:
            key = prefix + s.pname
            if key not in state_dict:
                continue
            src = state_dict.pop(key)
            if isinstance(src, DTensor):
                if src.to_local().numel() and src.to_local().data_ptr() == s.master.data_ptr():
                    continue  # DCP loaded straight into this rank's master rows
                src = src.full_tensor()
            if tuple(src.shape) != tuple(s.global_shape):
                raise ValueError(f"cannot load {s.fqn}: global shape {tuple(src.shape)}, expected {s.global_shape}")
            box = tuple(slice(o, o + n) for o, n in zip(chunk_offset(s), s.master.shape))
            with torch.no_grad():
                s.master.copy_(src[box])

    def _after_model_load(self, incompatible_keys) -> None:
        mine = {s.fqn for b in self.buckets for s in b.slots}
        for key in list(incompatible_keys.missing_keys):
            if canonical_fqn(key) in mine:
                incompatible_keys.missing_keys.remove(key)
        with torch.no_grad():
            self._params_from_masters()
