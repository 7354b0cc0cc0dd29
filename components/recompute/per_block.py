"""recompute=auto's torchtitan side: activation checkpointing chosen per transformer block.

``PerBlockAC`` wraps each block of ``model.layers`` as its entry in ``policies`` says: "full"
(torchtitan's FullAC wrapper), "selective" (torchtitan's SelectiveAC wrapper) or "none" (torch's
checkpoint wrapper around a plain call: nothing recomputed). Every block is wrapped, so the model's
initial weights are those of the other policies: torchtitan's ``init_states`` visits the children of
a plain wrapper after its unwrapped siblings, so a model with some blocks wrapped and others not
would draw its random initial weights in another order (other weights at the same seed).
torchtitan builds it from the trainer config like its own policies (``Config.build``), so every
family's parallelize function applies it where it applies FullAC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torchtitan.distributed.activation_checkpoint import (  # _disable_dynamo_lru_cache: torchtitan 0.3.0's, as its
    ActivationCheckpointing,  # own policies call it before wrapping
    FullAC,
    SelectiveAC,
    _disable_dynamo_lru_cache,
)


class PerBlockAC(ActivationCheckpointing):
    """One policy per transformer block (``layers.<i>`` gets ``policies[i]``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        policies: list[str] = field(default_factory=list)
        """none | selective | full for each block of model.layers, in order"""

    def apply(self, model) -> None:
        cfg = self.config
        shared = dict(preserve_rng_state=cfg.preserve_rng_state, determinism_check=cfg.determinism_check,
                      debug=cfg.debug)
        wrappers = {"full": FullAC(FullAC.Config(**shared)), "selective": SelectiveAC(SelectiveAC.Config(**shared))}
        layers = model.get_submodule("layers")
        names = [name for name, _ in layers.named_children()]
        if len(names) != len(cfg.policies):
            raise ValueError(f"PerBlockAC has {len(cfg.policies)} policies for {len(names)} blocks")
        _disable_dynamo_lru_cache()
        for name, policy in zip(names, cfg.policies):
            block = layers.get_submodule(name)
            if policy in wrappers:
                block = wrappers[policy]._wrap_block(block, base_fqn=f"layers.{name}")
            else:  # kept: the same wrapper (module names, init order), no checkpoint
                block = checkpoint_wrapper(block, checkpoint_fn=_call)
            layers.register_module(name, block)


def _call(module, *args, **kwargs):
    """The block's own forward: what a kept block's wrapper runs (its activations stay saved)."""
    return module(*args, **kwargs)


# the planner's words for what a block keeps -> the policy that does it
POLICY_OF = {"kept": "none", "partial": "selective", "recomputed": "full"}


def per_layer(blocks: dict | None, layer_mixers: tuple, n_layers: int) -> list[str]:
    """The policy of each layer from the planner's counts per mixer kind (``blocks``: kind ->
    {"kept": a, "partial": b, "recomputed": c}); within a kind, layers in order take none, then
    selective, then full (at the peak, the start of backward, every block's saves are alive, so
    which of them is kept does not change it). A kind the counts do not cover: full."""
    mixers = tuple(layer_mixers) or ("attention",) * n_layers
    left = {m: dict(v) for m, v in (blocks or {}).items()}
    out = []
    for m in mixers:
        counts = left.get(m, {})
        which = next((w for w in POLICY_OF if counts.get(w, 0) > 0), "recomputed")
        if which in counts:
            counts[which] -= 1
        out.append(POLICY_OF[which])
    return out


def per_block_config(blocks: dict | None, layer_mixers: tuple, n_layers: int):
    """torchtitan's activation-checkpoint config for this choice: FullAC when every block is fully
    recomputed (or nothing was chosen), None when every block is kept, else PerBlockAC."""
    policies = per_layer(blocks, layer_mixers, n_layers)
    if all(p == "full" for p in policies):
        return FullAC.Config()
    if all(p == "none" for p in policies):
        return None
    return PerBlockAC.Config(policies=policies)
