"""LoRA modules on torchtitan's model configs: linears (plain and fused QKV) and routed experts.

``convert(model_config, spec)`` swaps every targeted ``Linear.Config`` (and, with the ``experts``
target, every ``GroupedExperts.Config``) for a LoRA subclass of its own class, and every other
module config for a frozen one (torchtitan's ``_make_frozen_config``): the base is built exactly
as without adapters, with ``requires_grad=False`` on every base parameter, so the optimizer (which
takes only parameters that require gradients) holds the adapters alone and the backward computes
no weight gradient for the base.

A LoRA module keeps its base parameters under their names (``wq.weight``, ``w1_EFD``) and adds
its adapters beside them as parameters named ``lora_A*`` / ``lora_B*`` (``targets.is_adapter_param``):

- a linear ``y = x W^T`` gets ``y + s * (drop(x) A^T) B^T`` with ``A [r, in]``, ``B [out, r]``,
  ``s = alpha / r`` (PEFT's LoRA);
- a fused ``wqkv`` (torchtitan's FusedQKVLinear) gets one pair per targeted part (``lora_A_q``,
  ``lora_B_q`` ...; ``B_q``'s rows in the order of the stock ``wq`` its state dict is saved as), so
  ``q``, ``k`` and ``v`` are targets of their own as in the unfused model;
- routed experts get one pair per expert and weight: ``lora_A_w1 [E, r, dim]``, ``lora_B_w1 [E,
  hidden, r]`` (w3 alike), ``lora_A_w2 [E, r, hidden]``, ``lora_B_w2 [E, dim, r]``, computed with
  the same grouped GEMMs (and dtype) as the base experts; under expert parallelism they are sharded
  over the experts like the base weights.

Initialisation (PEFT's): ``B = 0``; ``A`` kaiming-uniform (bound ``1/sqrt(in)``, PEFT's
``init_lora_weights=True``) or gaussian (std ``1/r``, PEFT's ``"gaussian"``). The values come from
a generator seeded by ``training.seed`` and the parameter's name, whole tensors sliced to each
rank's shard: the same adapters on any number of ranks, and the global random stream (which
initialises a seeded base) untouched, so a LoRA run's base equals ``adapter=none``'s.

``adapters_disabled(model)`` switches every adapter off for the forwards inside it (the frozen
base's logits, exactly); ``merge_into(state_dict, spec)`` folds the adapters into the base weights.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.lora import _make_frozen_config
from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.module import Module

from components.adapters.targets import is_adapter_param, linear_target
from components.precision.fp8_targets import swap_config  # the config swap fp8 uses too
from framework import compat

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LoRASpec:
    """One adapted module's settings (the recipe's ``adapter.*`` and the module's own seed)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    init: str = "kaiming"
    dtype: str = "fp32"
    seed: int = 0
    parts: tuple = ("",)  # fused wqkv: the targeted parts among ("q", "k", "v"); else ("",)
    layout: tuple = ()  # fused wqkv: (n_kv_heads, heads per kv head, head_dim)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# ---------------------------------------------------------------------------- shared behaviour


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _init_full(shape, spec: LoRASpec, name: str) -> torch.Tensor:
    """The whole tensor of adapter ``name``: zeros for B, PEFT's init for A, from a generator of its own."""
    if name.startswith("lora_B"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((spec.seed + zlib.crc32(name.encode())) % (2 ** 63))
    if spec.init == "gaussian":
        return torch.randn(shape, generator=g) / spec.rank
    bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]: gain sqrt(1/3) x sqrt(3/in)
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


