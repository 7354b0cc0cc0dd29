"""RL policy losses for the trainer, by name: ``loss=grpo|dapo|gspo|cispo|ppo|sft``.

Each is ``token_logprobs`` (fused LM head, no [tokens, vocab] logits; temperature) followed by the objective of the
same name in ``rl.py``, on batches from the rollout loader (``data.format=rollouts``, see
``components/data/rollout_loader.py``). The options under ``loss.`` are the objective's hyperparameters (defaults as
in rl.py) plus ``temperature`` (use the sampler's) and the LM-head engine settings shared with linear_ce.

Normalisation, so that a step's loss and gradient do not depend on how its rows are split over data-parallel ranks,
context-parallel shards or gradient-accumulation micro-steps: token-level means divide by the step's trained-token
count (the trainer's global valid tokens); sequence-level means weigh each token by 1 / |o_i| (its sequence's trained
tokens, counted by the loader before any split) and divide by the step's sequence count (also from the loader); GSPO's
sequence ratio all-reduces its per-sequence sums over the context-parallel group. The policy metrics (clip fractions,
KL, entropy) are logged with the loss as means over the step's trained tokens, across micro-steps and
data/context-parallel ranks.

Two run-level settings under ``rl.`` act here (docs/skills/tis.md): ``rl.tis_cap=C`` (truncated
importance sampling, passed to the objective as ``tis_cap``) and ``rl.mismatch_threshold`` (the
``policy/mismatch_*`` metrics: the trainer's log-probs of the trained tokens against the generator's,
logged at every step; ``_max`` keys are max-reduced). The generator's log-probs are the rollouts'
``gen_logprobs`` when the records carry them (batch key ``rl_gen_logprobs``; ``old_logprobs`` are
then the trainer-side old policy, and the objective gets them as ``gen_logprobs=``: TIS weighs each
token by min(exp(old - gen), C) and the surrogate keeps its ratio against old), else
``old_logprobs``: the mismatch is about the inference engine's numbers, so the metrics compare
against the engine's whichever field holds them. Records with ``gen_logprobs`` and no
``rl.tis_cap`` are accepted: the objective then ignores them (no weight) and only the metrics use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, Optional

from components.labels import IGNORE_INDEX
from components.losses import linear_ce
from components.losses.linear_ce import EngineOptions, check_backend_here, fused_head_plan_terms
from framework.contracts import PlanTerms
from framework.errors import UserError

RL_DATA_HINT = "data.format=rollouts data.path=ROLLOUTS (jsonl/parquet; format in components/data/rollouts.py)"

Norm = Literal["token", "sequence"]


@dataclass(kw_only=True)
class _Head(EngineOptions):
    """The LM-head engine's options (as linear_ce's) plus the policy head's own."""

    temperature: float = 1.0
    """divides the logits (use the sampler's temperature); > 0"""
    entropy_coef: float = 0.0
    """> 0: subtract entropy_coef x (token mean of the policy's entropy)"""

    def __post_init__(self):
        super().__post_init__()
        for f in fields(self):  # every number of the objective finite (NaN passed every comparison below)
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"loss.{f.name} must be a finite number, got {v}")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0, got {self.temperature}")
        if self.entropy_coef < 0:
            raise ValueError(f"loss.entropy_coef must be >= 0, got {self.entropy_coef}")
        for key in ("eps", "eps_low", "eps_high", "kl_coef"):  # clip ranges and the KL weight
            v = getattr(self, key, None)
            if v is not None and v < 0:
                raise ValueError(f"loss.{key} must be >= 0, got {v}")


_HEAD_FIELDS = {f.name for f in fields(_Head)}


