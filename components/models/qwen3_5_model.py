"""Text-only Qwen3.5 on torchtitan's Qwen3.5 blocks: no vision encoder, no image/video tokens.

``Qwen35TextModel`` is a torchtitan ``Decoder`` whose layers are torchtitan's hybrid
``Qwen35TransformerBlock`` (gated attention with partial RoPE every Nth layer, GatedDeltaNet
elsewhere; MoE with a sigmoid-gated shared expert, or a dense SwiGLU). GatedDeltaNet is
``components.models.gated_deltanet.ApiaryGatedDeltaNet``: same parameters, a torch path for
CPU and context parallelism for both layer kinds. ``parallelize_qwen35_text`` replaces
torchtitan's ``parallelize_qwen3_5`` (which refuses CP): attention layers go through
torchtitan's CP (K/V all-gather), GatedDeltaNet layers through chained state passing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp_to_forward
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.attention import FlexAttention, VarlenAttention, create_varlen_metadata_for_document
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.moe_sharding import set_moe_sharding_config
from torchtitan.models.qwen3_5.model import Qwen35Model, Qwen35TransformerBlock
from torchtitan.models.qwen3_5.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT
from torchtitan.models.utils import get_moe_model_nparams_and_flops

from components.models.gated_deltanet import CPInfo, GDNContext
from components.models.qwen3_5_hf import load_hf
from framework import compat, devices

LOAD_BALANCERS = {None: "contiguous", "none": "contiguous", "headtail": "zigzag"}  # -> GDN layout


class TextBlock(Qwen35TransformerBlock):
    """torchtitan's hybrid block; GatedDeltaNet layers also get the per-forward GDNContext."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen35TransformerBlock.Config):
        pass

    def forward(self, x_BLD, attention_masks=None, positions=None, gdn: GDNContext | None = None):
        h = self.attention_norm(x_BLD)
        h = self.attn(h, attention_masks, positions) if self.full_attn else self.attn(h, gdn)
        x_BLD = x_BLD + h
        h = self.ffn_norm(x_BLD)
        return x_BLD + (self.moe(h) if self.moe_enabled else self.feed_forward(h))


class Qwen35TextModel(Decoder):
    """Token ids [B, S] -> logits [B, S, V] (or hidden states when the loss owns lm_head)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        max_positions: int = 262144  # RoPE length when no layer is full attention
        hf_checkpoint: str | None = None  # HF weights loaded by init_states (after random init)

        @property
        def max_seq_len(self) -> int:
            attn = self.first_attention
            return attn.rope.max_seq_len if attn is not None else self.max_positions

        def update_from_config(self, *, config, **kwargs) -> None:
            Decoder.Config.update_from_config(self, config=config, **kwargs)
            p = config.parallelism
            if p.tensor_parallel_degree > 1:
                raise ValueError("apiary's text-only Qwen3.5 does not support tensor parallelism (TP=1).")
            if p.pipeline_parallel_degree > 1:
                raise ValueError("apiary's text-only Qwen3.5 does not support pipeline parallelism yet (PP=1).")
            if p.context_parallel_degree > 1 and p.context_parallel_load_balancer not in LOAD_BALANCERS:
                raise ValueError(
                    f"context_parallel_load_balancer={p.context_parallel_load_balancer!r}: GatedDeltaNet "
                    "needs each rank's tokens in contiguous parts of the true sequence; use 'headtail' "
                    "(balanced causal attention) or None.")
            set_text_sharding(self, enable_ep=p.expert_parallel_degree > 1)

        def get_nparams_and_flops(self, model, seq_len: int):
            if self.first_attention is None:
                return get_moe_model_nparams_and_flops(self, model, 1, 0, seq_len)
            return Qwen35Model.Config.get_nparams_and_flops(self, model, seq_len)

    def __init__(self, config: Config):
        super().__init__(config)
        self.vision_encoder = None  # torchtitan helpers look for it
        self._cp: CPInfo | None = None

    def set_context_parallel(self, cp: CPInfo | None) -> None:
        self._cp = cp

    def init_states(self, *, buffer_device=None) -> None:
        super().init_states(buffer_device=buffer_device)
        if self.config.hf_checkpoint:
            load_hf(self, self.config.hf_checkpoint)

    def gdn_context(self, positions: torch.Tensor | None, batch: int, seq: int, device) -> GDNContext:
        """Document starts (positions == 0) and CP placement for this forward's GDN layers."""
        resets = None if positions is None else positions == 0
        kernel = self._gdn_backend()
        if self._cp is None:
            varlen = None
            if kernel == "fla" and positions is not None:
                varlen = create_varlen_metadata_for_document(positions, include_host_offsets=True)
            return GDNContext(resets=resets, varlen=varlen)
        if positions is None:
            raise ValueError("context parallelism needs the token positions (the trainer passes them)")
        fla_cp = self._fla_cp_contexts(positions) if kernel == "fla" else None
        return GDNContext(resets=resets, cp=self._cp, fla_cp=fla_cp)

    def _gdn_backend(self) -> str | None:
        for layer in self.layers.values():
            inner = getattr(layer, "_checkpoint_wrapped_module", layer)
            if not inner.full_attn:
                return inner.attn.kernel.impl
        return None

    def _fla_cp_contexts(self, positions: torch.Tensor) -> list:
        """fla's CP metadata per batch row, from the global document starts (one small all-gather)."""
        from fla.ops.cp import build_cp_context  # optional dependency: fla (CUDA kernels)

        cp = self._cp
        gathered = torch.empty(cp.world, *positions.shape, dtype=positions.dtype, device=positions.device)
        dist.all_gather_single(gathered, positions.contiguous().unsqueeze(0), group=cp.group)
        owner = cp.owner()
        n_chain = cp.world * cp.n_parts
        parts = [gathered[r].chunk(cp.n_parts, dim=1)[i] for r, i in (owner[c] for c in range(n_chain))]
        global_pos = torch.cat(parts, dim=1)  # [B, L] in true order
        W = self._conv_kernel_size()
        out = []
        for row in global_pos:
            starts = (row == 0).nonzero(as_tuple=True)[0].to(torch.int32)
            if starts.numel() == 0 or int(starts[0]) != 0:
                starts = torch.cat([starts.new_zeros(1), starts])
            cu = torch.cat([starts, starts.new_tensor([row.numel()])])
            out.append(build_cp_context(cu, group=cp.group, conv1d_kernel_size=W, cu_seqlens_cpu=cu.cpu(),
                                        layout=cp.layout))
        return out

    def _needs_masks(self) -> bool:
        attn = self.config.first_attention
        return attn is not None and isinstance(attn.inner_attention, (FlexAttention.Config, VarlenAttention.Config))

    def _conv_kernel_size(self) -> int:
        for cfg in self.config.layers:
            if cfg.delta_net is not None:
                return cfg.delta_net.conv_kernel_size
        return 4

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks=None,
                **_ignored):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        B, L = h.shape[0], h.shape[1]
        if attention_masks is None and self._cp is None and self._needs_masks():
            # called outside the trainer (which builds masks from positions): causal masks
            pos = positions if positions is not None else torch.arange(L, device=h.device).expand(B, L)
            attention_masks = self.get_attention_masks(pos)
        gdn = self.gdn_context(positions, B, L, h.device)
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions, gdn)
        h = self.norm(h) if self.norm is not None else h
        if self._skip_lm_head:
            return h
        return self.lm_head(h) if self.lm_head is not None else h


