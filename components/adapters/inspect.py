"""Which adapter targets a model config has, and their narrowest width (the pre-launch rank check)."""

from __future__ import annotations

from torchtitan.models.common.attention import FusedQKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from components.adapters.targets import linear_target


def target_widths(config) -> dict[str, tuple[int, str]]:
    """{target: (min(in, out) of its narrowest linear, that linear's name)} for every target the
    model has (a fused wqkv counts as its q, k and v rows; routed experts by their dim and hidden)."""
    out: dict[str, tuple[int, str]] = {}

    def note(target, width, fqn):
        if target not in out or width < out[target][0]:
            out[target] = (int(width), fqn)

    fused = {fqn: c for fqn, c, _, _ in config.traverse(FusedQKVLinear.Config)}
    for fqn, c, _, _ in config.traverse(Linear.Config):
        t = linear_target(fqn)
        if t is None:
            continue
        if t == "fused_qkv":
            owner = fused[fqn.rsplit(".", 1)[0] if "." in fqn else ""]
            rows = {"q": owner.n_heads * owner.head_dim, "k": owner.n_kv_heads * owner.head_dim}
            rows["v"] = rows["k"]
            for part, n in rows.items():
                note(part, min(c.in_features, n), f"{fqn} ({part} rows)")
        elif t == "kv":
            for part in ("k", "v"):
                note(part, min(c.in_features, c.out_features), fqn.rsplit(".", 1)[0] + f".w{part}")
        else:
            note(t, min(c.in_features, c.out_features), fqn)
    for fqn, c, _, _ in config.traverse(GroupedExperts.Config):
        note("experts", min(c.dim, c.hidden_dim), fqn)
    return out