class _Policy:
    """Registry component: ``Options`` (objective hyperparameters + head settings) -> the
    trainer loss ``PolicyLoss``."""

    objective = ""
    NEEDS_DATA: tuple[str, ...] = ("rollouts",)
    POLICY_OBJECTIVE = True  # its loss is no likelihood (the summary reports the reward, no best loss)
    PLAN_CONSTANTS = linear_ce.PLAN_CONSTANTS  # planned on the fused LM-head engine
    SKILL = "rl_objectives"  # docs/skills/rl_objectives.md
    # the rl.* settings this loss acts on (framework/resolve/publishing.py refuses them set with a loss that has none)
    RL_KEYS: tuple[str, ...] = ("tis_cap", "mismatch_threshold")

    objective_keys: tuple[str, ...] = ()  # options that change what is optimised (apiary compare)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        head_fields = (_HEAD_FIELDS - {"temperature", "entropy_coef"}) | {"name"}
        cls.objective_keys = tuple(f.name for f in fields(cls.Options) if f.name not in head_fields)

    @classmethod
    def check(cls, options, ctx=None) -> None:
        """Before launch (ValueError / UserError): option values, and the data this objective trains on."""
        if options.backend == "fwdgrad":
            from components.losses.fused_rl import FUSABLE  # reason: start-up time (torch); only fwdgrad asks

            if cls.objective not in FUSABLE:
                raise ValueError(f"loss={cls.objective} cannot use loss.backend=fwdgrad: its sequence-level ratio "
                                 "needs every token's log-prob before any gradient exists (fused objectives: "
                                 f"{', '.join(FUSABLE)}); use loss.backend=auto (the recompute path)")
        if ctx is None:
            return
        cls._check_rl(ctx)
        check_backend_here(options.backend, ctx)
        seq_norm = getattr(options, "norm", "token") == "sequence"
        if (cls.NEEDS_DATA == ("rollouts",) or seq_norm) and ctx.choice("data") != "rollouts":
            what = ("is a policy objective: it trains on RL rollouts (old log-probs, advantages, loss masks), not "
                    "on text." if cls.NEEDS_DATA == ("rollouts",)
                    else "with loss.norm=sequence needs the rollouts' sequence boundaries.")
            raise UserError(f"loss={cls.objective}", what,
                            "Add data.format=rollouts data.path=ROLLOUTS (jsonl/parquet records with input_ids, "
                            "loss_mask, old_logprobs, advantages; see docs/skills/rl_objectives.md).")
        kl = getattr(options, "kl_coef", 0.0)
        if kl and ctx.shared.records_with_ref is False:
            raise UserError(f"loss.kl_coef={kl}", "needs ref_logprobs in every rollout record.",
                            "Add them with a reference model: apiary logprobs MODEL "
                            f"{ctx.shared.records_path or 'ROLLOUTS'} --out DIR (docs/skills/logprobs.md), then "
                            "train with data.path=DIR; or set loss.kl_coef=0.")

    @classmethod
    def _check_rl(cls, ctx) -> None:
        """rl.tis_cap (> 0, finite; an objective with an importance ratio) and rl.mismatch_threshold (>= 0)."""
        rl_cfg = _rl_settings(ctx)
        cap, thr = rl_cfg.get("tis_cap"), rl_cfg.get("mismatch_threshold", 0.1)
        if cap is not None:
            if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
                raise UserError(f"rl.tis_cap={cap}", "must be a finite number > 0 (the cap C of the truncated "
                                "importance weight min(pi_train / pi_gen, C)).",
                                "For example rl.tis_cap=2, or drop it (~rl.tis_cap) for no correction. "
                                "See docs/skills/tis.md.")
            if cls.objective not in TIS_OBJECTIVES:
                raise UserError(f"rl.tis_cap={cap}", f"loss={cls.objective} has no importance ratio to "
                                "truncate (it trains the log-likelihood of the tokens whoever sampled them).",
                                f"Use one of {', '.join('loss=' + o for o in TIS_OBJECTIVES)}, or drop "
                                "rl.tis_cap. See docs/skills/tis.md.")
        if thr is None or not (isinstance(thr, (int, float)) and math.isfinite(thr) and thr >= 0):
            raise UserError(f"rl.mismatch_threshold={thr}", "must be a finite number >= 0 (|logp_train - logp_gen| above it "
                            "counts in policy/mismatch_frac).", "For example rl.mismatch_threshold=0.1. "
                            "See docs/skills/tis.md.")

    @classmethod
    def apply(cls, options, tc, ctx) -> None:
        hp = {f.name: getattr(options, f.name) for f in fields(cls.Options) if f.name not in _HEAD_FIELDS | {"name"}}
        rl_cfg = _rl_settings(ctx)
        if rl_cfg.get("tis_cap") is not None:
            hp["tis_cap"] = float(rl_cfg["tis_cap"])
        head = {k: getattr(options, k) for k in _HEAD_FIELDS}
        tc.loss = policy_loss_class().Config(objective=cls.objective, hparams=hp,
                                             mismatch_threshold=float(rl_cfg.get("mismatch_threshold", 0.1)),
                                             **head)

    @classmethod
    def plan_terms(cls, opts, ctx) -> PlanTerms:
        """On the fused LM-head engine: planned as linear_ce; the objective is the loss's own."""
        return fused_head_plan_terms(ctx, cls.objective, opts)


