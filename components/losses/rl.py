"""RL policy objectives on per-token log-probabilities (from ``logprob.token_logprobs``).

Every objective is a function

    fn(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *, <hyperparameters>,
       sequence_ids=None, normalizer=None, seq_tokens=None) -> (loss, metrics)

on [B, T] tensors (or [N]; every per-token tensor the same shape). ``loss_mask`` (bool or 0/1)
selects the tokens that are trained (the response tokens). ``advantages`` is per token, or per
row ([B], broadcast over T). ``sequence_ids`` ([B, T] ints, < 0 for padding) marks several
sequences packed in one row; without it each row is one sequence. ``normalizer`` replaces the
local denominator (token count for token-level means, sequence count for sequence-level ones)
by a global one, e.g. the valid-token count summed over data- and context-parallel ranks, so
that summing the local losses over ranks gives the global objective. ``loss`` is a scalar to
minimise; ``metrics`` are detached scalars (clip fractions, KL).

Sequences split over ranks (context parallelism): ``seq_tokens`` ([B, T], per token the number
of trained tokens of its whole sequence, counted before the split) makes the sequence-level
means exact on any shard: a token contributes x_t / |o_i|, so a sequence's tokens sum to its
mean wherever they live, and ``normalizer`` is then the global sequence count. GSPO's
sequence ratio also needs the other shards' log-prob sums: ``seq_group`` (a process group,
with ``sequence_ids`` numbered the same on every member) all-reduces them, differentiably.

Notation: r_t = exp(logp_t - logp_old_t) (per-token importance ratio), A = advantage,
clip(x, a, b) = min(max(x, a), b), sg = stop-gradient, |o_i| = tokens of sequence i.

Truncated importance sampling (TIS, Yao et al. 2025; docs/skills/tis.md): ``tis_cap=C`` weighs
each token's policy-gradient term by ``w_t = min(exp(logp_old_t - logp_gen_t), C)`` (sg), the
trainer's old policy over the generator's. With ``gen_logprobs`` given, logp_old are the
``old_logprobs`` and the surrogate keeps its ratio r_t against them. Without it (apiary's rollouts
carry one field, the generator's log-probs, as ``old_logprobs``) the records' old_logprobs ARE
logp_gen and the trainer's old policy is the current one (lag 0): ``w_t = min(exp(sg(logp_t) -
old_t), C)`` and the surrogate's ratio is taken against sg(logp_t) (value 1, gradient of logp_t),
so that pi_train / pi_gen is applied once, through w_t, and not a second time through r_t.
``mismatch_metrics`` measures how far the trainer's log-probs are from the generator's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce


def _mask(loss_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return loss_mask.to(like.dtype)


def advantages_like(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages per token, in ``like``'s dtype and shape (a per-sequence [B] is broadcast)."""
    a = advantages.to(like.dtype)
    if a.dim() == like.dim() - 1:
        a = a.unsqueeze(-1)
    return a.expand_as(like)


def _token_mean(x: torch.Tensor, m: torch.Tensor, normalizer) -> torch.Tensor:
    """sum(x * m) / (normalizer or sum(m)): every token of the batch weighs the same."""
    den = m.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=x.dtype, device=x.device)
    return (x * m).sum() / den.clamp_min(1)


def _segments(m: torch.Tensor, sequence_ids: torch.Tensor | None, group=None):
    """Flat segment index per token (one segment per sequence) and the segment count; with
    ``group``, numbered the same on every member (the widest row of sequences across it)."""
    rows = m.shape[0] if m.dim() > 1 else 1
    m2 = m.reshape(rows, -1)
    if sequence_ids is None:
        seg = torch.arange(rows, device=m.device)[:, None].expand_as(m2)
        return seg.reshape(-1), rows
    sid = sequence_ids.reshape(rows, -1).long()
    width = int(sid.max().item()) + 1 if sid.numel() else 1
    if group is not None:
        w = torch.tensor([width], device=m.device)
        dist.all_reduce(w, op=dist.ReduceOp.MAX, group=group)
        width = int(w.item())
    seg = torch.arange(rows, device=m.device)[:, None] * width + sid.clamp_min(0)
    seg = torch.where(sid >= 0, seg, torch.zeros_like(seg))
    return seg.reshape(-1), rows * width


