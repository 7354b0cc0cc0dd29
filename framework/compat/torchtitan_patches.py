"""The patches of torchtitan's internals (torchtitan 0.3.0): attention masks and flex attention,
seeded initialisation, the one clip_grad_norm_ wrapper, FSDP wrapping, the trainer's loop and steps,
the checkpointer's state dict, the MoE token exchange and frozen parameters (the patches of one
object: torchtitan_instances.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

from framework.compat.originals import _keep_original
from framework.contracts.grads import gradient_owners


def eager_block_masks() -> None:
    """torchtitan 0.3.0. torchtitan compiles ``create_block_mask`` into the module global
    ``torchtitan.models.common.attention._compiled_create_block_mask``; on CPU inductor spends ~30 s
    on it per process. Set the eager builder there."""
    from torch.nn.attention.flex_attention import create_block_mask  # reason: start-up time (torch)
    from torchtitan.models.common import attention  # reason: device shims: torchtitan after install()

    attention._compiled_create_block_mask = create_block_mask


def compile_flex_attention(options: dict) -> None:
    """torchtitan 0.3.0 / torch 2.14.1. torchtitan keeps the compiled flex attention on the class
    (``FlexAttention._compiled_flex_attn``, compiled with ``FlexAttention.inductor_configs``);
    recompile it with ``options`` (e.g. those options without the autotuners: seconds to compile
    instead of minutes of tuning per shape). Each call compiles anew: framework.devices'
    ``set_flex_autotune`` calls it only when the options change."""
    import torch  # reason: start-up time (torch)
    from torch.nn.attention.flex_attention import flex_attention  # reason: as above
    from torchtitan.models.common.attention import FlexAttention  # reason: device shims: torchtitan after install()

    _keep_original("torchtitan.models.common.attention:FlexAttention._compiled_flex_attn",
                   FlexAttention._compiled_flex_attn)
    FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=options)


_SEEDED: list = [None]  # the generators' states right after torchtitan seeded them, until the model's init


def _rng_states() -> tuple:
    import torch  # reason: start-up time (torch)

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


class _NoInitRedistributeNote(logging.Filter):
    """torch 2.14.1's note (logger torch.distributed.tensor._redistribute) that a redistribution from a
    _StridedShard placement takes several all_gathers: torchtitan's init draws random values (trunc_normal_)
    on DTensors sharded over FSDP and CP/EP (nproc=2 parallel.cp=2 on CPU), once per rank at build."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


_INIT_NOTE = _NoInitRedistributeNote()


@contextlib.contextmanager
def _quiet_init_redistribution():
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    log.addFilter(_INIT_NOTE)
    try:
        yield
    finally:
        log.removeFilter(_INIT_NOTE)


def init_weights_from_seed() -> None:
    """torchtitan 0.3.0. Wraps ``torchtitan.distributed.utils.set_determinism`` (keep the CPU and CUDA
    generators' states right after it seeds them) and ``BaseModel.init_weights`` (put those states
    back just before the first initialization after seeding), so that a model's initial weights
    depend on ``training.seed`` alone, whatever building and parallelizing the model drew in
    between (TransformerEngine's linears advance the CUDA generator there). With pipeline
    parallelism the later stages continue from there, as before."""
    from torchtitan.distributed import utils as dist_utils  # reason: start-up time (torchtitan)
    from torchtitan.protocols.model import BaseModel  # reason: as above

    if getattr(dist_utils.set_determinism, "_apiary", False):
        return
    set_determinism, init_weights = dist_utils.set_determinism, BaseModel.init_weights
    _keep_original("torchtitan.distributed.utils:set_determinism", set_determinism)
    _keep_original("torchtitan.protocols.model:BaseModel.init_weights", init_weights)

    def seeded(*args, **kwargs):
        with warnings.catch_warnings():  # a CPU mesh (gloo, nproc=2): torch's DTensor RNG seeding is for GPU
            # meshes, skipped there with a warning on every rank (torch.manual_seed seeds the CPU); others stay
            warnings.filterwarnings("ignore", message=r"DTensor manual_seed\(\) may not have complete support on "
                                    r"cpu device mesh", category=UserWarning)
            out = set_determinism(*args, **kwargs)
        _SEEDED[0] = _rng_states()
        return out

    def init_from_seed(self, **kwargs):
        import torch  # reason: start-up time (torch)

        states, _SEEDED[0] = _SEEDED[0], None
        if states is not None:
            torch.random.set_rng_state(states[0])
            if states[1] is not None:
                torch.cuda.set_rng_state(states[1])
        with _quiet_init_redistribution():  # the init's one-time note; a redistribution in training still shows
            return init_weights(self, **kwargs)

    seeded._apiary = True
    dist_utils.set_determinism = seeded
    BaseModel.init_weights = init_from_seed


