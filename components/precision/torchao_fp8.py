"""precision=fp8 with precision.backend=torchao: the Float8Linear config of a scaling and the conversion
of a model config's linears and routed experts (tensorwise, rowwise, mxfp8). The policy that chooses
them: components/precision/policies.py.
"""

from __future__ import annotations

import dataclasses

from components.precision.fp8_targets import PAD_MULTIPLE, fp8_linear, swap_config


def torchao_linear_config(scaling: str, fp8_all_gather: bool, emulate: bool = False):
    from torchao.float8 import Float8LinearConfig  # optional dependency: torchao

    c = Float8LinearConfig.from_recipe_name(scaling)
    return dataclasses.replace(c, enable_fsdp_float8_all_gather=fp8_all_gather, emulate=emulate)


def _torchao_linears(model_config, opts, emulate: bool, fp8_all_gather: bool):
    from torchtitan.models.common.linear import Linear  # reason: start-up time (torchtitan)

    from components.precision.torchao_linear import ApiaryFloat8Linear  # optional dependency: torchao

    ao = torchao_linear_config(opts.scaling, fp8_all_gather, emulate)
    for fqn, lc, parent, attr in list(model_config.traverse(Linear.Config)):
        if type(lc) is Linear.Config and fp8_linear(fqn, lc.in_features, lc.out_features):
            new = ApiaryFloat8Linear.Config(in_features=lc.in_features, out_features=lc.out_features,
                                            bias=lc.bias, param_init=lc.param_init, _torchao_config=ao)
            model_config = swap_config(model_config, parent, attr, new)
    return model_config


def _torchao_experts(model_config):
    from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls  # reason: start-up time
    from torchtitan.components.quantization.utils import swap_token_dispatcher  # reason: start-up time (torchtitan)
    from torchtitan.models.common.moe import GroupedExperts  # reason: start-up time (torchtitan)

    for _fqn, ec, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        swap_token_dispatcher(parent, PAD_MULTIPLE)
        cls = _get_float8_grouped_experts_cls(type(ec)._owner)
        new = cls.Config(**{f.name: getattr(ec, f.name) for f in dataclasses.fields(ec)})
        model_config = swap_config(model_config, parent, attr, new)
    return model_config


def _torchao_mxfp8(model_config, experts: bool, linears: bool = True):
    from torchtitan.components.quantization.mx import MXFP8Linear, _get_mxfp8_grouped_experts_cls  # reason: start-up
    from torchtitan.components.quantization.utils import swap_token_dispatcher  # reason: start-up time (torchtitan)
    from torchtitan.models.common.linear import Linear  # reason: start-up time (torchtitan)
    from torchtitan.models.common.moe import GroupedExperts  # reason: start-up time (torchtitan)

    if MXFP8Linear is None:
        raise RuntimeError("precision.scaling=mxfp8: torchao's MXFP8Linear is not importable")
    for fqn, lc, parent, attr in list(model_config.traverse(Linear.Config)) if linears else []:
        if type(lc) is Linear.Config and fp8_linear(fqn, lc.in_features, lc.out_features):
            new = MXFP8Linear.Config(in_features=lc.in_features, out_features=lc.out_features, bias=lc.bias,
                                     param_init=lc.param_init)
            model_config = swap_config(model_config, parent, attr, new)
    if experts:
        for _fqn, ec, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            swap_token_dispatcher(parent, 32)  # MX block size
            cls = _get_mxfp8_grouped_experts_cls(type(ec)._owner)
            new = cls.Config(**{f.name: getattr(ec, f.name) for f in dataclasses.fields(ec)})
            model_config = swap_config(model_config, parent, attr, new)
    return model_config
