"""Flex-attention semantics computed with a dense boolean mask and SDPA.

torch 2.14's flex attention has no CPU backward. This inner attention takes the same
BlockMask the decoder builds (causal + packed-document), expands its mask_mod into a
dense [B, 1, L, L] mask and runs ``scaled_dot_product_attention``. O(L^2) memory:
meant for CPU tests and debug recipes, chosen by ``framework.devices``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask
from torchtitan.models.common.attention import FlexAttention


class DenseMaskAttention(FlexAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: BlockMask, score_mod=None,
                scale=None, enable_gqa=False, out_transform=None, **kwargs) -> torch.Tensor:
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("DenseMaskAttention supports plain masked attention only")
        B, L = q_BLNH.shape[0], q_BLNH.shape[1]
        Lk = k_BLNH.shape[1]
        mask = create_mask(attention_masks.mask_mod, B, 1, L, Lk, device=q_BLNH.device)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)
