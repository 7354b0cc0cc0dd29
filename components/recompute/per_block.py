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

At run time the kept and FFN-rerun blocks can move to auto's next cheaper choice: their wrappers
(``Rerun``) read at each forward whether to run plainly or under torch's non-reentrant checkpoint,
so a switch between steps takes effect at the next forward. ``Fallback`` (a memory listener,
framework.contracts.add_memory_listener) makes that switch when the allocator retried in a step after
the first ``warmup_steps`` (compile, autotune): one candidate back per such step, along
``Config.fallbacks`` (the planner's candidates before the chosen one, nearest first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torchtitan.distributed.activation_checkpoint import (  # _disable_dynamo_lru_cache: torchtitan 0.3.0's, as its
    ActivationCheckpointing,  # own policies call it before wrapping
    FullAC,
    SelectiveAC,
    _disable_dynamo_lru_cache,
)

from components.recompute.placement import per_layer
from framework.contracts import MemoryReaction, add_memory_listener

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
        fallbacks: list[list[str]] = field(default_factory=list)
        """the per-block policies of auto's cheaper candidates, nearest first (switched to at run time
        when the allocator retries; empty: never switched)"""
        fallback_blocks: list[dict] = field(default_factory=list)
        """those candidates' counts per mixer kind (what the switch says and a resume starts from)"""
        warmup_steps: int = 3
        """steps of a process (compile, autotune) whose allocator retries are not acted on"""
        planned_blocks: dict = field(default_factory=dict)
        """the planner's choice before any step back (a resume starts from the learned one while the plan is this)"""
        fallbacks_taken: int = 0
        """candidates this run already stepped back before this process (a resume of a run that learned)"""

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
        switches = {}
        for name, policy in zip(names, cfg.policies):
            block = layers.get_submodule(name)
            if policy in wrappers:
                block = wrappers[policy]._wrap_block(block, base_fqn=f"layers.{name}")
            else:  # kept, or the FFN alone rerun: the same wrapper (module names, init order), switchable
                if policy not in ("none", "ffn"):
                    raise ValueError(f"PerBlockAC: unknown policy {policy!r} for block layers.{name}")
                child = next((c for c in FFN_CHILDREN if getattr(block, c, None) is not None), None)
                inner = None
                if policy == "ffn" and child is None:
                    raise ValueError(f"PerBlockAC: block layers.{name} has no FFN child ({' or '.join(FFN_CHILDREN)}) "
                                     "to recompute alone")
                if policy == "ffn" or (child is not None and cfg.fallbacks):
                    inner = Rerun(policy == "ffn", **shared)
                    block.register_module(child, checkpoint_wrapper(getattr(block, child), checkpoint_fn=inner))
                outer = Rerun(False, **shared)
                block = checkpoint_wrapper(block, checkpoint_fn=outer)
                if policy == "none":  # nothing reruns: see RERUNS_MARK
                    setattr(block, RERUNS_MARK, None)
                switches[name] = (block, outer, inner)
            layers.register_module(name, block)
        if cfg.fallbacks and switches:
            add_memory_listener(model, Fallback(names, list(cfg.policies), switches, cfg.fallbacks,
                                                cfg.fallback_blocks, cfg.warmup_steps, cfg.planned_blocks,
                                                cfg.fallbacks_taken))


class Rerun:
    """A kept or FFN-rerun block's ``checkpoint_fn``, read at each forward: the module's own forward
    (its activations stay saved) or, with ``rerun`` set, torch's non-reentrant checkpoint with
    FullAC's settings (only the input saved; the forward reruns in backward)."""

    def __init__(self, rerun: bool, *, preserve_rng_state: bool, determinism_check: str, debug: bool):
        self.rerun = rerun
        self.kwargs = dict(preserve_rng_state=preserve_rng_state, determinism_check=determinism_check, debug=debug,
                           early_stop=False)

    def __call__(self, module, *args, **kwargs):
        if self.rerun:
            return torch_checkpoint(module, *args, use_reentrant=False, **self.kwargs, **kwargs)
        return module(*args, **kwargs)


