"""Adapters (registry kind ``adapter``): ``none`` (the baseline: every parameter trains) and
``lora`` (low-rank adapters on a frozen base; docs/skills/lora.md).

``adapter=lora`` converts the model config (``components.adapters.modules.convert``) before the
model is built, so every model family built on torchtitan's modules takes it: the targeted linears
(``adapter.targets``, ``components.adapters.targets.TARGETS``) and, with ``experts``, the routed
experts (one A/B pair per expert) get adapters; every base parameter is frozen, so FSDP2 shards it
without gradients and the optimizer holds the adapters alone. Checkpoints hold the adapters and
their optimizer state only, with a pointer to the base (``components.adapters.base``).

Pre-launch refusals (ValueError -> exit 2 naming the key): rank < 1, rank above the narrowest
targeted layer, an unknown target (with did-you-mean), a target the model has not, LoRA with a
combination nothing here runs (fp8, tensor/pipeline parallelism, zero1, moe.chunk with adapted
experts, publication without an HF base or in memory, a seed checkpoint, ``lm_head`` with a loss that reads its weight directly),
and ``adapter.*`` settings under ``adapter=none`` (they would be ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from components.adapters.targets import DEFAULT_TARGETS, TARGETS
from framework.contracts import PlanFacts, PlanTerms, Term, check_choices
from framework.errors import UserError, did_you_mean

# losses that call the lm_head module (the others read lm_head.weight in their own fused GEMMs)
LM_HEAD_MODULE_LOSSES = ("ce", "ce_zloss", "chunked")
# the largest alpha / rank accepted: the adapters' update is scaled by it (PEFT's usual 0.5 to 16)
MAX_SCALE = 1e4


class NoAdapter:
    """The baseline: no adapter, every parameter trains. Its options mirror ``lora``'s only to
    refuse them: an ``adapter.*`` setting under ``adapter=none`` would be ignored."""

    SKILL = "lora"

    @dataclass(kw_only=True)
    class Options:
        name: str = "none"
        """registry name (adapter=none: full training)"""
        rank: Optional[int] = None
        """(adapter=lora only; refused here)"""
        alpha: Optional[float] = None
        """(adapter=lora only; refused here)"""
        dropout: Optional[float] = None
        """(adapter=lora only; refused here)"""
        targets: Optional[list[str]] = None
        """(adapter=lora only; refused here)"""
        init: Optional[str] = None
        """(adapter=lora only; refused here)"""
        dtype: Optional[str] = None
        """(adapter=lora only; refused here)"""

    @staticmethod
    def check(options, ctx) -> None:
        set_ = [f.name for f in dataclasses.fields(options) if f.name != "name" and getattr(options, f.name) is not None]
        if set_:
            shown = ", ".join(f"adapter.{k}={getattr(options, k)}" for k in set_)
            raise ValueError(f"{shown} configures LoRA adapters, and adapter=none trains the whole model without any, "
                             f"so {'it' if len(set_) == 1 else 'they'} would be ignored. Add adapter=lora, or drop "
                             f"{'it' if len(set_) == 1 else 'them'}")

    @staticmethod
    def apply(options, tc, ctx) -> None:
        return None

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Nothing frozen: the state backend's terms stand."""
        return PlanTerms(facts=PlanFacts(summary="every parameter trains"))

    # apiary compare: switching the adapter trains other parameters (another run)
    NUMERICS = {"": "any"}