TIS_OBJECTIVES = ("grpo", "dapo", "gspo", "cispo", "ppo")  # the objectives with an importance ratio


def _rl_settings(ctx) -> dict:
    """The recipe's ``rl:`` section as a dict (empty without one, e.g. a hand-built context)."""
    cfg = getattr(ctx, "cfg", None)
    section = cfg.get("rl") if cfg is not None and hasattr(cfg, "get") else None
    return dict(section) if section is not None else {}


class GRPO(_Policy):
    objective = "grpo"

    @dataclass(kw_only=True)
    class Options(_Head):
        name: str = "grpo"
        """registry name"""
        eps: float = 0.2
        """PPO clip range"""
        kl_coef: float = 0.0
        """k3 KL to the reference policy (needs ref_logprobs)"""
        norm: Norm = "sequence"
        """token: mean over the step's trained tokens | sequence: per-sequence mean"""


class DAPO(_Policy):
    objective = "dapo"

    @dataclass(kw_only=True)
    class Options(_Head):
        name: str = "dapo"
        """registry name"""
        eps_low: float = 0.2
        """lower clip range"""
        eps_high: float = 0.28
        """upper clip range (clip-higher)"""
        norm: Norm = "token"
        """token: mean over the step's trained tokens | sequence: per-sequence mean"""


class GSPO(_Policy):
    objective = "gspo"

    @dataclass(kw_only=True)
    class Options(_Head):
        name: str = "gspo"
        """registry name"""
        eps_low: float = 3e-4
        """lower clip range of the sequence ratio"""
        eps_high: float = 4e-4
        """upper clip range of the sequence ratio"""


class CISPO(_Policy):
    objective = "cispo"

    @dataclass(kw_only=True)
    class Options(_Head):
        name: str = "cispo"
        """registry name"""
        eps_low: Optional[float] = None
        """lower clip of the importance weight (None: no lower clip)"""
        eps_high: float = 0.28
        """upper clip of the importance weight"""
        norm: Norm = "token"
        """token: mean over the step's trained tokens | sequence: per-sequence mean"""


class PPO(_Policy):
    objective = "ppo"

    @dataclass(kw_only=True)
    class Options(_Head):
        name: str = "ppo"
        """registry name"""
        eps: float = 0.2
        """clip range"""
        eps_high: Optional[float] = None
        """upper clip range (None: eps)"""
        kl_coef: float = 0.0
        """KL to the reference policy (needs ref_logprobs)"""
        norm: Norm = "token"
        """token: mean over the step's trained tokens | sequence: per-sequence mean"""


class SFT(_Policy):
    """Also trains on text data (every label is a trained token): the same loss as ce."""

    objective = "sft"
    NEEDS_DATA, POLICY_OBJECTIVE = ("text", "rollouts"), False  # a likelihood, as ce

    @dataclass(kw_only=True)
    class Options(_Head):
        name: str = "sft"
        """registry name"""
        norm: Norm = "token"
        """token: mean over the step's trained tokens | sequence: per-sequence mean (needs rollouts)"""