def _counts(blocks: dict | None) -> str:
    return "; ".join(f"{m}: " + ", ".join(f"{n} {w.replace('_', ' ')}" for w, n in v.items() if n)
                     for m, v in (blocks or {}).items()) or "every block recomputed"


class Fallback:
    """recompute=auto's reaction to allocator retries (framework.contracts.MemoryListener): after a
    step past the warm-up in which the allocator retried, the blocks that differ from the next
    cheaper candidate switch to it (kept -> FFN rerun -> fully recomputed), one candidate per step."""

    kind = "recompute"

    def __init__(self, names: list[str], policies: list[str], switches: dict, fallbacks: list[list[str]],
                 fallback_blocks: list[dict], warmup_steps: int, planned: dict, before: int = 0):
        self.names, self.policies, self.switches = names, policies, switches
        self.fallbacks, self.fallback_blocks, self.warmup_steps = fallbacks, fallback_blocks, warmup_steps
        self.planned, self.before, self.taken = planned, before, 0
        self.metrics = {"recompute_fallbacks": before}

    def on_step(self, step: int, steps_run: int, retries: int) -> MemoryReaction | None:
        if retries <= 0 or steps_run <= self.warmup_steps or self.taken >= len(self.fallbacks):
            return None
        target = self.fallbacks[self.taken]
        changed = [(n, old, new) for n, old, new in zip(self.names, self.policies, target) if old != new]
        if any(n not in self.switches or new not in ("ffn", "full") for n, _, new in changed):
            self.fallbacks = self.fallbacks[:self.taken]  # a move no wrapper here can make: stop switching
            return MemoryReaction(f"recompute=auto: the allocator retried {retries} time(s) in step {step}, but the "
                                  "next cheaper choice changes a block that was not built switchable; kept as is")
        for name, _, new in changed:
            block, outer, inner = self.switches[name]
            outer.rerun = new == "full"
            if inner is not None:
                inner.rerun = new == "ffn"
            setattr(block, RERUNS_MARK, CheckpointImpl.NO_REENTRANT)  # its MoE now counts every token twice
        self.policies = list(target)
        self.taken += 1
        self.metrics = {"recompute_fallbacks": self.before + self.taken}
        blocks = self.fallback_blocks[self.taken - 1] if self.taken <= len(self.fallback_blocks) else None
        what = ", ".join(f"layers.{n} {_WORD[old]} -> {_WORD[new]}" for n, old, new in changed)
        return MemoryReaction(
            f"recompute=auto: the CUDA allocator retried {retries} time(s) in step {step} (its peak is at the GPU's "
            f"limit: the plan under-estimated it), so from step {step + 1} on {what} (auto's next cheaper choice: "
            f"{_counts(blocks)})",
            learned={"planned": self.planned, "fallbacks": self.before + self.taken, "blocks": blocks, "step": step,
                     "retries": retries})


_WORD = {"none": "kept", "ffn": "FFN rerun", "selective": "selective", "full": "recomputed"}


def per_block_config(blocks: dict | None, layer_mixers: tuple, n_layers: int, fallbacks: list | None = None, *,
                     planned: dict | None = None, taken: int = 0):
    """torchtitan's activation-checkpoint config for this choice: FullAC when every block is fully
    recomputed (or nothing was chosen), None when every block is kept and there is no cheaper
    candidate to fall back to, else PerBlockAC (with ``fallbacks``, the cheaper candidates' counts,
    nearest first: switched to at run time when the allocator retries; ``planned``: the planner's
    choice and ``taken`` the candidates already stepped back from it, for a resume)."""
    policies = per_layer(blocks, layer_mixers, n_layers)
    if all(p == "full" for p in policies):
        return FullAC.Config()
    fallbacks = list(fallbacks or [])
    if all(p == "none" for p in policies) and not fallbacks:
        return None
    return PerBlockAC.Config(policies=policies, fallbacks=[per_layer(b, layer_mixers, n_layers) for b in fallbacks],
                             fallback_blocks=[dict(b) for b in fallbacks], planned_blocks=dict(planned or blocks or {}),
                             fallbacks_taken=taken)