class LoRA:
    """Low-rank adapters on a frozen base (PEFT's LoRA; one pair per routed expert)."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "lora"
        """registry name (adapter=lora)"""
        rank: int = 16
        """r: the adapters' rank (A is [r, in], B is [out, r]); at most the narrowest targeted layer's width"""
        alpha: float = 32.0
        """scale numerator: the update is alpha / rank x B A (PEFT's lora_alpha)"""
        dropout: float = 0.0
        """dropout on the adapters' input during training (PEFT's lora_dropout)"""
        targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
        """linear kinds to adapt: q k v o (attention), in_proj_q/k/v/z/a/b out_proj (GatedDeltaNet), mlp,
        shared_expert, experts, lm_head"""
        init: Literal["kaiming", "gaussian"] = "kaiming"
        """A's initialisation (B starts at zero): kaiming-uniform or gaussian std 1/rank (PEFT's)"""
        dtype: Literal["fp32", "bf16"] = "fp32"
        """the adapters' stored (master) dtype"""

        def __post_init__(self):
            check_choices(self, "adapter.", " for lora")
            if self.rank < 1:
                raise ValueError(f"adapter.rank must be >= 1 (the adapters' rank), got {self.rank}")
            if not self.alpha > 0:
                raise ValueError(f"adapter.alpha must be > 0 (the update is alpha / rank x B A), got {self.alpha}")
            if not self.alpha / self.rank <= MAX_SCALE:
                raise ValueError(f"adapter.alpha={self.alpha:g} with adapter.rank={self.rank} scales the adapters' "
                                 f"update by {self.alpha / self.rank:g}; at most {MAX_SCALE:g} is accepted (PEFT's "
                                 "usual scales are 0.5 to 16; the scale multiplies each step's change of the "
                                 "outputs, and alpha=1e30 made step 1's loss non-finite: exit 76). Lower "
                                 "adapter.alpha")
            if not 0 <= self.dropout < 1:
                raise ValueError(f"adapter.dropout must be in [0, 1), got {self.dropout}")
            if not self.targets:
                raise ValueError("adapter.targets is empty: nothing would train. Name some of "
                                 + ", ".join(TARGETS))
            unknown = [t for t in self.targets if t not in TARGETS]
            if unknown:
                hint = did_you_mean(str(unknown[0]), TARGETS)
                raise ValueError(f"adapter.targets has unknown {', '.join(map(repr, unknown))}; the targets are "
                                 f"{', '.join(TARGETS)}" + (f". {hint.rstrip('?')}" if hint else ""))
            if len(set(self.targets)) != len(self.targets):
                raise ValueError(f"adapter.targets names a target twice: {self.targets}")

    SKILL = "lora"

    @staticmethod
    def check(options: "LoRA.Options", ctx) -> None:
        cfg = ctx.cfg
        # checkpoint.load_path is the frozen base, loaded here at every launch (checkpointing on or off,
        # resumed or not): the framework's checks of what it loads leave it to the adapter
        ctx.shared.load_path_reader = "adapter=lora (the frozen base, loaded at every launch)"
        config = _model_config(ctx)
        widths = None
        if config is not None:
            from components.adapters.inspect import target_widths  # reason: start-up time (torchtitan)

            widths = target_widths(config)
        if "lm_head" in options.targets and getattr(config, "enable_weight_tying", False):
            raise ValueError(f"adapter.targets=lm_head on a model whose lm_head is tied to the token embeddings "
                             f"(model.family={cfg.model.family} model.flavor={cfg.model.flavor}"
                             + (f", model.hf_checkpoint={cfg.model.hf_checkpoint}: tie_word_embeddings"
                                if cfg.model.get("hf_checkpoint") else "") + "): HF's format holds one matrix for "
                             "both, so the head's adapter has no place in the export or a published version, and "
                             "folding it in (apiary export --merged, peft's merge) would change the embeddings too. "
                             "Drop lm_head from adapter.targets, or adapt a base with an untied head")
        if widths is not None:
            missing = [t for t in options.targets if t not in widths]
            if missing:
                have = [t for t in TARGETS if t in widths]
                raise ValueError(f"adapter.targets has {', '.join(missing)}, which model.family={cfg.model.family} "
                                 f"model.flavor={cfg.model.flavor} does not have; its linear kinds are "
                                 f"{', '.join(have)}")
            narrow = min(options.targets, key=lambda t: widths[t][0])
            width, where = widths[narrow]
            if options.rank > width:
                raise ValueError(f"adapter.rank={options.rank} is above the width of the narrowest targeted layer: "
                                 f"{narrow} ({where}) has min(in, out) = {width}, so a rank-{options.rank} update "
                                 f"has no more freedom than rank {width}. Use adapter.rank <= {width}, or drop "
                                 f"{narrow} from adapter.targets")
        _check_combinations(options, ctx)
        if ctx.for_training:
            from components.adapters import base  # reason: hashes the base's files (launches only)

            now = base.for_launch(cfg)
            if now is None:  # another rank of a torchrun without apiary's launcher: rank 0 checks and writes
                return
            if cfg.checkpoint.resume:
                base.check_resume(cfg, now)
            ctx.shared.adapter_base = now
            ctx.summary.append(f"adapter: LoRA rank {options.rank} alpha {options.alpha:g} on "
                               f"{', '.join(options.targets)}{_trainable(options, ctx)}; frozen base: "
                               f"{base.describe(now)}")
            if _bias_frozen(ctx):
                ctx.summary.append(f"adapter: the MoE routing bias is frozen with the base (moe.load_balance_coeff="
                                   f"{cfg.moe.load_balance_coeff} not applied: an adapter checkpoint, a resume and "
                                   "an export carry the adapters only)")

    @staticmethod
    def apply(options: "LoRA.Options", tc, ctx) -> None:
        from components.adapters import modules  # reason: start-up time (torch, torchtitan)
        from components.adapters.checkpoint import AdapterCheckpointManager, remember_base  # reason: as above

        cfg = ctx.cfg
        spec = modules.LoRASpec(rank=options.rank, alpha=float(options.alpha), dropout=float(options.dropout),
                                init=options.init, dtype=options.dtype, seed=int(cfg.training.seed))
        tc.model_spec.model, _ = modules.convert(tc.model_spec.model, spec, options.targets)
        if _bias_frozen(ctx):  # the routing bias is the base's: no load-balancing updates (said at check)
            from components.models.common import set_load_balance  # reason: start-up time (torchtitan)

            set_load_balance(tc.model_spec.model, None)
        # the base from a DCP step is loaded by the adapter at every launch (torchtitan's initial load
        # would look for the adapters in it), then the base's checksum is taken
        load_path = tc.checkpoint.initial_load_path
        ck = tc.checkpoint
        values = {f.name: getattr(ck, f.name) for f in dataclasses.fields(ck) if f.init}
        values.update(initial_load_path=None, initial_load_model_only=False,
                      base=ctx.shared.adapter_base or {"kind": "unhashed"})  # only rank 0 writes it
        tc.checkpoint = AdapterCheckpointManager.Config(**values)
        spec_ = tc.model_spec
        previous = spec_.post_optimizer_build_fn

        def post_optimizer_build(optimizers, model_parts, parallel_dims):
            remember_base(model_parts, load_path)
            if previous is not None:
                previous(optimizers, model_parts, parallel_dims)

        spec_.post_optimizer_build_fn = post_optimizer_build

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """The frozen base: its parameters stored once at the master's bytes (no gradient, no
        optimizer state); the adapters: parameters, fp32 gradients and Adam states like any trained
        parameter. Replaces the state backend's gradients and optimizer states, scales its gradient
        reduce-scatter (buffer and traffic) to the adapters; the base's GEMMs skip their weight gradient (2/3 of their
        fwd+bwd FLOPs, and so of their time and of the run's logged TFLOPs) and the adapters add their own FLOPs."""
        opts = opts if opts is not None else LoRA.Options()
        c, f, lay, pc = ctx.plan.constants, ctx.facts, ctx.layout, ctx.plan
        split = pc.split
        counts = adapter_counts(f, list(opts.targets), int(opts.rank))
        dense_ad, expert_ad = counts["dense"], counts["experts"]
        shard = lay.dp_shard * lay.cp * lay.tp
        pp = lay.pp
        base_local = ((split["dense_blocks"] + split["emb"] + split["head"] + split["experts"]) / pp) / shard
        ad_local = (dense_ad + expert_ad) / pp / shard
        total = sum(split.values())
        trainable = (dense_ad + expert_ad) / max(total + dense_ad + expert_ad, 1)
        ab = 2.0 if opts.dtype == "bf16" else 4.0
        how = f"/ {shard} (dp_shard x cp x tp)"
        replace = {
            "gradients": Term("gradients", ad_local, c.fsdp2_grad_bytes, "static",
                              f"adapters {ad_local * shard / 1e6:,.1f}M params {how} x {c.fsdp2_grad_bytes:g} B "
                              "(the frozen base has none)"),
            "optimizer_states": Term("optimizer_states", ad_local, ab + c.adam_bytes, "static",
                                     f"adapters {how} x ({ab:g} B master + {c.adam_bytes:g} B Adam)"),
        }
        memory = [Term("frozen_base", base_local, c.master_bytes, "static",
                       f"base params {base_local * shard / 1e9:,.2f}B {how} x {c.master_bytes:g} B "
                       "(stored once, fp32 as the master: no gradient, no optimizer state)")]
        # time: the base's GEMMs have no weight gradient (fwd + dX = 2 of 3); adapters add 6 x r x (in + out)
        # FLOPs per token per adapted linear (the planner's parts are already 6 x params)
        active_ad = dense_ad + (expert_ad * f.top_k / f.num_experts if f.num_experts else 0.0)
        parts = {"dense": split["dense_blocks"], "experts": split["experts"] * f.top_k / f.num_experts
                 if f.num_experts else 0.0, "lm_head": split["head"]}
        head_ad = counts["lm_head"]
        factor = {}
        for part, n in parts.items():
            if n <= 0:
                continue
            extra = (counts["experts"] * f.top_k / f.num_experts if part == "experts" and f.num_experts else
                     head_ad if part == "lm_head" else dense_ad - head_ad)
            factor[part] = 2 / 3 + max(extra, 0.0) / n
        note = (f"adapter lora rank {opts.rank} on {', '.join(opts.targets)}: {(dense_ad + expert_ad) / 1e6:,.1f}M "
                f"adapter params ({trainable:.3%} of the model; {active_ad / 1e6:,.1f}M active per token); frozen "
                "base: fp32 storage only, its GEMMs skip the weight gradient (x2/3 + the adapters' FLOPs)")
        ag, rb = c.fsdp_allgather_bytes, c.fsdp_reduce_bytes  # FSDP2 still all-gathers the base, fwd and bwd
        return PlanTerms(memory=memory, flops_factor=factor, notes=[note],
                         facts=PlanFacts(replace=replace, trainable_fraction=trainable, summary=f"lora rank {opts.rank}",
                                         # a frozen LM head has no weight gradient: the fused head skips its dW accumulator
                                         drop_loss_terms=() if "lm_head" in opts.targets else ("loss_dw_accum",),
                                         buffer_scale={"fsdp_reduce_scatter": trainable},
                                         comm_scale={"fsdp": (2 * ag + trainable * rb) / (2 * ag + rb)}))

    @staticmethod
    def export_hf(run_dir, out_path, family_mod, merged: bool = False):
        """`apiary export RUN --hf OUT [--merged]`: PEFT's adapter folder, or the merged HF folder
        (components/adapters/export.py); returns (folder, note)."""
        from components.adapters import export  # reason: start-up time (torch, torchtitan, safetensors)

        return export.export_hf(run_dir, out_path, family_mod, merged=merged)

    @staticmethod
    def published_form(options, ctx):
        """Publication (publish.interval > 0) writes the adapters alone, as PEFT's folder for the base
        model.hf_checkpoint (components/adapters/export.py ``published_form``; checked by
        ``_check_publication``)."""
        from components.adapters import export  # reason: start-up time (torch, torchtitan, safetensors)

        return export.published_form(ctx.cfg, ctx.components["model"])

    # apiary compare: another rank, scale, init or set of targets trains something else; dropout
    # and the adapters' dtype change the update's numerics only
    NUMERICS = {"": "any", "dropout": "any", "dtype": "bf16"}


def _check_combinations(options, ctx) -> None:
    cfg = ctx.cfg
    lay = ctx.layout
    if lay is not None and (lay.tp > 1 or lay.pp > 1):
        raise ValueError(f"adapter=lora runs with parallel.tp=1 and parallel.pp=1 (this layout has tp {lay.tp}, "
                         f"pp {lay.pp}); shard with FSDP2, EP and CP")
    state = str(cfg.state.name)
    if state != "fsdp2":
        raise ValueError(f"adapter=lora is implemented with state=fsdp2 (the frozen base sharded without gradients); "
                         f"state={state} is not. Use state=fsdp2")
    if str(cfg.precision.name) != "bf16":
        raise ValueError(f"adapter=lora runs with precision=bf16; precision={cfg.precision.name} would convert the "
                         "base's linears under the adapters, which apiary has not built. Use precision=bf16")
    if "experts" in options.targets and str(cfg.moe.chunk) != "none":
        raise ValueError(f"adapter.targets=experts adapts the routed experts' grouped GEMMs, which moe.chunk="
                         f"{cfg.moe.chunk} reschedules; use moe.chunk=none, or drop experts from adapter.targets")
    if "lm_head" in options.targets and str(cfg.loss.name) not in LM_HEAD_MODULE_LOSSES:
        raise ValueError(f"adapter.targets=lm_head adapts the lm_head module, and loss={cfg.loss.name} reads "
                         f"lm_head.weight in its own fused GEMMs, so the adapter would be ignored; use loss="
                         f"{'|'.join(LM_HEAD_MODULE_LOSSES)}, or drop lm_head from adapter.targets")
    if int(cfg.publish.interval) > 0:
        _check_publication(cfg, ctx)
    if cfg.checkpoint.create_seed:
        raise ValueError("checkpoint.create_seed=true writes a shared starting point for full training; an adapter "
                         "checkpoint holds adapters only. Create the seed with adapter=none and give it to LoRA runs "
                         "as their base: checkpoint.load_path=RUN/checkpoint/step-0")


def _check_publication(cfg, ctx) -> None:
    """publish.interval > 0 publishes the adapters alone (PEFT's folder for the base folder they were
    trained on): the base must be an HF folder a generator can load, and the versions cross as folders."""
    if not cfg.model.get("hf_checkpoint") or cfg.checkpoint.get("load_path"):
        base = (f"checkpoint.load_path={cfg.checkpoint.load_path} (a DCP step)" if cfg.checkpoint.get("load_path")
                else "initialised from training.seed")
        raise ValueError(f"publish.interval={cfg.publish.interval} with adapter=lora publishes the adapters alone "
                         "(PEFT's folder), which a generator applies to the HF folder of the base they were trained on; "
                         f"this run's base is {base}, which no generator can load. Train the adapters on an HF folder: "
                         "model.hf_checkpoint=DIR (`apiary export RUN --hf DIR` writes one from a saved step), or set "
                         "publish.interval=0")
    transport = ctx.components.get("transport")
    if transport is not None and getattr(transport, "IN_MEMORY", False):
        raise ValueError(f"publish.transport={cfg.publish.transport} sends the whole model to the engine in memory; "
                         "with adapter=lora a version is the adapters alone (a few MB in PEFT's format), which vLLM "
                         "loads as a LoRA adapter from the published folder (examples/rl_loop/vllm_generator.py "
                         "--lora). Use publish.transport=hf_folder")


def _bias_frozen(ctx) -> bool:
    """An MoE model whose recipe trains the routing bias (moe.load_balance_coeff): with adapter=lora the
    bias is part of the frozen base."""
    f = ctx.facts
    return f is not None and bool(f.num_experts) and ctx.cfg.moe.get("load_balance_coeff") is not None


def _trainable(options, ctx) -> str:
    """'; N trainable parameters (P% of the model's M)' for the run's first lines (the planner's count)."""
    f = ctx.facts
    if f is None:
        return ""
    c = adapter_counts(f, list(options.targets), int(options.rank))
    n = int(c["dense"] + c["experts"])
    return f"; {n:,} trainable parameters ({100 * n / max(f.n_params, 1):.2g}% of the base's {f.n_params:,})"


def _model_config(ctx):
    """This recipe's torchtitan model config (no weights), or None where there are no facts or the
    model's own check refuses it (it reports that itself)."""
    if ctx.facts is None:
        return None
    fam = ctx.components["model"]
    mopts = ctx.options["model"]
    try:
        return fam.model_spec(mopts.flavor, **fam.model_kwargs(mopts, ctx)).model
    except UserError:
        return None


def adapter_counts(f, targets: list[str], r: int) -> dict:
    """Adapter parameters of a model with facts ``f``: {"dense", "experts", "lm_head"} (the planner's
    estimate; tests/test_lora.py checks it against a built model)."""
    d, n = f.dim, f.n_layers
    q, kv = f.n_heads * f.head_dim, f.n_kv_heads * f.head_dim
    la = f.linear_attn or {}
    n_attn, n_lin = f.n_attention_layers, f.n_linear_attention_layers
    gated = 2 if f.family == "qwen3_5" else 1  # Qwen3.5's wq also produces the output gate
    pair = {  # (in, out) of each target's linear(s), times how many per model
        "q": [(d, gated * q, n_attn)], "k": [(d, kv, n_attn)], "v": [(d, kv, n_attn)], "o": [(q, d, n_attn)],
        "mlp": [(d, f.ffn_hidden_dim, n), (d, f.ffn_hidden_dim, n), (f.ffn_hidden_dim, d, n)] if f.ffn_hidden_dim else [],
        "shared_expert": [(d, f.shared_expert_hidden_dim, n)] * 2 + [(f.shared_expert_hidden_dim, d, n)]
        if f.shared_expert_hidden_dim else [],
        "lm_head": [(d, f.vocab_size, 1)],
    }
    if la:
        kd, vd, hv = la["key_dim"], la["value_dim"], la["value_heads"]
        pair.update({"in_proj_q": [(d, kd, n_lin)], "in_proj_k": [(d, kd, n_lin)], "in_proj_v": [(d, vd, n_lin)],
                     "in_proj_z": [(d, vd, n_lin)], "in_proj_a": [(d, hv, n_lin)], "in_proj_b": [(d, hv, n_lin)],
                     "out_proj": [(vd, d, n_lin)]})
    dense = head = 0.0
    for t in targets:
        got = sum(r * (i + o) * k for i, o, k in pair.get(t, []))
        dense += got
        head += got if t == "lm_head" else 0.0
    experts = 0.0
    if "experts" in targets and f.num_experts:
        experts = n * f.num_experts * 3 * r * (d + f.moe_hidden_dim)
    return {"dense": dense, "experts": experts, "lm_head": head}