@torch.no_grad()
def _fill(param, full: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter: plain, or this rank's shard of a DTensor."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


class _Adapted:
    """Members every LoRA module shares (mixed in before the base module's class)."""

    lora_enabled: bool = True

    def _add_adapter(self, name: str, shape: tuple, spec: LoRASpec) -> None:
        p = torch.nn.Parameter(torch.empty(shape, dtype=DTYPES[spec.dtype], device=self._base_device()))
        self.register_parameter(name, p)

    def _base_device(self):
        return next(iter(self._parameters.values())).device

    def _freeze_base(self) -> None:
        for name, p in self.named_parameters(recurse=False):
            p.requires_grad_(False)

    def adapter_names(self) -> list[str]:
        return [n for n in self._parameters if is_adapter_param(n)]

    def _init_self_parameters(self) -> None:
        """The base's own initialisation, then the adapters' (which draws nothing from the global stream)."""
        adapters = {n: self._parameters.pop(n) for n in self.adapter_names()}
        try:
            super()._init_self_parameters()
        finally:
            self._parameters.update(adapters)
        for name, p in adapters.items():
            _fill(p, _init_full(tuple(p.shape), self._lora_spec, name))


def _with_adapter_shardings(instance, base_param: str) -> None:
    """The adapters take the base weight's placement (expert parallelism shards them over the experts)."""
    compat.add_state_shardings(instance, instance.adapter_names(), base_param)


# ---------------------------------------------------------------------------- linears

_LINEAR_CLASSES: dict[type, type] = {}


def lora_linear_class(parent: type) -> type:
    """A LoRA subclass of torchtitan linear class ``parent`` (Linear or a subclass), made once."""
    if parent in _LINEAR_CLASSES:
        return _LINEAR_CLASSES[parent]

    class LoRALinear(_Adapted, parent):
        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):
            lora: LoRASpec

            def build(self, **kwargs):
                instance = parent.Config.build(self, **kwargs)
                _with_adapter_shardings(instance, "weight")
                return instance

        def __init__(self, config):
            super().__init__(config)
            spec = self._lora_spec = config.lora
            self._freeze_base()
            if spec.layout:  # fused wqkv: one pair per targeted part
                n_kv, hpk, hd = spec.layout
                rows = {"q": n_kv * hpk * hd, "k": n_kv * hd, "v": n_kv * hd}
                for part in spec.parts:
                    self._add_adapter(f"lora_A_{part}", (spec.rank, config.in_features), spec)
                    self._add_adapter(f"lora_B_{part}", (rows[part], spec.rank), spec)
            else:
                self._add_adapter("lora_A", (spec.rank, config.in_features), spec)
                self._add_adapter("lora_B", (config.out_features, spec.rank), spec)

        def forward(self, x):
            out = super().forward(x)
            if not self.lora_enabled:
                return out
            spec = self._lora_spec
            a_dtype = self._parameters[self.adapter_names()[0]].dtype
            h = F.dropout(x, spec.dropout, self.training) if spec.dropout else x
            h = h.to(a_dtype)
            if not spec.layout:
                delta = F.linear(F.linear(h, _local(self.lora_A)), _local(self.lora_B))
                return out + (delta * spec.scale).to(out.dtype)
            n_kv, hpk, hd = spec.layout
            lead = x.shape[:-1]
            pieces = []
            for part, heads in (("q", hpk), ("k", 1), ("v", 1)):
                if part in spec.parts:
                    d = F.linear(F.linear(h, _local(self._parameters[f"lora_A_{part}"])),
                                 _local(self._parameters[f"lora_B_{part}"]))
                    pieces.append(d.view(*lead, n_kv, heads, hd))
                else:
                    pieces.append(h.new_zeros(*lead, n_kv, heads, hd))
            delta = torch.cat(pieces, dim=-2).reshape(*lead, -1)
            return out + (delta * spec.scale).to(out.dtype)

    LoRALinear.__name__ = LoRALinear.__qualname__ = f"LoRA{parent.__name__}"
    LoRALinear.Config.__qualname__ = f"LoRA{parent.__name__}.Config"
    _LINEAR_CLASSES[parent] = LoRALinear
    return LoRALinear


