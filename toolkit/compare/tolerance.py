"""apiary compare's tolerances: what two runs may differ by, chosen from the swept key.

A component's key (`loss=`, `loss.OPT=`, `moe.chunk=`, ...) takes its kind from the component's
``NUMERICS`` (framework.contracts); the other config keys from ``KEY_KINDS`` below.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework import contracts
from framework.compose import registry


@dataclass(frozen=True)
class Tolerance:
    kind: str
    step0: float | None  # relative: probe loss, logits, gradients; None = not checked
    curve: float | None  # relative: the loss curve over the logged steps
    grad_norm: float | None  # relative: the grad-norm curve
    doc: str


TOLERANCES = {
    "exact": Tolerance("exact", 0.0, 0.0, 0.0, "bitwise: the same arithmetic, rescheduled"),
    "fp32": Tolerance("fp32", 1e-5, 1e-3, 1e-3, "float32 rounding: another kernel or partition of the same math"),
    "bf16": Tolerance("bf16", 2e-2, 5e-2, 5e-2, "bfloat16 rounding: another kernel or partition of the same math"),
    "fp8": Tolerance("fp8", 0.15, 2e-2, 0.15, "FP8 GEMM rounding (e4m3/e5m2: 3/2 mantissa bits) of linears and expert GEMMs"),
    "any": Tolerance("any", None, None, None, "a deliberate change: reported, not checked"),
}
# Another data-parallel size keeps every gradient bitwise but sums the gradient norm's squares
# over other shards: that one figure may differ by float32 rounding.
RESHARDED_NORM = 1e-5
TOL_CHOICES = ("exact", "fp32", "bf16", "dtype", "fp8", "any")

# Swept config key that is no component's (exact key, or prefix ending in ".") -> tolerance kind, why.
# A component's keys take their kind from its NUMERICS (component_kind below).
KEY_KINDS: list[tuple[str, str, str]] = [
    ("parallel.dp_shard", "dp", "data-parallel size"),
    ("parallel.dp_replicate", "dp", "data-parallel size"),
    ("training.local_batch", "dp", "micro-batching"),
    ("training.global_batch", "dp", "micro-batching"),
    ("logging.", "exact", "logging does not touch the arithmetic"),
    ("data.num_workers", "exact", "loader processes do not change the batches"),
    ("checkpoint.interval", "exact", "checkpoint cadence does not touch the arithmetic"),
    ("checkpoint.keep_latest_k", "exact", "checkpoint retention does not touch the arithmetic"),
    ("model.attn_backend", "dtype", "another attention kernel"),
    ("parallel.", "dtype", "another partition of the same math changes reduction order"),
    ("training.deterministic", "dtype", "deterministic kernels change op order"),
]


# Where a recipe names each registry kind's choice: a group's `name` (loss=chunked) or a plain key.
# (model.family changes the parameters: a deliberate change, from the general rules below.)
SELECTED_BY = {"loss": "loss", "state": "state", "recompute": "recompute", "precision": "precision",
               "launcher": "launcher", "moe_comm": "moe.comm", "moe_chunk": "moe.chunk", "data": "data.format"}
# Tolerance kinds from the tightest to the loosest (a switch between components takes the loosest).
LOOSENESS = ("exact", "dp", "dtype", "fp32", "bf16", "fp8", "any")
KIND_DOC = {
    "exact": "the same arithmetic, rescheduled",
    "dp": "data-parallel size",
    "dtype": "another kernel or partition of the same math (rounding of training.dtype)",
    "fp32": "another kernel or partition of the same math in float32",
    "bf16": "another kernel or partition of the same math in bfloat16",
    "fp8": "FP8 GEMMs round activations, weights and gradients to 3 (e4m3) / 2 (e5m2) mantissa bits",
    "any": "a deliberate change, reported, not checked",
}


def _chosen(cfg, path: str, kind: str) -> str:
    """The name ``cfg`` chooses for ``kind`` at ``path`` (the kind's baseline when cfg does not say)."""
    node = cfg
    for part in path.split("."):
        node = getattr(node, part, None)
    if node is not None and not isinstance(node, str):
        node = getattr(node, "name", None)
    return str(node) if node is not None else registry.names(kind)[0]


def component_kind(key: str, variants) -> tuple[str, str] | None:
    """(tolerance kind, why) from the components' ``NUMERICS`` when ``key`` chooses a component
    (``""``: the loosest kind of the variants' components) or sets one of its options (the
    baseline's entry for it, else its ``""``); None when ``key`` is no component's."""
    for kind, path in SELECTED_BY.items():
        if kind not in registry.entries():
            continue
        if key == path:
            opt = ""
        elif key.startswith(path + "."):
            opt = key[len(path) + 1:]
        else:
            continue
        names = list(dict.fromkeys(_chosen(v.resolved.cfg, path, kind) for v in variants))
        if opt:
            names = names[:1]
        kinds = {}
        for name in names:
            numerics = contracts.member(registry.resolve(kind, name), kind, "NUMERICS")
            if numerics.get(opt, numerics.get("")) not in LOOSENESS:
                return "any", (f"{kind} {name} declares no NUMERICS for {key}: treated as a deliberate change "
                               "(pass --tol to check)")
            kinds[name] = numerics.get(opt, numerics.get(""))
        tol = max(kinds.values(), key=LOOSENESS.index)
        if tol == "any" and not opt and len(names) > 1:
            return tol, (f"{key} swaps {', '.join(sorted(names))}: another objective, not only another kernel "
                         f"({kind} NUMERICS): {KIND_DOC[tol]}")
        return tol, f"{key} ({kind} {', '.join(names)}): {KIND_DOC[tol]}"
    return None


def classify(key: str, variants: list, accelerator: bool) -> tuple[str, str]:
    """The tolerance kind for sweeping ``key`` over ``variants`` (resolved) and why."""
    kind, why = "any", f"no tolerance is known for {key}: treated as a deliberate change (pass --tol to check)"
    cfgs = [v.resolved.cfg for v in variants]
    base = cfgs[0]
    from_component = component_kind(key, variants)
    if from_component:
        kind, why = from_component
    else:
        for pat, k, reason in KEY_KINDS:
            if key == pat or (pat.endswith(".") and key.startswith(pat)) or key.startswith(pat + "."):
                kind, why = k, reason
                break
        else:
            for pat in ("optimizer", "lr", "training.", "model.", "moe.", "data."):
                if key == pat or key.startswith(pat if pat.endswith(".") else pat + "."):
                    why = f"{key} changes what is computed: a deliberate change, reported, not checked"
                    break
    if kind == "dp":
        gb = {v.resolved.cfg.training.local_batch * v.resolved.layout.dp * v.resolved.grad_accum for v in variants}
        sums = max(v.resolved.layout.dp * v.resolved.grad_accum for v in variants)
        moved = {d: sorted({v.resolved.layout.dims[d] for v in variants}) for d in ("ep", "cp", "tp", "pp")}
        moved = {d: vals for d, vals in moved.items() if len(vals) > 1}
        if len(gb) > 1:
            kind, why = "any", f"{why} with another global batch ({sorted(gb)} sequences per step)"
        elif moved:
            kind, why = "dtype", (f"{why}, and the layout also changes " + ", ".join(
                f"{d} {' -> '.join(map(str, vals))}" for d, vals in moved.items()) + " (another partition)")
        elif any(c.data.sharding != "blocks" for c in cfgs):
            kind, why = "any", f"{why} with data.sharding=documents (other sequences per rank)"
        elif sums > 2:
            kind, why = "dtype", (f"{why}: the same {gb.pop()} sequences per step, but {sums} partial sums can be "
                                  "added in another order")
        else:
            kind, why = "exact", f"{why}: the same {gb.pop()} sequences per step, at most two partial sums"
    if kind == "exact" and accelerator and not base.training.deterministic:
        kind, why = "dtype", f"{why}; on GPU only bitwise with training.deterministic=true"
    eps = sorted({v.resolved.layout.dims["ep"] for v in variants})
    if len(eps) > 1 and variants[0].resolved.facts.num_experts and kind in ("exact", "dtype", "fp32"):
        # torchtitan's GroupedExperts run their GEMMs in bf16 whatever training.dtype is, and
        # another EP size reorders each expert's rows: expert gradients agree to bf16 only.
        kind, why = "bf16", (f"{why}; EP {' -> '.join(map(str, eps))} reorders each expert's rows and the "
                             "grouped expert GEMMs run in bf16 whatever training.dtype is")
    if kind == "dtype":
        kind = "fp32" if base.training.dtype == "float32" else "bf16"
        if kind == "fp32" and variants[0].resolved.facts.num_experts:
            kind, why = "bf16", (f"{why}; the model's grouped expert GEMMs run in bf16 whatever "
                                 "training.dtype is, so expert gradients agree to bf16 only")
    return kind, why