def _segment_sum(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seg, x.reshape(-1))


def _sequence_mean(x, m, sequence_ids, normalizer, seq_tokens=None):
    """mean over sequences of (mean over the sequence's masked tokens): GRPO's 1/G sum_i 1/|o_i| sum_t."""
    if seq_tokens is not None:  # shard-local: each token carries its share of its sequence's mean
        w = m / seq_tokens.to(x.dtype).clamp_min(1)
        den = w.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=x.dtype, device=x.device)
        return (x * w).sum() / torch.as_tensor(den, dtype=x.dtype).clamp_min(1)
    seg, n = _segments(m, sequence_ids)
    tok = _segment_sum(m, seg, n)
    per_seq = _segment_sum(x * m, seg, n) / tok.clamp_min(1)
    has = tok > 0
    den = has.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=x.dtype, device=x.device)
    return (per_seq * has).sum() / torch.as_tensor(den, dtype=x.dtype).clamp_min(1)


def reduce_tokens(x, m, norm: str, sequence_ids, normalizer, seq_tokens=None):
    """Per-token values ``x`` (mask ``m``) -> the loss: a token mean (``norm="token"``) or a mean
    over sequences of each sequence's token mean (``norm="sequence"``)."""
    if norm == "token":
        return _token_mean(x, m, normalizer)
    if norm == "sequence":
        return _sequence_mean(x, m, sequence_ids, normalizer, seq_tokens)
    raise ValueError(f"norm must be token or sequence, got {norm!r}")


