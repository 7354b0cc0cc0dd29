"""FP8 weights in torchtitan checkpoints: torchao's weight subclasses have no storage of their own, so
a checkpoint holds their plain tensors (``plain_tensor``) and torchtitan's storage check compares the
tensors' owners (``patch_checkpoint_storage_check``, through framework.compat).
"""

from __future__ import annotations

from framework import compat


def _storage_owner(t):
    """The plain tensor holding ``t``'s data: through DTensor and torchao's wrapper subclasses
    (WeightWithDynamicFloat8CastTensor, the FP8 experts' weight wrapper)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # reason: start-up time (torch)

    while is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        t = getattr(t, attrs[0])
    return t


def _shares_storage(a, b) -> bool:
    return _storage_owner(a).untyped_storage().data_ptr() == _storage_owner(b).untyped_storage().data_ptr()


def plain_tensor(v):
    """``v`` with torchao's wrapper subclass taken off (DTensors keep their mesh and placements),
    sharing its storage: what a checkpoint stores and loads into."""
    from torch.distributed.tensor import DTensor  # reason: start-up time (torch)

    if isinstance(v, DTensor):
        inner = _storage_owner(v._local_tensor)
        if inner is v._local_tensor:
            return v
        return DTensor.from_local(inner, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                                  stride=v.stride())
    return _storage_owner(v)


def patch_checkpoint_storage_check() -> None:
    """torchtitan 0.3.0's checkpoint ModelWrapper hands DCP ``model.state_dict()``. With torchao's
    FP8 weights that holds wrapper subclasses (WeightWithDynamicFloat8CastTensor, the FP8
    experts' Float8TrainingWeightWrapperTensor) with no storage of their own: its storage check
    fails ("Attempted to access the data pointer on an invalid python storage") on every load and
    save, and DCP would pickle them as objects. Here the wrapper hands DCP the wrapped plain
    tensors instead (same storage, so a load still lands in the parameters): FP8 checkpoints hold
    the same fp32 tensors as bf16 ones, and a bf16 seed loads into an FP8 model and back (the
    patch: framework/compat/torchtitan_patches.py)."""
    compat.plain_checkpoint_state_dict(plain_tensor, _shares_storage)