class SplitQKVLinear(QKVLinear):
    """torchtitan's QKVLinear with its own configs for wk and wv (QKVLinear builds both from one
    ``wkv`` config), so that k and v are separate targets; the same modules and names."""

    @dataclass(kw_only=True, slots=True)
    class Config(QKVLinear.Config):
        wk: Linear.Config
        wv: Linear.Config

    def __init__(self, config):
        Module.__init__(self)
        self.head_dim = config.head_dim
        for c in (config.wk, config.wv):  # the sharding torchtitan declared on wkv (update_from_config)
            if c.sharding_config is None and config.wkv.sharding_config is not None:
                c.sharding_config = config.wkv.sharding_config
        self.wq = config.wq.build()
        self.wk = config.wk.build()
        self.wv = config.wv.build()


# ---------------------------------------------------------------------------- routed experts

_EXPERT_CLASSES: dict[type, type] = {}
_EXPERT_WEIGHTS = (("w1", "w1_EFD"), ("w3", "w3_EFD"), ("w2", "w2_EDF"))


def _grouped(a, b_t, offs, counts, grouped_mm):
    """``a @ b_t`` per expert group (rows split by ``counts``): the grouped GEMM, or a loop over the
    experts where it cannot run: a row of either operand not a multiple of 16 bytes (its backward
    refuses such strides, e.g. a rank-4 adapter in bf16), or no grouped GEMM for the dtype here (as
    components.models.common.ExactGroupedExperts falls back)."""
    if (a.shape[-1] * a.element_size()) % 16 == 0 and (b_t.shape[-1] * b_t.element_size()) % 16 == 0:
        try:
            return grouped_mm(A=a, B_t=b_t, offs=offs)
        except (RuntimeError, NotImplementedError):
            pass
    outs = [xe @ b_t[e] for e, xe in enumerate(a.split(counts.tolist()))]
    return torch.cat(outs) if outs else a.new_zeros(0, b_t.shape[-1])


def lora_experts_class(parent: type) -> type:
    """A LoRA subclass of routed-experts class ``parent`` (GroupedExperts or a subclass)."""
    if parent in _EXPERT_CLASSES:
        return _EXPERT_CLASSES[parent]

    class LoRAExperts(_Adapted, parent):
        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):
            lora: LoRASpec

            def build(self, **kwargs):
                instance = parent.Config.build(self, **kwargs)
                _with_adapter_shardings(instance, "w1_EFD")
                return instance

        def __init__(self, config):
            super().__init__(config)
            spec = self._lora_spec = config.lora
            self._freeze_base()
            E, D, Fh, r = config.num_experts, config.dim, config.hidden_dim, spec.rank
            shapes = {"w1": ((E, r, D), (E, Fh, r)), "w3": ((E, r, D), (E, Fh, r)), "w2": ((E, r, Fh), (E, D, r))}
            for w, (a, b) in shapes.items():
                self._add_adapter(f"lora_A_{w}", a, spec)
                self._add_adapter(f"lora_B_{w}", b, spec)

        def _exact(self, x) -> bool:
            """The parent computes in the activations' dtype (ExactGroupedExperts with non-bf16 input)."""
            return x.dtype != torch.bfloat16 and parent.forward is not GroupedExperts.forward

        def forward(self, x_RD, num_tokens_per_expert_E):
            if not self.lora_enabled:
                return super().forward(x_RD, num_tokens_per_expert_E)
            spec = self._lora_spec
            dt = x_RD.dtype if self._exact(x_RD) else torch.bfloat16
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            counts = num_tokens_per_expert_E
            mm = torch._grouped_mm if self._exact(x_RD) else self._grouped_mm

            def gmm(a, w):  # a [R, in] x per-expert w [E, out, in] -> [R, out]
                return _grouped(a, w.transpose(-2, -1), offs, counts,
                                (lambda A, B_t, offs: mm(A, B_t, offs=offs)) if mm is torch._grouped_mm else mm)

            def delta(h, w):  # s * (drop(h) A_e^T) B_e^T per expert
                a, b = (_local(self._parameters[f"lora_{k}_{w}"]).to(dt) for k in ("A", "B"))
                hd = F.dropout(h, spec.dropout, self.training) if spec.dropout else h
                return gmm(gmm(hd, a), b) * spec.scale

            w1, w2, w3 = (_local(getattr(self, n)).to(dt) for n in ("w1_EFD", "w2_EDF", "w3_EFD"))
            x = x_RD.to(dt)
            h = F.silu(gmm(x, w1) + delta(x, "w1")) * (gmm(x, w3) + delta(x, "w3"))
            return (gmm(h, w2) + delta(h, "w2")).type_as(x_RD)

    LoRAExperts.__name__ = LoRAExperts.__qualname__ = f"LoRA{parent.__name__}"
    LoRAExperts.Config.__qualname__ = f"LoRA{parent.__name__}.Config"
    _EXPERT_CLASSES[parent] = LoRAExperts
    return LoRAExperts


