"""recompute=auto's torchtitan side: activation checkpointing chosen per transformer block.

``PerBlockAC`` wraps each block of ``model.layers`` as its entry in ``policies`` says: "full"
(torchtitan's FullAC wrapper), "selective" (torchtitan's SelectiveAC wrapper), "ffn" (the block's
FFN child, ``moe`` or ``feed_forward``, under FullAC's wrapper: the mixer and norms keep their
saves, the FFN reruns from its input) or "none" (nothing recomputed). Every block is wrapped, kept
ones in torch's checkpoint wrapper around a plain call, so the model's initial weights are those of
the other policies: torchtitan's ``init_states`` visits the children of a plain wrapper after its
unwrapped siblings, so a model with some blocks wrapped and others not would draw its random initial
weights in another order (other weights at the same seed). A wrapped FFN is the last child to draw
(its block's norms draw nothing). torchtitan builds it from the trainer config like its own policies
(``Config.build``), so every family's parallelize function applies it where it applies FullAC.
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

from components.recompute.placement import per_layer

# the FFN child of a torchtitan transformer block, by the names its models use
FFN_CHILDREN = ("moe", "feed_forward")

# torchtitan 0.3.0's auxiliary-loss-free MoE balancing (components/optimizer) takes a block whose
# ``checkpoint_impl`` is CheckpointImpl.NO_REENTRANT for one whose forward reruns in backward, and
# halves the expert token counts its MoE doubled before it updates the routing bias. A kept block's
# wrapper sets ``checkpoint_impl`` to None: its MoE counts once, and halving them would change the
# bias updates (and every routing after them) against recompute=full or none. An "ffn" block keeps
# the mark: its MoE reruns.
RERUNS_MARK = "checkpoint_impl"


class PerBlockAC(ActivationCheckpointing):
    """One policy per transformer block (``layers.<i>`` gets ``policies[i]``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        policies: list[str] = field(default_factory=list)
        """none | ffn | selective | full for each block of model.layers, in order"""

    def apply(self, model) -> None:
        cfg = self.config
        shared = dict(preserve_rng_state=cfg.preserve_rng_state, determinism_check=cfg.determinism_check,
                      debug=cfg.debug)
        full = FullAC(FullAC.Config(**shared))
        wrappers = {"full": full, "selective": SelectiveAC(SelectiveAC.Config(**shared))}
        layers = model.get_submodule("layers")
        names = [name for name, _ in layers.named_children()]
        if len(names) != len(cfg.policies):
            raise ValueError(f"PerBlockAC has {len(cfg.policies)} policies for {len(names)} blocks")
        _disable_dynamo_lru_cache()
        for name, policy in zip(names, cfg.policies):
            block = layers.get_submodule(name)
            if policy in wrappers:
                block = wrappers[policy]._wrap_block(block, base_fqn=f"layers.{name}")
            else:  # kept, or the FFN alone rerun: the same wrapper (module names, init order), no checkpoint
                if policy == "ffn":
                    child = next((c for c in FFN_CHILDREN if getattr(block, c, None) is not None), None)
                    if child is None:
                        raise ValueError(f"PerBlockAC: block layers.{name} has no FFN child ({' or '.join(FFN_CHILDREN)}) "
                                         "to recompute alone")
                    block.register_module(child, full._wrap_block(getattr(block, child),
                                                                  base_fqn=f"layers.{name}.{child}"))
                elif policy != "none":
                    raise ValueError(f"PerBlockAC: unknown policy {policy!r} for block layers.{name}")
                block = checkpoint_wrapper(block, checkpoint_fn=_call)
                if policy == "none":  # nothing reruns: see RERUNS_MARK
                    setattr(block, RERUNS_MARK, None)
            layers.register_module(name, block)


def _call(module, *args, **kwargs):
    """The block's own forward: what a kept block's wrapper runs (its activations stay saved)."""
    return module(*args, **kwargs)


def per_block_config(blocks: dict | None, layer_mixers: tuple, n_layers: int):
    """torchtitan's activation-checkpoint config for this choice: FullAC when every block is fully
    recomputed (or nothing was chosen), None when every block is kept, else PerBlockAC."""
    policies = per_layer(blocks, layer_mixers, n_layers)
    if all(p == "full" for p in policies):
        return FullAC.Config()
    if all(p == "none" for p in policies):
        return None
    return PerBlockAC.Config(policies=policies)