def _kl_k3(logprobs, ref_logprobs):
    """k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def tis_weights(logprobs, old_logprobs, tis_cap, gen_logprobs=None, mask=None):
    """Truncated importance sampling: (the log-probs the surrogate's ratio is taken against, the
    per-token weight w_t (detached; None without a cap), metrics).

    ``gen_logprobs`` given: ``(old_logprobs, min(exp(old - gen), C))`` (the decoupled form: trainer's
    old policy over the generator's). Not given: ``old_logprobs`` are the generator's, so
    ``(sg(logp), min(exp(sg(logp) - old), C))`` (the current trainer policy over the generator's: at lag 0
    exactly the trainer-inference mismatch correction)."""
    if tis_cap is None:
        return old_logprobs, None, {}
    if not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    with torch.no_grad():
        if gen_logprobs is None:
            old_eff = logprobs.detach()
            log_w = old_eff - old_logprobs
        else:
            old_eff = old_logprobs
            log_w = old_logprobs - gen_logprobs.to(logprobs.dtype)
        raw = torch.exp(log_w)
        w = torch.clamp(raw, max=float(tis_cap))
        metrics = {}
        if mask is not None:
            m = _mask(mask, logprobs)
            n = m.sum().clamp_min(1)
            metrics = {"tis_weight_mean": (w * m).sum() / n,
                       "tis_capped_frac": ((raw > tis_cap).to(m.dtype) * m).sum() / n}
    return old_eff, w, metrics


def mismatch_metrics(logprobs, gen_logprobs, loss_mask, threshold: float = 0.1) -> dict:
    """How far the trainer's log-probs of the sampled tokens are from the generator's, over the
    trained tokens (detached; d_t = gen_t - logp_t):

        mismatch_abs_mean = mean |d|, mismatch_abs_max = max |d| (0 without tokens),
        mismatch_kl = mean (exp(-d) - 1 + d), the k3 estimator of KL(pi_gen || pi_train) on tokens
                      sampled from the generator (unbiased there; >= 0; = d^2 / 2 to second order),
        mismatch_frac = fraction of tokens with |d| > threshold.

    Means over this call's tokens (the trainer weighs them by tokens over micro-steps and ranks;
    a ``_max`` key is max-reduced)."""
    with torch.no_grad():
        lp = logprobs.detach().double()
        d = gen_logprobs.detach().double().reshape(lp.shape) - lp
        m = loss_mask.reshape(lp.shape).bool()
        n = m.sum().clamp_min(1).double()
        a = torch.where(m, d.abs(), torch.zeros_like(d))
        k3 = torch.where(m, torch.expm1(-d) + d, torch.zeros_like(d))
        out = {"mismatch_abs_mean": a.sum() / n,
               "mismatch_abs_max": a.max() if a.numel() else a.sum(),
               "mismatch_kl": k3.sum() / n,
               "mismatch_frac": (m & (d.abs() > threshold)).double().sum() / n}
    return {k: v.float() for k, v in out.items()}


def _clip_metrics(ratio, lo, hi, m):
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        low = ((ratio < lo).to(m.dtype) * m).sum() / n
        high = ((ratio > hi).to(m.dtype) * m).sum() / n
    return {"clip_low_frac": low, "clip_high_frac": high}


def ppo(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *, eps: float = 0.2,
        eps_high: float | None = None, kl_coef: float = 0.0, norm: str = "token", sequence_ids=None,
        normalizer=None, seq_tokens=None, tis_cap: float | None = None, gen_logprobs=None):
    """PPO clipped surrogate (Schulman et al. 2017), per token:

        L = -mean_t [ min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t) ] + kl_coef * mean_t KL_t

    eps_high defaults to eps. KL_t is the k3 estimator exp(ref - logp) - (ref - logp) - 1, used
    only when kl_coef > 0 (needs ref_logprobs). norm="token" averages over all masked tokens of
    the batch; "sequence" averages per sequence, then over sequences. tis_cap / gen_logprobs:
    the surrogate term is weighted by TIS's w_t (``tis_weights``; the KL term is not).
    """
    m = _mask(loss_mask, logprobs)
    hi = eps if eps_high is None else eps_high
    a = advantages_like(advantages, logprobs)
    old_logprobs, tis_w, tis_m = tis_weights(logprobs, old_logprobs, tis_cap, gen_logprobs, loss_mask)
    ratio = torch.exp(logprobs - old_logprobs)
    surr = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + hi) * a)
    per_tok = -surr if tis_w is None else -(tis_w * surr)
    metrics = {**_clip_metrics(ratio, 1 - eps, 1 + hi, m), **tis_m}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = _kl_k3(logprobs, ref_logprobs)
        per_tok = per_tok + kl_coef * kl
        metrics["kl_mean"] = _token_mean(kl.detach(), m, None)
    loss = reduce_tokens(per_tok, m, norm, sequence_ids, normalizer, seq_tokens)
    return loss, metrics


def grpo(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *, eps: float = 0.2,
         kl_coef: float = 0.0, norm: str = "sequence", sequence_ids=None, normalizer=None,
         seq_tokens=None, tis_cap: float | None = None, gen_logprobs=None):
    """GRPO (Shao et al. 2024, DeepSeekMath): PPO-clip on group-normalised advantages
    (A_i = (R_i - mean_group R) / std_group R, see ``group_advantages``) with an optional KL
    penalty to a reference policy, averaged per sequence then over the G sequences:

        L = -1/G sum_i 1/|o_i| sum_t [ min(r A_i, clip(r, 1 - eps, 1 + eps) A_i) - kl_coef * KL_t ]

    KL_t = exp(ref - logp) - (ref - logp) - 1 (k3). norm="token" gives the token-level variant.
    """
    return ppo(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs, eps=eps, kl_coef=kl_coef,
               norm=norm, sequence_ids=sequence_ids, normalizer=normalizer, seq_tokens=seq_tokens,
               tis_cap=tis_cap, gen_logprobs=gen_logprobs)


def dapo(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *, eps_low: float = 0.2,
         eps_high: float = 0.28, norm: str = "token", sequence_ids=None, normalizer=None,
         seq_tokens=None, tis_cap: float | None = None, gen_logprobs=None):
    """DAPO (Yu et al. 2025): clip-higher with decoupled ranges and token-level normalisation,
    no KL term:

        L = -1 / sum_i |o_i| * sum_i sum_t min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

    (Dynamic sampling and overlong reward shaping are data-side: filter groups whose rewards
    are all equal, and shape rewards, before writing the rollouts.) ref_logprobs is ignored.
    """
    del ref_logprobs
    return ppo(logprobs, old_logprobs, advantages, loss_mask, None, eps=eps_low, eps_high=eps_high,
               norm=norm, sequence_ids=sequence_ids, normalizer=normalizer, seq_tokens=seq_tokens,
               tis_cap=tis_cap, gen_logprobs=gen_logprobs)


def gspo(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *, eps_low: float = 3e-4,
         eps_high: float = 4e-4, sequence_ids=None, normalizer=None, seq_tokens=None,
         seq_group=None, tis_cap: float | None = None, gen_logprobs=None):
    """GSPO (Zheng et al. 2025): a sequence-level importance ratio, the geometric mean of the
    token ratios over the sequence's masked tokens, clipped per sequence:

        s_i = exp( 1/|o_i| sum_t (logp_t - logp_old_t) )
        L   = -1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    A_i is the sequence's advantage (mean of its per-token advantages, which are constant over
    a sequence in GRPO-style rollouts). The defaults (3e-4, 4e-4) are the paper's. The gradient
    flows through s_i (the GSPO, not the GSPO-token, variant). ref_logprobs is ignored.

    Split sequences: with ``seq_group`` the per-sequence sums are all-reduced over the group (the
    log-ratio sum differentiably), and each member's loss holds the sequence terms in proportion
    to the tokens it has, so the members' losses add up to L. ``seq_tokens`` is not needed.

    tis_cap: sequence-level TIS on GSPO's geometric mean, each sequence term weighted by
    ``min(exp(1/|o_i| sum_t log w_t), C)`` with log w_t the token log-weights of ``tis_weights``
    (without gen_logprobs: sg(logp_t) - old_t, and s_i is taken against sg(logp), value 1).
    """
    del ref_logprobs, seq_tokens
    m = _mask(loss_mask, logprobs)
    a = advantages_like(advantages, logprobs)
    seg, n = _segments(m, sequence_ids, seq_group)
    local_tok = _segment_sum(m, seg, n)
    raw_old = old_logprobs
    old_logprobs, _, _ = tis_weights(logprobs, old_logprobs, tis_cap, gen_logprobs)
    log_sum = _segment_sum((logprobs - old_logprobs) * m, seg, n)
    a_sum = _segment_sum(a.detach() * m, seg, n)
    tok = local_tok
    lw_sum = None
    if tis_cap is not None:  # the token log-weights, summed per sequence (detached)
        gen = raw_old if gen_logprobs is None else gen_logprobs.to(logprobs.dtype)
        lw_sum = _segment_sum((old_logprobs.detach() - gen) * m, seg, n)
    if seq_group is not None:
        tok, a_sum = local_tok.clone(), a_sum.clone()
        dist.all_reduce(tok, group=seq_group)
        dist.all_reduce(a_sum, group=seq_group)
        log_sum = all_reduce(log_sum, group=seq_group)
        if lw_sum is not None:
            dist.all_reduce(lw_sum, group=seq_group)
    has = tok > 0
    s = torch.exp(log_sum / tok.clamp_min(1))
    a_seq = a_sum / tok.clamp_min(1)
    per_seq = -torch.minimum(s * a_seq, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a_seq)
    tis_m = {}
    if lw_sum is not None:
        raw_w = torch.exp(lw_sum / tok.clamp_min(1))
        seq_w = torch.clamp(raw_w, max=float(tis_cap))
        per_seq = per_seq * seq_w
        hs = has.to(s.dtype)
        ns = hs.sum().clamp_min(1)
        tis_m = {"tis_weight_mean": (seq_w * hs).sum() / ns, "tis_capped_frac": ((raw_w > tis_cap) * hs).sum() / ns}
    share = local_tok / tok.clamp_min(1)  # 1 without a group
    den = has.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=s.dtype, device=s.device)
    loss = (per_seq * share * has).sum() / torch.as_tensor(den, dtype=s.dtype).clamp_min(1)
    hm = has.to(s.dtype)
    metrics = {**_clip_metrics(s, 1 - eps_low, 1 + eps_high, hm), **tis_m}
    return loss, metrics


def cispo(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, *, eps_low: float | None = None,
          eps_high: float = 0.28, norm: str = "token", sequence_ids=None, normalizer=None,
          seq_tokens=None, tis_cap: float | None = None, gen_logprobs=None):
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight, so
    every token keeps a gradient (PPO's clip zeroes the gradient of clipped tokens):

        L = -1 / sum_i |o_i| * sum_i sum_t sg( clip(r_t, 1 - eps_low, 1 + eps_high) ) A_t logp_t

    eps_low=None: no lower bound (the paper sets it large). eps_high=0.28 is this project's
    default, not a published value: tune it. ref_logprobs is ignored. tis_cap / gen_logprobs: each
    term also weighted by TIS's w_t (``tis_weights``; without gen_logprobs r_t = 1, so w_t alone).
    """
    del ref_logprobs
    m = _mask(loss_mask, logprobs)
    a = advantages_like(advantages, logprobs)
    old_logprobs, tis_w, tis_m = tis_weights(logprobs, old_logprobs, tis_cap, gen_logprobs, loss_mask)
    ratio = torch.exp(logprobs - old_logprobs).detach()
    lo = 0.0 if eps_low is None else 1 - eps_low
    w = torch.clamp(ratio, min=lo, max=1 + eps_high)
    if tis_w is not None:
        w = w * tis_w
    per_tok = -(w * a * logprobs)
    metrics = {**_clip_metrics(ratio, lo, 1 + eps_high, m), **tis_m}
    return reduce_tokens(per_tok, m, norm, sequence_ids, normalizer, seq_tokens), metrics


