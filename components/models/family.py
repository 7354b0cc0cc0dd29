"""What every model family shares without torch: the recipe's ``model:`` options, the facts the
planner and the checks read, and the contract functions a family module exposes.

A family module (the registry's target, e.g. components/models/qwen3.py) imports only this and its
architecture table, so the print-only commands (``train --cfg job``, ``apiary plan``, ``apiary
show``) size a model without importing torch or torchtitan; building the model (``model_spec``)
imports the family's torchtitan side on first use (tests/test_startup.py checks both)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from components.models import layer_kinds
from framework import contracts
from framework.errors import UserError


@dataclass(kw_only=True)
class ModelOptions:
    """The value checks of the recipe's ``model:`` section. Its keys, their types, defaults and docs
    are framework/compose/schema.py's ModelConfig, their one definition: ``contracts.make_options`` builds
    this class over it (family, flavor, n_layers, vocab_size, attn_backend, flex_autotune,
    hf_checkpoint)."""

    def __post_init__(self):
        if self.n_layers is not None and self.n_layers < 1:
            raise ValueError(f"model.n_layers must be >= 1, got {self.n_layers}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"model.attn_backend={self.attn_backend} is not an attention backend this family "
                             f"builds; valid: {', '.join(f'{b} ({why})' for b, why in ATTN_BACKENDS.items())}")


# The attention backends every family builds its attention layers with (torchtitan's
# get_attention_config; its `sdpa` takes no per-document positions and is refused for language models)
ATTN_BACKENDS = {"flex": "FlexAttention, the default", "flex_flash": "FlexAttention's flash kernel, Hopper or "
                 "Blackwell GPUs", "varlen": "variable-length attention, CUDA"}


def model_kwargs(options, ctx) -> dict:
    """The family's ``model_config`` / ``facts`` arguments this recipe asks for."""
    kw = dict(attn_backend=options.attn_backend, moe_comm_backend=ctx.components["moe_comm"].torchtitan_backend,
              n_layers=options.n_layers, vocab_size=options.vocab_size,
              load_balance_coeff=ctx.cfg.moe.load_balance_coeff)
    if options.hf_checkpoint:
        kw["hf_checkpoint"] = options.hf_checkpoint
    return kw


def check_model(options, ctx) -> None:
    """What every family refuses before launch: a sequence longer than the model's RoPE length (with
    RoPE scaling, the scaled length). A property of the config, so print-only commands (--cfg job,
    plan, show) refuse it too: what they accept, a launch accepts. Before a launch, an HF folder's
    tensors are checked against its config.json too (``_check_hf_weights``); the print-only
    commands read config.json and the safetensors headers only (the facts), without torch."""
    if getattr(ctx, "for_training", False) and options.attn_backend != "flex":
        _check_attn_device(options.attn_backend, ctx)
    if getattr(ctx, "for_training", False) and options.hf_checkpoint:
        _check_hf_weights(options, ctx)
    if ctx.facts is None:
        return
    limit = getattr(ctx.facts, "max_seq_len", 0)
    seq = ctx.cfg.training.seq_len
    if limit and seq > limit:
        src = (f"max_position_embeddings of {options.hf_checkpoint}" if options.hf_checkpoint
               else f"model.flavor={options.flavor}")
        family = ctx.components.get("model") if getattr(ctx, "components", None) else None
        longer = [f for f, n in (contracts.member(family, "model", "LONG_CONTEXT_FLAVORS") if family is not None
                                 else {}).items()
                  if f.startswith(f"{options.flavor}-") and n >= seq] if not options.hf_checkpoint else []
        fix = f"Use training.seq_len <= {limit}"
        if longer:
            fix += (f", or model.flavor={longer[0]} (RoPE scaling to {family.LONG_CONTEXT_FLAVORS[longer[0]]}; "
                    "docs/skills/models.md).")
        elif options.hf_checkpoint:
            fix += (", or a folder whose config.json scales its RoPE (qwen3: rope_type yarn, llama3: llama3; "
                    "docs/skills/models.md).")
        else:
            fix += "."
        raise UserError(f"training.seq_len={seq}", f"exceeds the model's RoPE length {limit} ({src}).", fix)


def _check_hf_weights(options, ctx) -> None:
    """An HF folder's tensors (names, shapes, floating point; headers only, components/models/hf.py
    ``check_weights``) against the architecture its config.json describes: the family's
    ``model_config`` builds that config and checks them, a user error naming the folder, before any
    worker starts (torch: a launch imports it anyway)."""
    build = contracts.member(ctx.components["model"], "model", "model_config") \
        if getattr(ctx, "components", None) and "model" in ctx.components else None
    if build is not None:
        build(options.flavor, **model_kwargs(options, ctx))


