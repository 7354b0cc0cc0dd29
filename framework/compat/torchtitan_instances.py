"""The patches of torchtitan's internals on one object (torchtitan 0.3.0), never its class: the
trainer's steps and loop, the checkpointer's saves, a schedule container's load, an MoE layer's
combine, a module's sharding config, a decoder's final projection. Each wraps or sets what one
object holds; a second call with the same patch changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses


def _replace_on_instance(obj, attr: str, make, patch: str):
    """Set ``obj.attr`` to ``make(current)`` unless ``patch`` already wrapped it (anywhere in the
    chain of wrappers); returns the method ``patch`` wrapped (the object's own, or the wrapper below)."""
    current = getattr(obj, attr)
    link = current
    while getattr(link, "_apiary_patch", None) is not None:
        if link._apiary_patch == patch:
            return link._apiary_original
        link = link._apiary_original
    new = make(current)
    new._apiary_patch, new._apiary_original = patch, current
    setattr(obj, attr, new)
    return current


def guard_trainer_steps(trainer, optimizer_step, scheduler_step) -> tuple:
    """torchtitan 0.3.0. ``Trainer.train_step`` ends with ``self.optimizers.step()`` and
    ``self.lr_schedulers.step()``; on this trainer's two containers (not their classes) they become
    ``optimizer_step(original, ...)`` and ``scheduler_step(original, ...)``, where ``original`` is
    the container's own bound ``step`` (the non-finite guard: framework/train/trainer.py). Returns the two
    originals."""
    def make(wrap):
        def build(current):
            def step(*args, **kwargs):
                return wrap(current, *args, **kwargs)
            return step
        return build

    return (_replace_on_instance(trainer.optimizers, "step", make(optimizer_step), "guard_trainer_steps"),
            _replace_on_instance(trainer.lr_schedulers, "step", make(scheduler_step), "guard_trainer_steps"))


def wrap_checkpoint_saves(checkpointer, dcp_save, save) -> tuple:
    """torchtitan 0.3.0. ``CheckpointManager.dcp_save(state_dict, checkpoint_id, async_mode, ...)`` and
    ``CheckpointManager.save(curr_step, last_step=False)`` on this checkpointer (not its class) become
    ``dcp_save`` and ``save`` (the atomic, manifest-writing saves: framework/train/integrity.py). A
    checkpointer without ``save`` (a test's stand-in) keeps none. Returns the originals
    ``(dcp_save, save or None)``."""
    own_dcp = _replace_on_instance(checkpointer, "dcp_save", lambda current: (lambda *a, **k: dcp_save(*a, **k)),
                                   "wrap_checkpoint_saves")
    own_save = None
    if getattr(checkpointer, "save", None) is not None:
        own_save = _replace_on_instance(checkpointer, "save", lambda current: (lambda *a, **k: save(*a, **k)),
                                        "wrap_checkpoint_saves")
    return own_dcp, own_save


def gate_training_loop(trainer, should_continue) -> None:
    """torchtitan 0.3.0. ``Trainer.train`` loops while ``self.should_continue_training()``; on this
    trainer (not its class) that becomes ``should_continue(original)`` (the preemption guard:
    framework/train/preempt)."""
    _replace_on_instance(trainer, "should_continue_training",
                         lambda current: (lambda: should_continue(current)), "gate_training_loop")


def observe_checkpoint_saves(checkpointer, after) -> None:
    """torchtitan 0.3.0. ``CheckpointManager.save(curr_step, last_step=False)`` on this checkpointer
    (not its class) also calls ``after(curr_step, written)`` with what it returned (the preemption
    guard's last saved step: framework/train/preempt)."""
    def build(current):
        def save(curr_step, last_step=False):
            written = current(curr_step, last_step=last_step)
            after(curr_step, written)
            return written
        return save

    _replace_on_instance(checkpointer, "save", build, "observe_checkpoint_saves")


def _wrapped_by(obj, attr: str, patch: str) -> bool:
    link = getattr(obj, attr, None)
    while getattr(link, "_apiary_patch", None) is not None:
        if link._apiary_patch == patch:
            return True
        link = link._apiary_original
    return False


def after_state_load(container, then) -> None:
    """torchtitan 0.3.0. ``OptimizersContainer.load_state_dict(state_dict)`` and
    ``LRSchedulersContainer.load_state_dict(state_dict)`` on this container (not its class) also call
    ``then()`` after the load (the held schedule's rates put back on the optimizer's groups:
    framework/train/build.py). An object without ``load_state_dict`` (a plain list) is left as it is."""
    if getattr(container, "load_state_dict", None) is None:
        return

    def build(current):
        def load_state_dict(state_dict):
            current(state_dict)
            then()
        return load_state_dict

    _replace_on_instance(container, "load_state_dict", build, "after_state_load")


def replace_token_combine(dispatcher, make) -> bool:
    """torchtitan 0.3.0. ``LocalTokenDispatcher.combine(routed_output_RD, metadata, x_TD)`` and
    ``AllToAllTokenDispatcher.combine`` on this dispatcher (not its class) become ``make(original)``
    (the lean scoring: components/moe/lean_combine.py). Returns whether it changed the dispatcher
    (False: already replaced)."""
    if _wrapped_by(dispatcher, "combine", "replace_token_combine"):
        return False
    _replace_on_instance(dispatcher, "combine", make, "replace_token_combine")
    return True


def add_state_shardings(module, names, like: str) -> None:
    """torchtitan 0.3.0. A ``Module``'s ``_sharding_config.state_shardings`` (parameter name -> its
    placement, read when the module is distributed) on this module gets each of ``names`` with the
    placement of ``like`` (LoRA's adapters take the base weight's: expert parallelism shards them over
    the experts). A module without one, or without ``like`` in it, is left as it is."""
    sc = getattr(module, "_sharding_config", None)
    layouts = getattr(sc, "state_shardings", None) if sc is not None else None
    if not layouts or like not in layouts:
        return
    extra = {n: layouts[like] for n in names}
    module._sharding_config = dataclasses.replace(sc, state_shardings={**layouts, **extra})


@contextlib.contextmanager
def hidden_states_only(decoder):
    """torchtitan 0.3.0. ``Decoder.forward`` skips its ``lm_head`` when ``_skip_lm_head`` is set (it
    returns the hidden states after the final norm); set on this decoder for the block, then put back
    (``apiary logprobs`` projects the states itself)."""
    before = decoder._skip_lm_head
    decoder._skip_lm_head = True
    try:
        yield decoder
    finally:
        decoder._skip_lm_head = before