LAST_GRAD_NORM: list = [None]  # the last global grad norm clip_grad_norm_ returned (the trainer resets it)


def patch_clip_grad_norm() -> None:
    """torchtitan 0.3.0. torchtitan's trainer computes the step's global grad norm with
    ``torchtitan.distributed.utils.clip_grad_norm_`` and keeps it local to ``train_step``. One
    wrapper (installed once, whoever asks first) does two things: it keeps the norm it returns in
    ``LAST_GRAD_NORM`` (the trainer's non-finite check reads it before the optimizer step), and
    when the first parameter has a ``contracts.GradClipOwner`` (``contracts.own_gradients``: a state
    backend whose reduced gradients live outside ``param.grad``) it asks that owner's ``clip_grad_norm_(max_norm, norm_type,
    error_if_nonfinite)`` instead of torchtitan's. When it has a ``GradScaleOwner`` instead (a
    state backend that copied the gradients elsewhere before the clip), torchtitan's function
    computes the norm (same reductions, EP and PP included) with ``torch.nn.utils.clip_grads_with_norm_``
    a no-op for that call, and the owner's ``scale_grads_(max_norm, total_norm)`` applies the clip."""
    import torch  # reason: start-up time (torch)
    from torchtitan.distributed import utils as dist_utils  # reason: start-up time (torchtitan)

    if getattr(dist_utils.clip_grad_norm_, "_apiary", False):
        return
    torchtitan_clip = dist_utils.clip_grad_norm_
    _keep_original("torchtitan.distributed.utils:clip_grad_norm_", torchtitan_clip)

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None,
                        pp_mesh=None, ep_enabled=False):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owner, scaler = gradient_owners(params[0]) if params else (None, None)
        if owner is not None:
            norm = owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        elif scaler is not None:
            scale = torch.nn.utils.clip_grads_with_norm_
            torch.nn.utils.clip_grads_with_norm_ = _no_grad_scaling
            try:
                norm = torchtitan_clip(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
            finally:
                torch.nn.utils.clip_grads_with_norm_ = scale
            scaler.scale_grads_(max_norm, norm)
        else:
            norm = torchtitan_clip(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
        LAST_GRAD_NORM[0] = norm
        return norm

    clip_grad_norm_._apiary = True
    dist_utils.clip_grad_norm_ = clip_grad_norm_


def _no_grad_scaling(parameters, max_norm, total_norm, foreach=None) -> None:
    return None


def _no_fsdp(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def fsdp_wrappers_disabled(own_prefixes: tuple[str, ...] = ()):
    """torchtitan 0.3.0. torchtitan's parallelize functions (and model wrappers in modules whose
    names start with one of ``own_prefixes``) call ``apply_fsdp*`` helpers they import by name:
    for the duration of the block, every ``apply_fsdp*`` callable in ``torchtitan.distributed.fsdp``,
    ``torchtitan.models.*`` and those modules is a no-op (the model parallelism stays, the
    data-parallel wrapping goes); the originals are put back after it. Nested use is harmless."""
    prefixes = ("torchtitan.models.", *own_prefixes)
    patched = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name.startswith(prefixes) or name == "torchtitan.distributed.fsdp"):
            continue
        for attr in list(vars(mod)):
            if attr.startswith("apply_fsdp") and callable(getattr(mod, attr)):
                patched.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, _no_fsdp)
    try:
        yield
    finally:
        for mod, attr, fn in patched:
            setattr(mod, attr, fn)


def hook_trainer_train(before) -> None:
    """torchtitan 0.3.0. Every torchtitan ``Trainer`` (and subclass) calls ``before(trainer)`` when
    its ``train()`` starts (``python -m framework.train.preempt`` hooks the trainer it does not build)."""
    from torchtitan.trainer import Trainer  # reason: imported after the caller's set-up (python -m framework.train.preempt)

    if getattr(Trainer.train, "_apiary", False):
        return
    train_fn = Trainer.train
    _keep_original("torchtitan.trainer:Trainer.train", train_fn)

    def train(self, *args, **kwargs):
        before(self)
        return train_fn(self, *args, **kwargs)

    train._apiary = True
    Trainer.train = train


class _TimeWithoutSleep:
    """The ``time`` module without ``sleep`` (no_closing_sleep)."""

    def __getattr__(self, name):
        import time  # reason: the real module, read through for everything but sleep

        return getattr(time, name)

    @staticmethod
    def sleep(_seconds: float) -> None:
        return None


@contextlib.contextmanager
def no_closing_sleep():
    """torchtitan 0.3.0: ``Trainer.train`` ends on rank 0 with ``time.sleep(2)`` "for other ranks to
    complete", its module's only sleep. Inside, ``torchtitan.trainer.time`` has no sleep; used by a
    one-process run (world size 1: no other ranks), which then ends 2 s sooner."""
    import torchtitan.trainer as tt  # reason: torchtitan, imported when a run trains

    before = tt.time
    tt.time = _TimeWithoutSleep()
    try:
        yield
    finally:
        tt.time = before


def plain_checkpoint_state_dict(to_plain, shares_storage) -> None:
    """torchtitan 0.3.0. Its checkpoint ``ModelWrapper._get_state_dict`` hands DCP
    ``model.state_dict()``, and its ``_shares_storage`` compares data pointers. With tensor subclasses
    that wrap another tensor (torchao's FP8 weight wrappers) that state has no storage of its own:
    the storage check fails on every load and save, and DCP would pickle the wrappers as objects.
    Replaces ``_get_state_dict`` by one that maps every value through ``to_plain`` (the wrapped
    plain tensor, same storage, so a load still lands in the parameters) and ``_shares_storage``
    by ``shares_storage``. A second call does nothing."""
    from torchtitan.components.checkpointer import base  # reason: start-up time (torchtitan)

    if getattr(base.ModelWrapper, "_apiary_plain", False):
        return
    _keep_original("torchtitan.components.checkpointer.base:ModelWrapper._get_state_dict",
                   base.ModelWrapper._get_state_dict)
    _keep_original("torchtitan.components.checkpointer.base:_shares_storage", base._shares_storage)

    def _get_state_dict(self):
        return {k: to_plain(v) for model in self.model for k, v in model.state_dict().items()}

    base.ModelWrapper._get_state_dict = _get_state_dict
    base.ModelWrapper._apiary_plain = True
    base._shares_storage = shares_storage


def route_token_exchange(dispatch, combine) -> None:
    """torchtitan 0.3.0. Its all-to-all token dispatcher exchanges tokens in
    ``AllToAllTokenDispatcher._dispatch_token_exchange(self, routed_input_ND, pg, output_splits,
    input_splits)`` and ``_combine_token_exchange(self, routed_output_RD, pg, input_splits,
    output_splits)``, through a path gloo refuses for uneven splits; replace them by ``dispatch``
    and ``combine`` (same signatures)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # reason: after devices.install

    target = "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher."
    _keep_original(target + "_dispatch_token_exchange", AllToAllTokenDispatcher._dispatch_token_exchange)
    _keep_original(target + "_combine_token_exchange", AllToAllTokenDispatcher._combine_token_exchange)
    AllToAllTokenDispatcher._dispatch_token_exchange = dispatch
    AllToAllTokenDispatcher._combine_token_exchange = combine


def keep_frozen_through_distribute() -> None:
    """torchtitan 0.3.0. Its spmd_types parallelize (``Module._spmd_distribute_state``) re-registers
    every parameter as ``nn.Parameter(distributed)``, which requires a gradient again: a frozen base
    (torchtitan's own adapter converter included) would train. Keep each parameter's
    ``requires_grad`` (once per process)."""
    from torchtitan.protocols.module import Module  # reason: start-up time (torchtitan)

    if getattr(Module._spmd_distribute_state, "_apiary_keeps_frozen", False):
        return
    distribute_fn = Module._spmd_distribute_state
    _keep_original("torchtitan.protocols.module:Module._spmd_distribute_state", distribute_fn)

    def distribute(self, parallel_dims, name, tensor, layout, *, is_param):
        wanted = tensor.requires_grad
        distribute_fn(self, parallel_dims, name, tensor, layout, is_param=is_param)
        if is_param and not wanted:
            self._parameters[name].requires_grad_(False)

    distribute._apiary_keeps_frozen = True
    Module._spmd_distribute_state = distribute
