"""The values of one rollout record, checked and converted in place: token ids, masks, log-probs,
advantages and the routed experts (``_convert``, ``routed_problem``), each bad value named by its
file, line and field. Shared by the static reader (rollouts.py) and the followed folder (follow.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are made (start-up time)
    import torch


# The ranges a record's values must be in (docs/rl.md, "What a record may contain")
LOGPROB_TOL = 1e-6  # a log-prob is <= 0; this much above 0 is rounding
LOGPROB_MIN = -1e4  # below this a "log-prob" is a unit or sign error (exp(-745) is the smallest positive double)
ADVANTAGE_MAX = 1e6  # |advantage| above this is a scaling error (and overflows the loss in float32)
LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "gen_logprobs")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _first(values, bad) -> tuple[int, object]:
    """The first index and value of ``values`` (a list) where ``bad`` [L] bool tensor is set."""
    j = int(bad.nonzero()[0, 0])
    return j, values[j]


def _convert(where: str, rec: dict, vocab_size: int = 0) -> None:
    """Raise ValueError naming the record (``where``: file:line), the field and the value when a value
    is not what the loader and the losses can train on: token ids are integers in [0, vocab_size),
    loss_mask is 0/1 (a record without a 1 after position 0 is valid: the readers skip it), log-probs are finite and at
    most ``LOGPROB_TOL`` (and at least ``LOGPROB_MIN``) on trained tokens, advantages finite with
    |a| <= ``ADVANTAGE_MAX`` on trained tokens, policy_version an integer >= 0, sequence_id / group_id
    an integer or a string, routed_experts integers of shape [L, n_moe_layers, k]."""
    import torch  # reason: start-up time (the CLI's checks read records without torch)

    def as_tensor(k, dtype=None):
        try:
            return torch.tensor(rec[k], dtype=dtype)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(f"{where}: {k} holds a value that is not a number ({e})") from None

    ids = rec["input_ids"]
    t = as_tensor("input_ids")
    if t.dtype != torch.long:
        j = next((j for j, v in enumerate(ids) if not _is_int(v)), 0)
        raise ValueError(f"{where}: input_ids[{j}] is {ids[j]!r}: token ids are integers")
    if bool((t < 0).any()):
        j, v = _first(ids, t < 0)
        raise ValueError(f"{where}: input_ids[{j}] is {v}: token ids are >= 0")
    if vocab_size and bool((t >= vocab_size).any()):
        j, v = _first(ids, t >= vocab_size)
        raise ValueError(f"{where}: input_ids[{j}] is {v}, outside the model's vocabulary ({vocab_size}): the "
                         "rollouts were tokenized for another model")
    mask = rec["loss_mask"]
    m = as_tensor("loss_mask", torch.float64)
    if not bool(((m == 0) | (m == 1)).all()):
        j, v = _first(mask, ~((m == 0) | (m == 1)))
        raise ValueError(f"{where}: loss_mask[{j}] is {v!r}: loss_mask values are 0 (not trained) or 1 (trained)")
    trained = m.bool().clone()
    trained[0] = False  # position 0 is never predicted
    for k in LOGPROB_FIELDS:
        if rec.get(k) is None:
            continue
        x = as_tensor(k, torch.float64)
        if not bool(torch.isfinite(x).all()):
            j, v = _first(rec[k], ~torch.isfinite(x))
            raise ValueError(f"{where}: {k}[{j}] is {v}: log-probs are finite numbers (also where loss_mask is 0)")
        high, low = trained & (x > LOGPROB_TOL), trained & (x < LOGPROB_MIN)
        if bool(high.any()):
            j, v = _first(rec[k], high)
            raise ValueError(f"{where}: {k}[{j}] is {v}: a log-prob is <= 0 (a probability is at most 1); "
                             "this is a probability, a logit or a sign error")
        if bool(low.any()):
            j, v = _first(rec[k], low)
            raise ValueError(f"{where}: {k}[{j}] is {v}: below {LOGPROB_MIN:g}, not the log-prob of a sampled "
                             "token (a unit or scaling error)")
    adv = rec["advantages"]
    if isinstance(adv, list):
        a = as_tensor("advantages", torch.float64)
        name, values = "advantages[{j}]", adv
    elif isinstance(adv, bool) or not isinstance(adv, (int, float)):
        raise ValueError(f"{where}: advantages is {adv!r}: a number (per sequence) or a list of numbers (per token)")
    else:
        a = torch.full((len(ids),), float(adv), dtype=torch.float64)
        name, values = "advantages", [adv] * len(ids)
    bad = ~torch.isfinite(a) | (trained & (a.abs() > ADVANTAGE_MAX))
    if bool(bad.any()):
        j, v = _first(values, bad)
        raise ValueError(f"{where}: {name.format(j=j)} is {v}: advantages are finite numbers with |a| <= "
                         f"{ADVANTAGE_MAX:g} (a scaling error otherwise; GRPO's are a few units)")
    pv = rec.get("policy_version")
    if pv is not None and (not _is_int(pv) or pv < 0):
        raise ValueError(f"{where}: policy_version must be an integer >= 0, got {pv!r}")
    for k in ("sequence_id", "group_id"):
        v = rec.get(k)
        if v is not None and not (_is_int(v) or isinstance(v, str)):
            raise ValueError(f"{where}: {k} must be an integer or a string, got {v!r}")
    if rec.get("routed_experts") is not None:
        _routed_experts(where, rec)


def routed_problem(where: str, rec: dict, layers: int, top_k: int, experts: int) -> str:
    """Why ``rec`` cannot be replayed on a model of ``layers`` MoE layers, top-k ``top_k`` and
    ``experts`` experts (moe.routing_replay), naming the record and the field; "" when it can."""
    if rec.get("routed_experts") is None:
        return (f"{where}: no routed_experts; moe.routing_replay=true needs routed_experts in every rollout "
                f"record ([L, {layers}, {top_k}]: per token, per MoE layer, the expert ids)")
    try:
        t = _routed_experts(where, rec)
    except ValueError as e:
        return str(e)
    if tuple(t.shape[1:]) != (layers, top_k):
        what = "MoE layers" if t.shape[1] != layers else "experts per token (top-k)"
        return (f"{where}: routed_experts is [L, {t.shape[1]}, {t.shape[2]}], the model wants [L, {layers}, {top_k}] "
                f"({layers} MoE layers, top-k {top_k}): wrong number of {what}; the rollouts were generated by "
                "another model")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= experts:
        bad = lo if lo < 0 else hi
        pos = (t == bad).nonzero()[0].tolist()
        return (f"{where}: routed_experts[{pos[0]}][{pos[1]}][{pos[2]}] is expert id {bad}, outside [0, {experts}) "
                f"(the model has {experts} experts; ids are 0-based per MoE layer)")
    return ""


def _routed_experts(where: str, rec: dict) -> torch.Tensor:
    """The record's ``routed_experts`` as a [L, n_moe_layers, k] long tensor; ValueError naming the
    record when it is ragged, not integer or of another length than ``input_ids``."""
    import torch  # reason: start-up time (the CLI's checks read records without torch)

    v = rec["routed_experts"]
    try:
        t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{t.dtype} values, not integers")
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: routed_experts must be integers of shape [L, n_moe_layers, k] "
                         f"(per token, per MoE layer, the k expert ids the generator used) ({e})") from None
    t = t.long()
    if t.dim() != 3 or t.shape[0] != len(rec["input_ids"]) or t.numel() == 0:
        raise ValueError(f"{where}: routed_experts has shape {list(t.shape)}, expected "
                         f"[{len(rec['input_ids'])}, n_moe_layers, k] (L = len(input_ids))")
    return t
