"""Static training state a rank actually holds, counted from its tensors.

``static_bytes(model_parts, optimizers)`` sums the storage of the parameters, the gradients
and the optimizer state (master weights, moments, gradient buckets) that live between
steps; activations and communication buffers are not static state. Each storage is counted
once, in the first role that reaches it (parameters, then gradients, then optimizer), so a
master that is a view of the parameters costs nothing extra. Backends that keep state
outside ``param.grad`` / ``optimizer.state`` expose it through ``static_tensors()``.
"""

from __future__ import annotations

import torch

from components.state.common import local


def static_bytes(model_parts, optimizers) -> dict[str, int]:
    """Bytes of static state on this rank: ``params``, ``grads``, ``optimizer`` (on the
    training device), ``host`` (offloaded to host memory) and ``device_total``."""
    seen: set[tuple[str, int]] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = local(t).untyped_storage()
            key = (st.device.type, st.data_ptr())
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        return total

    params = [p for m in model_parts for p in m.parameters()]
    out = {"params": count(params), "grads": count(p.grad for p in params)}
    extra = optimizers.static_tensors() if hasattr(optimizers, "static_tensors") else {}
    out["grads"] += count(extra.get("grads", []))
    if "optimizer" in extra or "host" in extra:
        out["host"] = count(extra.get("host", []))
        out["optimizer"] = count(extra.get("optimizer", []))
    else:
        states = [t for opt in optimizers for st in opt.state.values() for t in st.values()]
        out["optimizer"], out["host"] = count(states), 0
    out["device_total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
