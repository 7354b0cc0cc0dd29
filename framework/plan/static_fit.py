"""The memory that no sequence length changes: when the planner's static terms (parameters, gradients,
optimizer states, a frozen base) alone exceed the memory budget, no training.seq_len and no local batch
fits, so the memory preflight (framework.plan.preflight) says that instead of suggesting a shorter
sequence, and names what would help: more ranks or GPUs to shard it over, a smaller model, an adapter.
"""

from __future__ import annotations

from framework.compose import registry
from framework.plan.planner import parts

GiB = 2**30


def static_bytes(p) -> int:
    """Bytes of ``p``'s terms that do not scale with the sequence or the batch (group "static")."""
    return sum(t.bytes for t in p.terms if t.group == "static")


def _smaller(r, room: int, need: int) -> list[str]:
    """A fewer-layer model (the static terms scale about with the layers) and the adapters that
    freeze the base, when the run uses the default (none)."""
    out = []
    layers = int(r.facts.n_layers or 0) if r.facts is not None else 0
    k = int(layers * room / need) if need > 0 and room > 0 else 0
    if 1 <= k < layers:
        out.append(f"a smaller model (about model.n_layers={k} or fewer of its {layers})")
    else:
        out.append("a smaller model (model.flavor, model.n_layers)")
    default = parts.defaults()["adapter"]
    cur = str(getattr(r.cfg.get("adapter"), "name", default))
    if cur == default:
        out += [f"adapter={n} (its base frozen: its weights stay, without their gradients and optimizer states)"
                for n in registry.names("adapter") if n != default]
    return out


def host_verdict(r, p, n: int, process: int, budget: int) -> str | None:
    """For a CPU run of ``n`` ranks on this host, each ``process`` bytes beyond the planner's terms: the
    fix to say when the static terms alone exceed ``budget`` (the available memory with the measured
    error to spare), else None."""
    static = static_bytes(p)
    if n * (static + process) <= budget:
        return None
    fix = [f"more memory or GPUs to shard it over ({n} rank(s) on this host share its memory, so more ranks "
           "here do not help)"]
    if n > 1 and n * static + process <= budget:
        fix.insert(0, "fewer ranks (nproc=1: each rank's process adds its own copy of torch)")
    fix += _smaller(r, budget - n * process, n * static)
    return (f"The model's parameters, gradients and optimizer states alone need {n * static / GiB:,.1f} GiB "
            f"({n} rank(s) x {static / GiB:,.1f} GiB, plus {n * process / GiB:,.1f} GiB of processes), more "
            f"than this host has: it does not fit at any training.seq_len or local batch. What would help: "
            + "; or ".join(fix))


def gpu_verdict(r, p, cap: int, over: float) -> str | None:
    """For a GPU run: the fix to say when the static terms per GPU alone exceed the GPU's memory
    ``cap`` by more than the measured error ``over``, else None."""
    static, n = static_bytes(p), r.layout.world_size
    if static <= cap * (1 + over):
        return None
    fix = [f"more GPUs to shard it over (FSDP spreads these terms over the ranks; {n} now)"]
    fix += _smaller(r, int(cap * n / (1 + over)), static * n)
    return (f"The model's parameters, gradients and optimizer states alone need {static / GiB:,.1f} GiB per GPU "
            f"at {n} GPU(s), more than the GPU's memory: it does not fit at any training.seq_len. "
            "What would help: " + "; or ".join(fix))
