"""Gradient owners: a state backend that holds or moves a parameter's gradients itself says so on the
parameter, and the trainer's clip (framework/compat ``patch_clip_grad_norm``) asks it. And the state
backend's optimizers whose host copy of the state lags the step (``StagedHostState``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

GRAD_CLIP_OWNER = "_apiary_grad_clip_owner"  # a parameter's attribute: the GradClipOwner of its gradients
GRAD_SCALE_OWNER = "_apiary_grad_scale_owner"  # a parameter's attribute: the GradScaleOwner of its gradients


@runtime_checkable
class GradClipOwner(Protocol):
    """Holds the reduced gradients outside ``param.grad`` (ZeRO-1's flat buckets): computes the global
    norm and clips them itself; the clip returns what it returns."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Any: ...


@runtime_checkable
class GradScaleOwner(Protocol):
    """Copied the gradients elsewhere before the clip (the host offload): torchtitan computes the norm
    (its reductions, EP and PP included) and leaves the device gradients unscaled; the owner scales
    its copies by ``max_norm / total_norm``."""

    def scale_grads_(self, max_norm: float, total_norm: Any) -> None: ...


@runtime_checkable
class StagedHostState(Protocol):
    """An optimizers container (a state backend's: state.offload_update=device) whose state reaches
    the host after the step, copies in flight: the trainer waits on ``host_state_ready()`` before it
    reads that state (the finite check before every checkpoint)."""

    def host_state_ready(self) -> None: ...


def own_gradients(param: Any, *, clip: GradClipOwner | None = None, scale: GradScaleOwner | None = None) -> None:
    """Make ``clip`` (or ``scale``) the owner of ``param``'s gradients. One of the two."""
    if (clip is None) == (scale is None):
        raise TypeError("own_gradients takes one owner: clip= or scale=")
    if clip is not None:
        if not isinstance(clip, GradClipOwner):
            raise TypeError(f"{type(clip).__name__} has no clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)")
        setattr(param, GRAD_CLIP_OWNER, clip)
    else:
        if not isinstance(scale, GradScaleOwner):
            raise TypeError(f"{type(scale).__name__} has no scale_grads_(max_norm, total_norm)")
        setattr(param, GRAD_SCALE_OWNER, scale)


def gradient_owners(param: Any) -> tuple[GradClipOwner | None, GradScaleOwner | None]:
    """(the clip owner, the scale owner) ``own_gradients`` gave ``param``; None where none."""
    return getattr(param, GRAD_CLIP_OWNER, None), getattr(param, GRAD_SCALE_OWNER, None)