def set_text_sharding(config, *, enable_ep: bool) -> None:
    """Sharding configs for EP only (TP is refused): torchtitan's MoE plan on every MoE layer.

    Attention and GatedDeltaNet get none: under CP their sequence sharding is handled by
    apply_cp_to_forward and GDNContext, not by spmd local_maps (which would all-gather K/V a
    second time).
    """
    for layer in config.layers:
        if layer.moe is not None:
            set_moe_sharding_config(layer.moe, enable_ep=enable_ep, enable_sp=False,
                                    expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)


def _partial_dtensor_dims(parallel_dims):
    """The same dims under torchtitan's partial_dtensor backend (meshes incl. the folded ``fsdp``).

    torchtitan 0.3.0 defaults to spmd_types, whose FSDP path needs every parameter annotated
    through per-module sharding configs, and whose Qwen3.5 configs leave CP out. This model
    keeps plain parameters outside MoE and shards them the legacy way; building these meshes
    creates extra process groups over the same ranks once per run.
    """
    if parallel_dims.spmd_backend == "partial_dtensor":
        return parallel_dims
    dims = ParallelDims(dp_replicate=parallel_dims.dp_replicate, dp_shard=parallel_dims.dp_shard,
                        cp=parallel_dims.cp, tp=parallel_dims.tp, pp=parallel_dims.pp, ep=parallel_dims.ep,
                        world_size=parallel_dims.world_size, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def parallelize_qwen35_text(model: Qwen35TextModel, *, parallel_dims, training, parallelism, compile_config,
                            ac_config, dump_folder: str, skip_dp: bool = False):
    """EP (torchtitan's MoE sharding), CP for both layer kinds, activation checkpointing, FSDP2."""
    dims = _partial_dtensor_dims(parallel_dims)
    if dims.cp_enabled:
        balancer = parallelism.context_parallel_load_balancer
        if balancer not in LOAD_BALANCERS:
            raise ValueError(f"unsupported context_parallel_load_balancer {balancer!r} for Qwen3.5")
        mesh = dims.get_mesh("cp")
        devices.prepare_context_parallel()
        # torch shards the BlockMask with its default (head-tail) balancer when torchtitan passes
        # none; keep masks and tokens in the same order.
        compat.set_cp_block_mask_load_balance(balancer == "headtail")
        model.set_context_parallel(CPInfo(group=mesh.get_group(), world=mesh.size(),
                                          rank=mesh.get_local_rank(), layout=LOAD_BALANCERS[balancer]))
        attns = [b.attn.inner_attention for b in model.layers.values() if b.full_attn]
        if attns:
            apply_cp_to_forward(attns, mesh)
    if dims.tp_enabled or dims.ep_enabled:
        model.parallelize(dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=dims)
    if skip_dp:
        return model
    dp_names = ["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]
    edp_mesh = None
    if dims.ep_enabled:
        edp_names = ["dp_replicate", "efsdp"] if dims.dp_replicate_enabled else ["efsdp"]
        edp_mesh = dims.get_optional_mesh(edp_names)
    apply_fsdp_to_decoder(
        model, dims.get_mesh(dp_names),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=dims.pp_enabled, cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        ep_degree=dims.ep, edp_mesh=edp_mesh,
    )
    return model
