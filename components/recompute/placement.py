"""Where recompute=auto's choice goes in the stage: the planner's counts per mixer kind, placed layer
by layer (no torch here; policies.AutoRecompute plans with it and per_block.PerBlockAC applies it)."""

from __future__ import annotations

# the planner's words for what a block keeps -> the per-block policy that does it (per_block.PerBlockAC)
POLICY_OF = {"kept": "none", "ffn_rerun": "ffn", "partial": "selective", "recomputed": "full"}


def per_layer_words(blocks: dict | None, layer_mixers: tuple, n_layers: int) -> list[str]:
    """What each layer keeps (a word of ``POLICY_OF``) from the planner's counts per mixer kind
    (``blocks``: kind -> {"kept": a, "ffn_rerun": b, "partial": c, "recomputed": d}). Within a kind,
    layers from the last take kept, then ffn_rerun, partial, recomputed: backward reruns the last
    layers first, when the saves of all the others are alive, so keeping them costs least
    (framework.contracts.stage_activation_elements). A kind the counts do not cover: recomputed."""
    mixers = tuple(layer_mixers) or ("attention",) * n_layers
    left = {m: dict(v) for m, v in (blocks or {}).items()}
    out = []
    for m in reversed(mixers):
        counts = left.get(m, {})
        which = next((w for w in POLICY_OF if counts.get(w, 0) > 0), "recomputed")
        if which in counts:
            counts[which] -= 1
        out.append(which)
    return out[::-1]


def per_layer(blocks: dict | None, layer_mixers: tuple, n_layers: int) -> list[str]:
    """The policy of each layer (none | ffn | selective | full) for the planner's counts."""
    return [POLICY_OF[w] for w in per_layer_words(blocks, layer_mixers, n_layers)]