def policy_loss(self, h, w, labels, global_valid_tokens):
    """Policy objective on fused token log-probs; normalised over the whole optimizer step."""
    import torch  # reason: start-up time (`train --help` reads the Options without torch)

    from components.losses import rl  # reason: start-up time (torch)
    from components.losses.logprob import token_logprobs  # reason: start-up time (torch)

    cfg = self.config
    batch = self.batch or {}
    hp = dict(cfg.hparams)
    with_entropy = cfg.entropy_coef > 0
    if _use_fused(cfg, h, w):
        return _fused(self, h, w, labels, global_valid_tokens, batch, hp)
    lp, ent = token_logprobs(h, w, labels.reshape(-1), temperature=cfg.temperature, with_entropy=with_entropy,
                             backend=cfg.backend, chunk_tokens=cfg.chunk_tokens, chunk_vocab=cfg.chunk_vocab,
                             workspace_mb=cfg.workspace_mb)
    lp = lp.reshape(labels.shape)
    mask = labels != IGNORE_INDEX
    zeros = torch.zeros_like(lp)
    old = batch.get("rl_old_logprobs", zeros).float()
    adv = batch.get("rl_advantages", zeros).float()
    ref = batch.get("rl_ref_logprobs")
    if cfg.objective not in ("sft",) and "rl_old_logprobs" not in batch:
        raise ValueError(f"loss={cfg.objective} needs rollouts (old log-probs, advantages): {RL_DATA_HINT}")
    if hp.get("kl_coef", 0.0) > 0 and ref is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs in every rollout record")
    kw = {"sequence_ids": batch.get("rl_sequence_ids")}
    seq_level = cfg.objective == "gspo" or hp.get("norm") == "sequence"
    if seq_level:
        if "rl_num_seqs" not in batch:
            raise ValueError(f"loss={cfg.objective} with sequence-level normalisation needs rollouts: {RL_DATA_HINT}")
        kw["normalizer"] = batch["rl_num_seqs"].reshape(-1)[0].float()
        if cfg.objective == "gspo":
            kw["seq_group"] = self.seq_group
        else:
            kw["seq_tokens"] = batch["rl_seq_tokens"]
    elif global_valid_tokens is not None:
        kw["normalizer"] = global_valid_tokens.float()
    gen = _gen(batch)
    if gen is not None and cfg.objective in TIS_OBJECTIVES:
        kw["gen_logprobs"] = gen
    loss, metrics = rl.objective(cfg.objective)(lp, old, adv, mask, ref, **hp, **kw)
    if "rl_old_logprobs" in batch:  # the trainer's log-probs of the trained tokens against the generator's
        metrics = {**metrics, **rl.mismatch_metrics(lp, old if gen is None else gen, mask, _threshold(cfg))}
    if with_entropy:  # entropy bonus: a token mean over the step's trained tokens, like the token-level losses
        den = global_valid_tokens.float() if global_valid_tokens is not None else mask.sum()
        ent_sum = (ent.reshape(labels.shape) * mask).sum()
        loss = loss - cfg.entropy_coef * ent_sum / den.clamp_min(1)
        metrics = {**metrics, "entropy": ent_sum.detach() / mask.sum().clamp_min(1)}
    # detached scalars, each a mean over this micro-step's local tokens (or sequences); the trainer
    # weighs them by the local trained tokens over the step's micro-steps and ranks when it logs
    self.metrics, self.metric_weight = metrics, mask.sum().detach()
    return loss


def _gen(batch: dict):
    """The inference engine's log-probs when the rollouts carry ``gen_logprobs`` (else None)."""
    gen = batch.get("rl_gen_logprobs")
    return gen.float() if gen is not None else None


def _threshold(cfg) -> float:
    return float(getattr(cfg, "mismatch_threshold", 0.1))


def _use_fused(cfg, h, w) -> bool:
    """backend fwdgrad, or auto where linear_ce's auto would pick it (CUDA, a gradient wanted, the
    buffers fit), for the objectives that fuse (not GSPO)."""
    from components.losses.fused_rl import FUSABLE  # reason: start-up time (torch)
    from components.losses.linear_ce import auto_backend  # reason: start-up time (torch)

    if cfg.objective not in FUSABLE:
        return False
    if cfg.backend == "fwdgrad":
        return True
    if cfg.backend != "auto":
        return False
    return auto_backend(h, w, "sum", cfg.logits_dtype, cfg.dw_accum, cfg.chunk_tokens) == "fwdgrad"


