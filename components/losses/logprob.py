"""Fused token log-probabilities (and entropy) for RL: ``token_logprobs(hidden, weight, labels)``
gives log p(label) under softmax(hidden @ weight^T / temperature) without [tokens, vocab]
logits, on the same engine and backends as linear_ce (``lm_head.engine``: Triton/cuBLAS vocabulary
slices in a bounded workspace on CUDA, chunked fp32 torch elsewhere).

Per token with s = (h @ W^T) / T, lse = logsumexp(s):

    logprob = s_y - lse                     (0 where label == ignore_index)
    entropy = lse - sum_v p_v s_v           (p = softmax(s); defined for every token)

Backward (recompute-in-backward, see linear_ce.py for why) with upstream g_lp, g_ent per token:

    dL/ds_v = g_lp * (onehot(y) - p_v) - g_ent * p_v * (s_v - E_p[s]),   dL/dz = dL/ds / T

The weight gradient is skipped when ``weight.requires_grad`` is False (frozen head, LoRA), and
the hidden gradient when hidden does not require grad. ``vocab_group``: vocabulary rows split
over a process group (labels global); the per-token reductions are all-reduced ([N] vectors,
never [N, V]) and the hidden gradient is all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.labels import IGNORE_INDEX
from components.losses.lm_head import engine


@dataclass
class _Cfg:
    ignore_index: int
    inv_temp: float
    with_entropy: bool
    shard: engine.Shard
    backend: str
    chunk_tokens: int
    chunk_vocab: int
    workspace_mb: float


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, cfg: _Cfg):
        st = engine.statistics(h, w, labels, shard=cfg.shard, ignore_index=cfg.ignore_index,
                          inv_temp=cfg.inv_temp, need_sum=False, need_ps=cfg.with_entropy,
                          backend=cfg.backend, chunk_tokens=cfg.chunk_tokens, chunk_vocab=cfg.chunk_vocab,
                          workspace_mb=cfg.workspace_mb)
        valid = labels != cfg.ignore_index
        lp = torch.where(valid, st.target - st.lse, torch.zeros_like(st.lse))
        if cfg.with_entropy:
            ent = st.lse - st.mean_s
            mean_s = st.mean_s
        else:
            ent = lp.new_zeros(0)
            mean_s = lp.new_zeros(0)
            ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(h, w, labels, st.lse, mean_s)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, labels, lse, mean_s = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return None, None, None, None
        valid = labels != cfg.ignore_index
        g_lp = torch.zeros_like(lse) if g_lp is None else torch.where(valid, g_lp.float(), torch.zeros_like(lse))
        a = -g_lp
        c = g_lp
        b = None
        if cfg.with_entropy and g_ent is not None:
            g_ent = g_ent.float()
            a = a + g_ent * mean_s
            b = -g_ent
        d = torch.zeros_like(lse)
        dh, dw = engine.gradients(h, w, labels, lse, a, b, c, d, shard=cfg.shard, ignore_index=cfg.ignore_index,
                             inv_temp=cfg.inv_temp, need_dh=need_dh, need_dw=need_dw, backend=cfg.backend,
                             chunk_tokens=cfg.chunk_tokens, chunk_vocab=cfg.chunk_vocab,
                             workspace_mb=cfg.workspace_mb)
        return dh, dw, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, *,
                   ignore_index: int = IGNORE_INDEX, vocab_group=None, backend: str = "auto",
                   chunk_tokens: int = 4096, chunk_vocab: int = 16384, workspace_mb: float = 256.0):
    """Return ``(logprobs, entropy | None)``, each shaped like ``labels``, fp32.

    hidden [..., H], weight [V_local, H], labels [...] with global ids; ``temperature`` divides
    the logits (use the sampler's temperature so logprobs match the rollout engine's).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if backend == "fwdgrad":
        raise ValueError("token_logprobs returns per-token log-probs whose upstream gradient is per token; "
                         "backend='fwdgrad' (gradient in the forward) needs the objective itself: use "
                         "components.losses.fused_rl.fused_policy_loss, or backend='auto'")
    shape = labels.shape
    h, w, lab = engine.as_2d(hidden, weight, labels)
    cfg = _Cfg(ignore_index, 1.0 / float(temperature), bool(with_entropy), engine.vocab_shard(w, vocab_group),
               engine.check_backend(backend, h), int(chunk_tokens), int(chunk_vocab), float(workspace_mb))
    lp, ent = _TokenLogprobs.apply(h, w, lab, cfg)
    return lp.reshape(shape), (ent.reshape(shape) if with_entropy else None)
