"""torchtitan's Float8Linear (torchao) plus FSDP2 FP8 all-gather.

torchtitan 0.3.0 builds ``Float8Linear`` from its config (``__init__``), and only torchao's
``from_float`` wraps the weight for FP8 all-gather; here the weight is wrapped after
construction when the torchao config asks for it (``enable_fsdp_float8_all_gather``, tensorwise
only), so FSDP2 all-gathers each block's FP8 weights (1 byte per element instead of 2) and
the GEMM reuses them. Imported only when ``precision=fp8 precision.backend=torchao``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from torchtitan.components.quantization.float8 import Float8Linear


class ApiaryFloat8Linear(Float8Linear):
    @dataclass(kw_only=True, slots=True)
    class Config(Float8Linear.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        if self.config.enable_fsdp_float8_all_gather:
            self.weight = torch.nn.Parameter(
                WeightWithDynamicFloat8CastTensor(self.weight, self.linear_mm_config,
                                                  self.config.cast_config_weight.target_dtype),
                requires_grad=self.weight.requires_grad)
