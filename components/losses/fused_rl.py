"""RL objectives with the gradient computed in the forward (backend ``fwdgrad``, fwdgrad.py):
``fused_policy_loss`` = ``token_logprobs`` + the objective of ``rl.py``, in three GEMM-sized
passes and without a recompute.

Why it works: for PPO, GRPO, DAPO, CISPO and SFT the loss is ``sum_t w_t f(lp_t; old_t, A_t,
ref_t)`` (+ the entropy bonus ``-coef sum_t m_t H_t / den``), where the token weights ``w_t``
(mask, 1/|o_i|, normalisation counts) do not depend on the log-probs. So once a token chunk's
log-sum-exp is known, ``g_t = w_t f'(lp_t)`` is known, and the logit gradient is
``g_t (onehot - p) - g_ent,t p (s - E_p[s])``: the row kernel writes it in the forward. Nothing
is re-derived here: ``w_t`` is the gradient of rl.py's own reduction with respect to its
per-token input (it is linear in it), and ``f'`` is autograd through rl.py's objective on the
chunk's [T] log-probs with ``w`` as the mask (norm="token", normalizer 1). The loss value and
the metrics are rl.py's objective on the full (detached) log-probs, so they equal the unfused
path's. Without the entropy term the logit gradient is ``-g_t`` times cross-entropy's, so the
single fused cross-entropy kernel runs and ``-g_t`` scales the [T, H] sides of the gradient
GEMMs (``fwdgrad.run(scale_fn=...)``); with it, a statistics and a gradient kernel.

GSPO is not fused: its sequence ratio exp(mean_t(lp_t - old_t)) needs every token of a
sequence (on every context-parallel shard) before any token's gradient exists; a two-phase
version would recompute the logits (the recompute path's four passes). ``loss=gspo`` keeps
``token_logprobs`` (backend auto -> the recompute path) and refuses backend=fwdgrad.
"""

from __future__ import annotations

import inspect

import torch

from components.labels import IGNORE_INDEX
from components.losses import rl
from components.losses.lm_head import engine, fwdgrad

FUSABLE = ("grpo", "dapo", "cispo", "ppo", "sft")


def _default_norm(name: str) -> str:
    return inspect.signature(rl.objective(name)).parameters["norm"].default


def token_weights(mask, norm, sequence_ids=None, normalizer=None, seq_tokens=None) -> torch.Tensor:
    """w_t = d reduce(x) / d x_t of rl.py's reduction (linear in x), shaped like mask."""
    m = mask.float()
    x = torch.zeros_like(m, requires_grad=True)
    with torch.enable_grad():
        r = rl.reduce_tokens(x, m, norm, sequence_ids, normalizer, seq_tokens)
        (wt,) = torch.autograd.grad(r, x)
    return wt