def sft(logprobs, old_logprobs=None, advantages=None, loss_mask=None, ref_logprobs=None, *,
        norm: str = "token", sequence_ids=None, normalizer=None, seq_tokens=None):
    """Supervised fine-tuning: masked negative log-likelihood, L = -sum_t m_t logp_t / sum_t m_t.
    old_logprobs, advantages and ref_logprobs are ignored."""
    del old_logprobs, advantages, ref_logprobs
    m = torch.ones_like(logprobs) if loss_mask is None else _mask(loss_mask, logprobs)
    return reduce_tokens(-logprobs, m, norm, sequence_ids, normalizer, seq_tokens), {}


OBJECTIVES: dict[str, Callable] = {"grpo": grpo, "dapo": dapo, "gspo": gspo, "cispo": cispo, "ppo": ppo, "sft": sft}


def objective(name: str) -> Callable:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown RL objective {name!r}; known: {', '.join(OBJECTIVES)}") from None


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantages: (R_i - mean_g R) / (std_g R + eps) within each group g of
    responses to one prompt (std with Bessel's correction; scale=False keeps R_i - mean, as in
    Dr. GRPO). rewards, group_ids: [G_total]."""
    r = rewards.double()
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    k = len(uniq)
    cnt = torch.zeros(k, dtype=r.dtype).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(k, dtype=r.dtype).index_add_(0, inv, r) / cnt
    out = r - mean[inv]
    if scale:
        var = torch.zeros(k, dtype=r.dtype).index_add_(0, inv, out * out) / (cnt - 1).clamp_min(1)
        out = out / (var.sqrt()[inv] + eps)
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