def _batch_args(cfg, batch, labels, hp):
    import torch  # reason: start-up time (`train --help` reads the Options without torch)

    mask = labels != IGNORE_INDEX
    zeros = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    old = batch.get("rl_old_logprobs", zeros).float()
    adv = batch.get("rl_advantages", zeros).float()
    ref = batch.get("rl_ref_logprobs")
    if cfg.objective not in ("sft",) and "rl_old_logprobs" not in batch:
        raise ValueError(f"loss={cfg.objective} needs rollouts (old log-probs, advantages): {RL_DATA_HINT}")
    if hp.get("kl_coef", 0.0) > 0 and ref is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs in every rollout record")
    return mask, old, adv, ref


def _fused(self, h, w, labels, global_valid_tokens, batch, hp):
    """The same objective with the gradient computed in the forward (components/losses/fused_rl.py)."""
    from components.losses.fused_rl import fused_policy_loss  # reason: start-up time (torch)

    cfg = self.config
    mask, old, adv, ref = _batch_args(cfg, batch, labels, hp)
    kw = {"sequence_ids": batch.get("rl_sequence_ids")}
    if hp.get("norm") == "sequence":
        if "rl_num_seqs" not in batch:
            raise ValueError(f"loss={cfg.objective} with sequence-level normalisation needs rollouts: {RL_DATA_HINT}")
        kw["normalizer"] = batch["rl_num_seqs"].reshape(-1)[0].float()
        kw["seq_tokens"] = batch["rl_seq_tokens"]
    elif global_valid_tokens is not None:
        kw["normalizer"] = global_valid_tokens.float()
    den = global_valid_tokens.float() if global_valid_tokens is not None else None
    loss, metrics = fused_policy_loss(
        h.reshape(*labels.shape, h.shape[-1]), w, labels, cfg.objective, old, adv, mask, ref, hparams=hp,
        temperature=cfg.temperature, entropy_coef=cfg.entropy_coef, entropy_den=den, **kw,
        logits_dtype=cfg.logits_dtype, dw_accum=cfg.dw_accum, chunk_tokens=cfg.chunk_tokens,
        mismatch_threshold=_threshold(cfg) if "rl_old_logprobs" in batch else None,
        gen_logprobs=_gen(batch) if cfg.objective in TIS_OBJECTIVES else None)
    self.metrics, self.metric_weight = metrics, mask.sum().detach()
    return loss


def set_batch(self, batch: dict, seq_group=None) -> None:
    """The trainer hands over this micro-step's rl_* tensors (already context-sharded) and the
    group a sequence's tokens are split over (context parallelism; None without)."""
    self.batch, self.seq_group = batch, seq_group


def policy_loss_class():
    from components.losses.lm_head import head_loss  # reason: start-up time (torch, torchtitan)

    return head_loss.subclass("PolicyLoss", policy_loss, {
        "objective": "grpo", "hparams": {}, "temperature": 1.0, "entropy_coef": 0.0,
        "mismatch_threshold": 0.1},
        {"batch": None, "seq_group": None, "metrics": {}, "metric_weight": None, "set_batch": set_batch})


# apiary compare: how runs differing in a policy loss or its options are held to each other. Another
# objective, or one of its hyperparameters (objective_keys), is a deliberate change; the head's
# engine settings (backend, chunks, dtypes) are another kernel of the same math. SFT is the same
# masked NLL as ce, so switching between them is not a change of objective.
for _loss in (GRPO, DAPO, GSPO, CISPO, PPO, SFT):
    _loss.NUMERICS = {"": "dtype" if _loss is SFT else "any",
                      **{f.name: "any" if f.name in _loss.objective_keys else "dtype"
                         for f in fields(_loss.Options) if f.name != "name"}}