def fused_policy_loss(hidden, weight, labels, objective: str, old_logprobs, advantages, loss_mask,
                      ref_logprobs=None, *, hparams: dict | None = None, temperature: float = 1.0,
                      entropy_coef: float = 0.0, entropy_den=None, sequence_ids=None, normalizer=None,
                      seq_tokens=None, vocab_group=None, ignore_index: int = IGNORE_INDEX,
                      logits_dtype: str = "bfloat16", dw_accum: str = "float32", chunk_tokens: int = 4096,
                      mismatch_threshold: float | None = None, gen_logprobs=None):
    """(loss, metrics) of ``rl.objective(objective)`` on the log-probs of ``hidden @ weight^T /
    temperature`` at ``labels``, minus ``entropy_coef * sum(entropy * mask) / entropy_den`` (den
    defaults to mask.sum()), with dH, dW computed in the forward. Per-token tensors are shaped
    like ``labels`` ([B, T] or [N]); advantages per token or per row. The same numbers as
    ``token_logprobs`` + ``rl.objective`` (tests/test_linear_ce_fwdgrad.py). ``hparams`` may hold
    ``tis_cap`` (truncated importance sampling: rl.py applies it per chunk, so ``g_t`` carries the
    weight). ``mismatch_threshold`` not None: the metrics add ``rl.mismatch_metrics`` of the
    detached log-probs against ``old_logprobs`` (no extra pass: the [N] log-probs exist anyway).
    ``gen_logprobs`` (shaped like ``labels``; not for sft): the inference engine's log-probs, passed to
    the objective per chunk as old_logprobs are (the decoupled TIS form, rl.tis_weights), and the
    mismatch metrics compare against them instead of ``old_logprobs``."""
    if objective not in FUSABLE:
        raise ValueError(f"loss={objective} cannot use backend=fwdgrad (fusable: {', '.join(FUSABLE)}); GSPO's "
                         "sequence ratio needs every token's log-prob before any gradient: use backend=auto")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    hp = dict(hparams or {})
    fn = rl.objective(objective)
    norm = hp.pop("norm", _default_norm(objective))
    if ref_logprobs is None and hp.get("kl_coef", 0.0) > 0:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    shape = labels.shape
    h, w, lab = engine.as_2d(hidden, weight, labels)
    shard = engine.vocab_shard(w, vocab_group)
    dev = h.device
    like = torch.zeros(shape, device=dev, dtype=torch.float32)
    old = old_logprobs.float().reshape(shape) if old_logprobs is not None else like
    adv = rl.advantages_like(advantages.float(), like) if advantages is not None else like
    m = loss_mask.reshape(shape) if loss_mask is not None else torch.ones_like(like, dtype=torch.bool)
    ref = ref_logprobs.float().reshape(shape) if ref_logprobs is not None else None
    if gen_logprobs is not None and objective == "sft":
        raise ValueError("gen_logprobs: loss=sft has no importance ratio to weigh")
    gen = gen_logprobs.float().reshape(shape) if gen_logprobs is not None else None
    wt = token_weights(m, norm, sequence_ids, normalizer, seq_tokens).reshape(-1)
    with_ent = entropy_coef > 0
    den = m.sum() if entropy_den is None else torch.as_tensor(entropy_den, device=dev)
    den = den.float().clamp_min(1)
    g_ent_all = (-entropy_coef * m.float() / den).reshape(-1) if with_ent else None
    old_f, adv_f = old.reshape(-1), adv.reshape(-1)
    ref_f = ref.reshape(-1) if ref is not None else None
    gen_f = gen.reshape(-1) if gen is not None else None
    valid = lab != ignore_index

    def coef_fn(t0, t1, lse, tgt, mean_s):
        lp = torch.where(valid[t0:t1], tgt - lse, torch.zeros_like(lse)).detach().requires_grad_(True)
        with torch.enable_grad():
            gkw = {} if gen_f is None else {"gen_logprobs": gen_f[t0:t1]}
            val, _ = fn(lp, old_f[t0:t1], adv_f[t0:t1], wt[t0:t1], ref_f[t0:t1] if ref_f is not None else None,
                        **hp, **gkw, norm="token", normalizer=1.0)
            (g_lp,) = torch.autograd.grad(val, lp)
        g_lp = torch.where(valid[t0:t1], g_lp, torch.zeros_like(g_lp))
        a, b, c = -g_lp, None, g_lp
        if with_ent:
            g_ent = g_ent_all[t0:t1]
            a = a + g_ent * mean_s
            b = -g_ent
        return a, b, c, torch.zeros_like(lse)

    def scale_fn(t0, t1, lse, tgt):  # no entropy term: G = -g_lp (p - onehot) / T, cross-entropy's G scaled
        a, _, _, _ = coef_fn(t0, t1, lse, tgt, None)
        return a  # a = -g_lp

    grad_on = torch.is_grad_enabled()
    need_dh, need_dw = grad_on and h.requires_grad, grad_on and w.requires_grad
    with torch.no_grad():
        res = fwdgrad.run(h.detach(), w.detach(), lab, shard=shard, ignore_index=ignore_index,
                          inv_temp=1.0 / float(temperature), coef_fn=coef_fn,
                          scale_fn=None if with_ent else scale_fn, need_ps=with_ent, need_dh=need_dh,
                          need_dw=need_dw, logits_dtype=logits_dtype, dw_accum=dw_accum, chunk_tokens=chunk_tokens)
    with torch.no_grad():
        lp = torch.where(valid, res.target - res.lse, torch.zeros_like(res.lse)).reshape(shape)
        kw = dict(hp, norm=norm) if gen is None else dict(hp, norm=norm, gen_logprobs=gen)
        value, metrics = fn(lp, old, advantages.float() if advantages is not None else adv, m, ref, **kw,
                            sequence_ids=sequence_ids, normalizer=normalizer, seq_tokens=seq_tokens)
        if with_ent:
            ent = (res.lse - res.mean_s).reshape(shape)
            ent_sum = (ent * m).sum()
            value = value - entropy_coef * ent_sum / den
            metrics = {**metrics, "entropy": ent_sum / m.sum().clamp_min(1)}
        if mismatch_threshold is not None and old_logprobs is not None:
            metrics = {**metrics, **rl.mismatch_metrics(lp, old if gen is None else gen, m, mismatch_threshold)}
    if need_dh or need_dw:
        value = fwdgrad.StoredGrads.apply(h, w, value, res)
    return value, metrics