def _check_attn_device(backend: str, ctx) -> None:
    """flex_flash and varlen run on CUDA GPUs only (flex_flash: compute capability >= 9.0); checked here
    before a local launch (a scheduler's nodes are checked by torchtitan there)."""
    launcher = getattr(getattr(ctx.cfg, "launcher", None), "name", "local")
    if launcher != "local":
        return
    import torch  # reason: start-up time (torch; only for a non-default attention backend)

    need = (9, 0) if backend == "flex_flash" else (0, 0)
    cc = tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    if cc is None or cc < need:
        here = "this machine has no CUDA GPU" if cc is None else f"this GPU is compute capability {cc[0]}.{cc[1]}"
        needs = "a Hopper or Blackwell GPU (compute capability >= 9.0)" if need > (0, 0) else "a CUDA GPU"
        raise UserError(f"model.attn_backend={backend}", f"needs {needs}, and {here}.",
                        "Use model.attn_backend=flex (the default; on a CPU apiary runs it as dense-mask attention).")


def apply_model(family, options, tc, ctx) -> None:
    """Put a fresh model spec of ``family`` (a family module) on the trainer config."""
    from framework import devices  # reason: torch, kept off the print-only commands' start-up

    devices.set_flex_autotune(bool(options.flex_autotune))
    tc.model_spec = family.model_spec(options.flavor, **model_kwargs(options, ctx))


@dataclass(frozen=True)
class ModelFacts:
    """What the framework needs to know about an architecture, without building it."""

    family: str
    flavor: str
    n_layers: int
    dim: int
    vocab_size: int
    n_params: int  # total parameters
    n_active_params: int  # parameters touched per token (top-k experts + dense parts)
    n_expert_params: int  # routed-expert parameters (sharded over EP)
    num_experts: int  # 0 for dense models
    top_k: int
    moe_hidden_dim: int
    ffn_hidden_dim: int  # dense MLP hidden size (0 when every layer is MoE)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_attention_layers: int  # full softmax-attention layers
    n_linear_attention_layers: int = 0  # GatedDeltaNet-style layers
    linear_attn: dict | None = None  # per-family shapes of the linear-attention layers
    shared_expert_hidden_dim: int = 0
    source: str = ""  # where the architecture came from when not the flavor (an HF folder)
    max_seq_len: int = 0  # RoPE length of the attention layers (0: unknown / no limit)
    layer_mixers: tuple = ()  # each layer's mixer kind ("attention" | "linear_attention"); (): all attention
    # what the planner counts per kind of layer (framework/contracts/plan.py LayerKind); (): the standard
    # kinds of these fields (components/models/layer_kinds.py standard_kinds)
    layer_kinds: tuple = ()

    def __post_init__(self):
        if not self.layer_kinds:
            object.__setattr__(self, "layer_kinds", layer_kinds.standard_kinds(self))



def params_per_layer(*, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool,
                     ffn_hidden_dim: int = 0, num_experts: int = 0, moe_hidden_dim: int = 0,
                     shared_expert_hidden_dim: int = 0, shared_gate: bool = False) -> tuple[int, int]:
    """(all, routed-expert) parameters of one pre-norm attention + SwiGLU/MoE block: q, k, v, o
    projections (+ q/k norms), two norms, and the dense MLP or router + experts (+ shared expert)."""
    attn = dim * (n_heads + 2 * n_kv_heads) * head_dim + n_heads * head_dim * dim + (2 * head_dim if qk_norm else 0)
    experts = num_experts * 3 * dim * moe_hidden_dim
    if num_experts:
        ffn = experts + dim * num_experts + 3 * dim * shared_expert_hidden_dim + (dim if shared_gate else 0)
    else:
        ffn = 3 * dim * ffn_hidden_dim
    return attn + ffn + 2 * dim, experts


def facts_from_counts(*, family: str, flavor: str, n_layers: int, dim: int, vocab_size: int, tie_embeddings: bool,
                      layer: tuple[int, int], num_experts: int = 0, top_k: int = 0, **fields) -> ModelFacts:
    """ModelFacts of a stack of ``n_layers`` identical blocks of ``layer`` = (all, routed-expert)
    parameters, with embedding, final norm and LM head."""
    per, per_expert = layer
    total = vocab_size * dim * (1 if tie_embeddings else 2) + dim + n_layers * per
    expert = n_layers * per_expert
    active = total - expert + (expert * top_k // num_experts if num_experts else 0)
    return ModelFacts(family=family, flavor=flavor, n_layers=n_layers, dim=dim, vocab_size=vocab_size,
                      n_params=total, n_active_params=active, n_expert_params=expert, num_experts=num_experts,
                      top_k=top_k, **fields)


def family_contract(module_name: str):
    """``(model_kwargs, check, apply)`` of a family module that needs nothing of its own beyond
    :func:`check_model` (framework/contracts/protocols.py, kind ``model``)."""
    def apply(options, tc, ctx) -> None:
        apply_model(sys.modules[module_name], options, tc, ctx)

    return model_kwargs, check_model, apply


def build_side(module: str, contract: str, names: tuple[str, ...]):
    """``(_build, __getattr__)`` for a family's contract module ``contract``: ``_build()`` imports its
    torchtitan side ``module`` (on first use), and ``__getattr__`` (PEP 562) hands out ``names`` of it
    from the contract module; any other missing name is an AttributeError at once."""
    def build():
        return importlib.import_module(module)

    def getattr_(name: str):
        if name in names:
            return getattr(build(), name)
        raise AttributeError(f"module {contract!r} has no attribute {name!r}")

    return build, getattr_
