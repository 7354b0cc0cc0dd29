"""Training precision: ``bf16`` (baseline: bf16 GEMMs, fp32 master weights) and ``fp8``
(FP8 GEMMs for the dense linears and the MoE expert grouped GEMMs; docs/skills/fp8.md).

The precision contract (framework/contracts/protocols.py): ``check(options, ctx)`` raises ValueError for
option combinations no backend runs (resolve turns it into a user error, also when only
planning) and, when training, UserError where this machine cannot run it (``check_runtime``: no
FP8 GPU, backend not importable); ``apply(options, tc, ctx)`` converts the model config on
``tc.model_spec`` before it is built (``FP8.convert``) and sets trainer options (compile, FSDP hooks).

What stays bf16 under fp8, and why:
- the LM head: apiary's fused losses (chunked, linear_ce, the policy losses) read
  ``lm_head.weight`` and run their own GEMMs, so an FP8 module there would be bypassed; and the
  logits feed a softmax over the whole vocabulary where e4m3's 3 mantissa bits (relative step
  6%) move the loss itself;
- the MoE router (``router.gate``) and the shared expert's scalar gate: top-k selection is
  discrete, FP8 rounding flips which experts a token reaches, and the GEMM is tiny
  (dim x experts);
- with ``precision.compile=true`` (torchao), every dense linear: only the MoE expert GEMMs run in
  FP8. Measured on one H200 (Qwen3-30B-A3B, 4 layers, 16K; benchmarks/precision_probe.sh): under
  torchtitan's per-block compile the weight gradient of the first FP8 dense linear of every block
  was NaN at step 1 (the fused QKV projection; with that one in bf16, the output projection), all
  other gradients finite; with the attention linears in bf16 and the experts in FP8 it trained 50
  steps within 1% of compiled bf16's loss. Eager FP8 has no NaN;
- norms, embeddings, attention (flex/SDPA) and GatedDeltaNet's recurrence: not GEMMs of
  weights (no FP8 kernels on this path); linears with a dimension not divisible by 16
  (FP8 tensor-core alignment), e.g. GatedDeltaNet's a/b projections.

This module imports neither torchao nor TransformerEngine at import time (optional dependencies):
they are imported only when ``precision=fp8`` asks for them; torch and torchtitan are imported by the
functions that convert or check a model (`train --help` and `--cfg job` read the Options without them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from components.precision.checkpoint_storage import patch_checkpoint_storage_check

# keep_bf16 stays readable here (the policy's public name)
from components.precision.fp8_targets import PAD_MULTIPLE, fp8_linear, keep_bf16, swap_config  # noqa: F401
from components.precision.torchao_fp8 import _torchao_experts, _torchao_linears, _torchao_mxfp8
from framework.contracts import PlanConstant, PlanFacts, PlanTerms, Term, check_choices
from framework.errors import UserError

# the planner's constants of precision=fp8 (FSDP2's plan reads fp8_allgather_bytes); calibrate as
# `apiary plan calib.NAME=VALUE` (docs/skills/planner.md, docs/skills/fp8.md)
PLAN_CONSTANTS = {
    "fp8_flops_ratio": PlanConstant(
        2.0, "FP8 over bf16 tensor-core peak on Hopper (H100/H200 SXM: 1,979 vs 989 TFLOP/s dense, datasheets): "
             "the FP8 GEMMs' time is the bf16 time / this."),
    "fp8_cast_overhead": PlanConstant(
        1.29, "precision=fp8 without compile: amax, scale and cast kernels of each FP8 GEMM's operands (forward and "
              "backward), as a fraction of the bf16 GEMM time. Fitted on an H200 (benchmarks/fp8_experts_bench.py, "
              "2026-11-24): torchao's FP8 expert layer took 1.79x bf16's time at 1024 tokens per expert "
              "(Qwen3-30B-A3B, 16K); its dense linears measured more (3.72x, fp8_linear_bench.py at 16K tokens)."),
    "fp8_cast_overhead_compiled": PlanConstant(
        1.09, "the same with precision.compile=true: the compiled FP8 expert layer took 1.59x bf16's time on the "
              "same H200 benchmark (the casts are torchao's own kernels, which compile does not fuse)."),
    "fp8_copy_bytes": PlanConstant(
        2.0, "precision=fp8: bytes per converted parameter of a block in compute: its FP8 weight (1 B) and the "
             "transposed / column-scaled FP8 copy the input-gradient GEMM uses (1 B), plus per-row or per-tensor "
             "scales (negligible)."),
    "fp8_allgather_bytes": PlanConstant(
        1.0, "precision=fp8 with FP8 all-gather (torchao tensorwise): bytes per all-gathered element of a "
             "converted linear (its scale is one fp32 per tensor)."),
}

BACKENDS = ("torchao", "te")
SCALINGS = ("tensorwise", "rowwise", "blockwise", "mxfp8")
# What each backend runs (dense linears). Expert grouped GEMMs: torchao only (rowwise scales,
# torch._scaled_grouped_mm) or MXFP8 on Blackwell.
BACKEND_SCALINGS = {
    "torchao": ("tensorwise", "rowwise", "mxfp8"),
    "te": ("tensorwise", "blockwise", "mxfp8"),
}
# Smallest CUDA compute capability per scaling: FP8 tensor cores arrive with Ada (8.9);
# row-wise / block-wise scaled GEMMs and FP8 grouped GEMMs need Hopper (9.0); MX block
# scales (1x32, e8m0) are a Blackwell (10.0) tensor-core feature.
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0), "blockwise": (9, 0), "mxfp8": (10, 0)}
# One FP8 layer against fp32, norm-wise relative error of the output and of each gradient.
# e4m3 keeps 3 mantissa bits (relative spacing 2^-4..2^-3), e5m2 gradients 2 (2^-3..2^-2):
# the rounding's rms is ~2.5% (e4m3) and ~5% (e5m2) of each element, and a GEMM's sum does not
# shrink a relative error that every product shares, so a weight gradient (e5m2 x e4m3) sits
# near 6%. tests/gpu/test_fp8_gpu.py holds every backend's layer to this.
FP8_LAYER_TOL = 0.1


class BF16:
    """bf16 compute everywhere (torchtitan's mixed precision), the baseline."""

    SKILL = "fp8"  # docs/skills/fp8.md covers both precisions

    @dataclass(kw_only=True)
    class Options:
        name: str = "bf16"
        """registry name (precision=bf16)"""
        compile: bool = False
        """torch.compile each transformer block (torchtitan's compile)"""

    @staticmethod
    def check(options, ctx=None) -> None:
        check_compile(options, ctx.facts if ctx is not None else None)

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        _apply_compile(options, tc)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Every GEMM at the bf16 peak; nothing converted."""
        return PlanTerms(notes=["precision bf16: every GEMM at bf16 peak"],
                         facts=PlanFacts(dense_share=0.0, fp8_all_gather=False))

    # apiary compare: how runs differing in this component or its options are held to each other
    # (FP8 GEMMs round to 3/2 mantissa bits; compile: kernels of the same math).
    NUMERICS = {"": "fp8", "compile": "dtype"}
    PLAN_CONSTANTS = PLAN_CONSTANTS


def check_compile(opts, facts) -> None:
    """precision.compile=true on a model torchtitan's per-block compile cannot trace: refused."""
    if opts.compile and facts is not None and getattr(facts, "n_linear_attention_layers", 0) > 0:
        raise ValueError(
            f"precision.compile=true cannot compile this model's {facts.n_linear_attention_layers} GatedDeltaNet "
            "layers: on an H200 torch.compile stopped at step 1 inside fla's causal_conv1d (torch._dynamo "
            "Unsupported: 'Skip inlining torch.compiler.disable()d function'). Drop precision.compile for this model")


def _apply_compile(opts, tt_config) -> None:
    if opts.compile:
        from torchtitan.config import CompileConfig  # reason: start-up time (torchtitan)

        tt_config.compile = CompileConfig(enable=True, components=["model"])


class FP8:
    """FP8 GEMMs (torchao: e4m3 weights/activations, e5m2 gradients) for dense linears and MoE expert grouped GEMMs."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "fp8"
        """registry name (precision=fp8)"""
        backend: Literal["torchao", "te"] = "torchao"
        """torchao | te (TransformerEngine, built from source: docs/install.md)"""
        scaling: Literal["tensorwise", "rowwise", "blockwise", "mxfp8"] = "tensorwise"
        """tensorwise | rowwise (torchao) | blockwise (te) | mxfp8 (Blackwell)"""
        experts: bool = True
        """MoE routed-expert grouped GEMMs in FP8 too (torchao)"""
        all_gather: Literal["auto", "fp8", "bf16"] = "auto"
        """FSDP2 parameter all-gather: auto | fp8 (torchao tensorwise) | bf16"""
        compile: bool = False
        """torch.compile each transformer block (fuses the FP8 casts); torchao, MoE expert GEMMs only"""

        def __post_init__(self):
            if self.backend not in BACKENDS:
                raise ValueError(f"precision.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
            if self.scaling not in SCALINGS:
                raise ValueError(f"precision.scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")
            if self.all_gather not in ("auto", "fp8", "bf16"):
                raise ValueError(f"precision.all_gather must be auto, fp8 or bf16, got {self.all_gather!r}")
            check_choices(self, "precision.")
            if self.scaling not in BACKEND_SCALINGS[self.backend]:
                other = next(b for b in BACKENDS if b != self.backend)
                raise ValueError(
                    f"precision.backend={self.backend} has no {self.scaling} FP8 recipe (it runs "
                    f"{', '.join(BACKEND_SCALINGS[self.backend])}); precision.backend={other} runs "
                    f"{', '.join(BACKEND_SCALINGS[other])}")
            if self.all_gather == "fp8" and not (self.backend == "torchao" and self.scaling == "tensorwise"):
                raise ValueError(
                    f"precision.all_gather=fp8 needs one scale per weight tensor (torchao tensorwise): with "
                    f"backend={self.backend} scaling={self.scaling} each rank would need the whole weight "
                    "to compute its scales; use precision.all_gather=auto (bf16 all-gather here) or "
                    "precision.scaling=tensorwise precision.backend=torchao")

    # ------------------------------------------------------------------ validation
    @staticmethod
    def fp8_all_gather(opts, cfg=None) -> bool:
        """Whether FSDP2 all-gathers the FP8-converted weights in FP8 (auto: where supported)."""
        if opts.all_gather == "bf16":
            return False
        supported = opts.backend == "torchao" and opts.scaling == "tensorwise"
        if cfg is not None:
            supported = supported and cfg.state.name == "fsdp2"
        return supported

    @staticmethod
    def check(options, ctx=None) -> None:
        """Option combinations (always) and whether this machine can train FP8 (ctx.for_training)."""
        opts = options
        cfg = ctx.cfg if ctx is not None else None
        facts = ctx.facts if ctx is not None else None
        if opts.all_gather == "fp8" and cfg is not None and cfg.state.name != "fsdp2":
            raise ValueError(f"precision.all_gather=fp8 is an FSDP2 parameter all-gather; state="
                             f"{cfg.state.name} does not all-gather parameters per block (use state=fsdp2)")
        check_compile(opts, facts)
        moe = facts is not None and getattr(facts, "num_experts", 0) > 0
        if opts.compile and opts.backend == "torchao" and facts is not None and not (moe and opts.experts):
            raise ValueError(
                "precision=fp8 precision.compile=true runs FP8 for the MoE expert GEMMs only (compiled FP8 dense "
                "linears gave NaN weight gradients on an H200, so they stay bf16), and this run has "
                + ("precision.experts=false" if moe else "no MoE experts")
                + ": nothing would run in FP8. Drop precision.compile (eager FP8 converts the dense linears) "
                "or use precision=bf16 precision.compile=true")
        if moe and opts.experts:
            if opts.backend == "te":
                raise ValueError(
                    "precision.backend=te converts dense linears only (apiary has no TransformerEngine "
                    "grouped-GEMM experts); set precision.experts=false to keep the expert GEMMs in bf16, "
                    "or use precision.backend=torchao for FP8 expert GEMMs")
            if cfg is not None and cfg.moe.chunk != "none":
                raise ValueError(
                    f"FP8 expert GEMMs pad each expert's tokens to multiples of {PAD_MULTIPLE} with torchao's "
                    f"token dispatcher, which moe.chunk={cfg.moe.chunk} does not run; set moe.chunk=none or "
                    "precision.experts=false")
            if cfg is not None and cfg.moe.comm != "alltoall":
                raise ValueError(
                    f"FP8 expert GEMMs need a token dispatcher that pads expert groups (torchao's all-to-all); "
                    f"moe.comm={cfg.moe.comm} has none in apiary; use moe.comm=alltoall or precision.experts=false")
        if ctx is not None and ctx.for_training:
            FP8.check_runtime(opts, cfg)
            if opts.compile:
                ctx.summary.append("precision=fp8 precision.compile=true: FP8 for the MoE expert GEMMs only; the "
                                   "dense linears stay bf16 (compiled, their FP8 weight gradients were NaN on an "
                                   "H200; docs/skills/fp8.md)")

    @staticmethod
    def check_runtime(opts, cfg=None) -> None:
        """UserError when this machine cannot train in FP8 (resolve calls it before launch)."""
        if opts.compile and opts.backend == "te":
            raise UserError("precision.backend=te precision.compile=true", "TransformerEngine's linears under "
                            "torchtitan's per-block torch.compile have not been run in apiary (compile is measured "
                            "with torchao, whose casts it fuses).",
                            "Drop precision.compile with precision.backend=te, or use precision.backend=torchao "
                            "precision.compile=true.")
        launcher = getattr(getattr(cfg, "launcher", None), "name", "local") if cfg is not None else "local"
        if launcher == "local":  # a scheduler's GPUs are checked on the node (convert raises there)
            why = device_problem(opts.scaling)
            if why:
                raise UserError("precision=fp8", why, "Train with precision=bf16 here (the recipe still "
                                "resolves, prints and plans with fp8), or run on an H100/H200 (docs/skills/fp8.md).")
        missing = backend_problem(opts.backend)
        if missing:
            raise UserError(f"precision.backend={opts.backend}", missing[0], missing[1])

    # ------------------------------------------------------------------ model conversion
    @staticmethod
    def convert(opts, model_config, *, emulate: bool = False):
        """FP8 modules in the model config (before it is built). ``emulate`` (torchao, tests
        only) runs the FP8 casts with fp32 matmuls on any device."""
        if not emulate:
            why = device_problem(opts.scaling)
            if why:
                raise RuntimeError(f"precision=fp8: {why}")
        if opts.backend == "te":
            from components.precision import te  # optional dependency: transformer_engine

            return te.convert_linears(model_config, opts.scaling)
        if opts.scaling == "mxfp8":
            return _torchao_mxfp8(model_config, opts.experts, linears=not opts.compile)
        if not opts.compile:  # compiled: dense linears stay bf16 (module docstring)
            model_config = _torchao_linears(model_config, opts, emulate, FP8.fp8_all_gather(opts))
        if opts.experts:
            model_config = _torchao_experts(model_config)
        return model_config

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        opts, tt_config = options, tc
        tc.model_spec.model = FP8.convert(opts, tc.model_spec.model)
        spec = tc.model_spec
        _apply_compile(opts, tt_config)
        patch_checkpoint_storage_check()
        if FP8.fp8_all_gather(opts) and opts.backend == "torchao":
            # one all-reduce of every FP8 weight's amax after the optimizer step, instead of one
            # per weight inside each all-gather
            previous = spec.post_optimizer_build_fn

            def post_optimizer_build(optimizers, model_parts, parallel_dims):
                if previous is not None:
                    previous(optimizers, model_parts, parallel_dims)
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # optional dependency: torchao

                def hook(*_args, **_kwargs):
                    for m in model_parts:
                        precompute_float8_dynamic_scale_for_fsdp(m)

                optimizers.register_step_post_hook(hook)

            spec.post_optimizer_build_fn = post_optimizer_build

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """The FP8 share of dense-block GEMMs (all but the routers) and of the expert GEMMs
        (torchao with experts=true), at bf16 time x (1/``fp8_flops_ratio`` + cast overhead); one
        block's FP8 weight copies; whether FSDP2 all-gathers the converted linears in FP8."""
        opts = opts if opts is not None else FP8.Options()
        c, f, lay, split = ctx.plan.constants, ctx.facts, ctx.layout, ctx.plan.split
        # bf16 inside the blocks: the routers (dim x experts per MoE layer); norms are not GEMMs and are
        # counted with the blocks but negligible
        router = f.n_layers * f.dim * f.num_experts if f.num_experts else 0
        compiled = bool(getattr(opts, "compile", False))
        dense = split["dense_blocks"]
        # compiled torchao: the dense linears stay bf16 (module docstring)
        dense_share = max(0.0, dense - router) / dense if dense and not compiled else 0.0
        experts = bool(f.num_experts) and bool(getattr(opts, "experts", True)) and str(opts.backend) == "torchao"
        all_gather = FP8.fp8_all_gather(opts, ctx.cfg)
        how = f"fp8 {opts.backend} {opts.scaling}"
        over = c.fp8_cast_overhead_compiled if compiled else c.fp8_cast_overhead
        factor = 1 / c.fp8_flops_ratio + over  # an FP8 GEMM's time over its bf16 time, casts included
        share = {"dense": dense_share, "experts": 1.0 if experts else 0.0}
        conv = split["dense_blocks"] / f.n_layers / lay.tp * dense_share + \
            (split["experts"] / f.n_layers / max(lay.ep, 1) if experts else 0.0)
        note = (f"precision {how}: FP8 GEMMs for {share['dense']:.0%} of dense-block and "
                f"{share['experts']:.0%} of expert FLOPs at bf16 time x (1/{c.fp8_flops_ratio:g} + {over:g} casts) = "
                f"x{factor:.2f}; LM head, attention, GatedDeltaNet" + (", dense linears (compiled)" if compiled else "")
                + " in bf16; FSDP all-gather "
                + ("FP8 for the converted linears" if all_gather else "bf16"))
        return PlanTerms(
            memory=[Term("fp8_weight_copies", conv, c.fp8_copy_bytes, "buffers",
                         f"one block's FP8-converted params {conv / 1e6:,.1f}M x {c.fp8_copy_bytes:g} B "
                         f"(FP8 weight + transposed copy; {how})")],
            time_factor={k: (1 - s) + s * factor for k, s in share.items()},
            notes=[note], facts=PlanFacts(dense_share=dense_share, fp8_all_gather=all_gather))

    # apiary compare: how runs differing in this component or its options are held to each other
    # (FP8 GEMMs round to 3/2 mantissa bits; compile: kernels of the same math).
    NUMERICS = {"": "fp8", "compile": "dtype"}
    PLAN_CONSTANTS = PLAN_CONSTANTS


def device_problem(scaling: str) -> str | None:
    """Why this machine's GPU cannot run ``scaling`` FP8 GEMMs, or None."""
    import torch  # reason: start-up time (torch)

    from framework import devices  # reason: as above (it imports torch)

    need = MIN_CAPABILITY[scaling]
    if not devices.has_accelerator():
        return ("FP8 training needs an NVIDIA GPU with FP8 tensor cores (compute capability >= "
                f"{need[0]}.{need[1]} for {scaling} scaling: Ada, Hopper H100/H200, Blackwell); this "
                "machine has no CUDA device.")
    cc = torch.cuda.get_device_capability(0)
    if tuple(cc) < need:
        name = torch.cuda.get_device_name(0)
        return (f"{scaling} FP8 GEMMs need compute capability >= {need[0]}.{need[1]}; this GPU ({name}) "
                f"is {cc[0]}.{cc[1]}" + (" (MX formats run on Blackwell tensor cores only; on Hopper use "
                                         "tensorwise or rowwise)." if scaling == "mxfp8" else "."))
    return None


def backend_problem(backend: str) -> tuple[str, str] | None:
    """(reason, fix) when ``backend`` is not importable, else None."""
    if backend == "torchao":
        try:
            import torchao.float8  # noqa: F401  (optional dependency)
        except ImportError as e:
            return (f"torchao is not importable ({e}).",
                    "Install it: pip install torchao==0.18.0 (docs/install.md), or use precision=bf16.")
        return None
    try:
        import transformer_engine.pytorch  # noqa: F401  (optional dependency)
    except Exception as e:  # ImportError, or OSError from a core library built for another CUDA/torch
        return (f"TransformerEngine's PyTorch extension is not importable ({type(e).__name__}: {e}).",
                "Build and install the transformer-engine-torch wheel against this torch with "
                "scripts/build_te.sh (docs/install.md), or use precision.backend=torchao.")
    return None
