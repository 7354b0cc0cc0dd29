"""TransformerEngine FP8 linears for ``precision=fp8 precision.backend=te``.

Every dense linear that fp8 converts (components.precision.fp8_targets.fp8_linear) becomes a
``te.pytorch.Linear`` with the same parameter names (``weight``, ``bias``), whose forward runs
under TE's FP8 autocast with the recipe chosen by ``precision.scaling``:

| scaling    | TE recipe                     | scales                                   | GPUs |
|------------|-------------------------------|------------------------------------------|------|
| tensorwise | ``Float8CurrentScaling``      | one per tensor, from the current amax    | Hopper+ (SM 8.9+) |
| blockwise  | ``Float8BlockScaling``        | 1x128 activations/grads, 128x128 weights | Hopper (SM 9.0) |
| mxfp8      | ``MXFP8BlockScaling``         | one e8m0 per 32 elements                 | Blackwell (SM 10.0+) |

No delayed scaling (amax history): every scale comes from the tensor being cast, so each
linear may enter and leave the autocast on its own (no global amax reduction at the end of the
step). Importing this module imports TransformerEngine; apiary does that only when
precision.backend=te asks for it (resolve checks that it imports, before launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformer_engine.pytorch as te
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module
from transformer_engine.common import recipe as te_recipe

from components.precision.fp8_targets import fp8_linear, swap_config


def make_recipe(scaling: str):
    if scaling == "tensorwise":
        return te_recipe.Float8CurrentScaling()
    if scaling == "blockwise":
        return te_recipe.Float8BlockScaling()
    if scaling == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    raise ValueError(f"TransformerEngine has no {scaling} FP8 recipe in apiary")


def fp8_autocast(recipe):
    """TE's FP8 autocast context (``te.autocast`` from 2.8 on, ``fp8_autocast`` before)."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class TELinear(te.Linear, Module):
    """te.pytorch.Linear as a torchtitan Module (config-built, ``param_init`` honoured)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int
        out_features: int
        bias: bool = False
        scaling: str = "tensorwise"

    def __init__(self, config: Config):
        device = torch.empty(0).device  # torchtitan builds on meta; TE defaults to cuda
        te.Linear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                           params_dtype=torch.get_default_dtype(), device=device)
        self._te_recipe = make_recipe(config.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp8_autocast(self._te_recipe):
            out = te.Linear.forward(self, x)
        return out[0] if isinstance(out, tuple) else out


def convert_linears(model_config, scaling: str):
    for fqn, lc, parent, attr in list(model_config.traverse(Linear.Config)):
        if type(lc) is Linear.Config and fp8_linear(fqn, lc.in_features, lc.out_features):
            new = TELinear.Config(in_features=lc.in_features, out_features=lc.out_features, bias=lc.bias,
                                  param_init=lc.param_init, scaling=scaling)
            model_config = swap_config(model_config, parent, attr, new)
    return model_config