# ---------------------------------------------------------------------------- the conversion


def _fields(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _spec(base: LoRASpec, fqn: str, **changes) -> LoRASpec:
    return dataclasses.replace(base, seed=(base.seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2 ** 62), **changes)


def convert(model_config, spec: LoRASpec, targets) -> tuple:
    """The model config with LoRA on ``targets`` and every other module frozen; returns
    (config, {target: number of adapted modules})."""
    compat.keep_frozen_through_distribute()  # torchtitan's parallelize would make the frozen base trainable
    targets = set(targets)
    found: dict[str, int] = {}
    # QKVLinear builds wk and wv from one config: give each its own (the same modules and names)
    for fqn, cfg, parent, attr in list(model_config.traverse(QKVLinear.Config)):
        if type(cfg) is QKVLinear.Config:
            new = SplitQKVLinear.Config(head_dim=cfg.head_dim, wq=cfg.wq, wkv=cfg.wkv,
                                        wk=dataclasses.replace(cfg.wkv), wv=dataclasses.replace(cfg.wkv))
            model_config = swap_config(model_config, parent, attr, new)
    fused = {fqn: cfg for fqn, cfg, _, _ in model_config.traverse(FusedQKVLinear.Config)}
    adapted = set()
    for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
        target = linear_target(fqn)
        if target == "kv":  # SplitQKVLinear keeps the original wkv config as an unused field
            continue
        if target == "fused_qkv":
            parts = tuple(p for p in ("q", "k", "v") if p in targets)
            if not parts:
                continue
            owner = fused[fqn.rsplit(".", 1)[0] if "." in fqn else ""]
            layout = (owner.n_kv_heads, owner.n_heads // owner.n_kv_heads, owner.head_dim)
            mod_spec = _spec(spec, fqn, parts=parts, layout=layout)
            for p in parts:
                found[p] = found.get(p, 0) + 1
        elif target in targets:
            mod_spec = _spec(spec, fqn)
            found[target] = found.get(target, 0) + 1
        else:
            continue
        cls = lora_linear_class(cfg._owner)
        model_config = swap_config(model_config, parent, attr, cls.Config(**_fields(cfg), lora=mod_spec))
        adapted.add(fqn)
    if "experts" in targets:
        for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            cls = lora_experts_class(cfg._owner)
            model_config = swap_config(model_config, parent, attr, cls.Config(**_fields(cfg), lora=_spec(spec, fqn)))
            found["experts"] = found.get("experts", 0) + 1
            adapted.add(fqn)
    return _freeze_others(model_config, adapted), found


def _freeze_others(model_config, adapted: set):
    """Every module config that is not an adapter's becomes torchtitan's frozen config (its own
    parameters built with requires_grad=False)."""
    root = model_config
    configs = list(model_config.traverse(Module.Config, recurse=True))
    for fqn, cfg, parent, attr in reversed(configs):
        if fqn in adapted or getattr(cfg, "lora", None) is not None:
            continue
        root = swap_config(root, parent, attr, _make_frozen_config(cfg))
    return root
