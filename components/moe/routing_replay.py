"""MoE routing replay (``moe.routing_replay=true``, docs/skills/routing_replay.md): every MoE layer
routes each token to the experts the rollouts' generator used, so the trainer's log-probs of the
sampled tokens are those of the generator's routing.

Rollout records carry ``routed_experts`` [L, n_moe_layers, k] (per token, per MoE layer in model
order, the k expert ids; the routing of the token at that index as an input). The rollout loader
hands them to the trainer as ``rl_routed_experts`` [B, T, n_moe_layers, k] (-1 at padding), the
trainer context-shards them like the tokens and calls the batch consumer this module registers on
the model (``framework.contracts.add_batch_consumer``), which keeps layer i's ids [B, T_local, k]
on the i-th ``MoE`` module until the next micro-batch (so a recompute in backward sees them too).

A forward hook on each ``MoE.router`` (torchtitan's ``TokenChoiceTopKRouter``) replaces its
output when ids are set: ``selected ids`` = the given ids (padding, -1, keeps the router's own),
``top_scores`` = the router's scores (after its score function) gathered at those ids, then its
``route_norm`` and ``route_scale`` exactly as the router does, so the gate weights still carry the
router's gradient. ``MoE.forward`` derives the per-expert token counts, the load-balancing
statistics (``tokens_per_expert_E``, hence the expert-bias update) and the EP dispatch from the
returned ids, so all of them follow the replayed routing; chunked experts (``moe.chunk``) consume
the same router output. Expert bias only ever picks ids, so it has no effect on replayed tokens.

``capture(model)`` records the routing a forward chose ([B, T, n_moe_layers, k]) for tests and
for generators that run a torchtitan model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
from torchtitan.models.common.moe import MoE

from components.data.rollout_values import routed_problem
from components.data.rollouts import RolloutIndex, source
from framework import contracts
from framework.errors import UserError

FIELD = "routed_experts"  # the rollout record's field
_IDS = "_apiary_replay_ids"  # on each MoE module: [B, T_local, k] long, or None
_ROUTING = "_apiary_routing"  # on the model: its Routing
SKILL = "docs/skills/routing_replay.md"


def moe_layers(model: torch.nn.Module) -> list[MoE]:
    """The model's MoE modules in forward order (the order of ``routed_experts``' layer axis)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class Routing:
    """The replay / capture state of one model (``attach``)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("moe.routing_replay: the model has no MoE layer")
        self.top_k = self.layers[0].router.top_k
        self.num_experts = self.layers[0].router.num_experts
        self.captured: dict | None = None  # layer index -> ids, while capturing
        for i, m in enumerate(self.layers):
            setattr(m, _IDS, None)
            m.router.register_forward_hook(self._hook(i, m))

    def _hook(self, i: int, moe: MoE):
        def hook(router, args, output):
            top_scores, top_ids, scores = output
            ids = getattr(moe, _IDS, None)
            replayed = ids is not None
            if replayed:
                if ids.shape != top_ids.shape:
                    raise RuntimeError(f"moe.routing_replay: MoE layer {i} routes {list(top_ids.shape)} "
                                       f"[B, T, k] tokens, the batch's routed_experts give {list(ids.shape)}")
                pad = (ids < 0).any(-1, keepdim=True)  # padding: the router's own choice
                top_ids = torch.where(pad, top_ids, ids).contiguous()
                # as TokenChoiceTopKRouter.forward: scores after the score function, gathered,
                # normalised (route_norm) and scaled; the same ops in the same order
                top_scores = scores.gather(dim=-1, index=top_ids)
                if router.route_norm:
                    top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
                top_scores = top_scores * router.route_scale
            if self.captured is not None and i not in self.captured:  # first call (not a recompute)
                self.captured[i] = top_ids.detach().clone()
            return (top_scores, top_ids, scores) if replayed else None

        return hook

    def set_replay(self, ids: torch.Tensor | None) -> None:
        """The batch consumer: this micro-batch's [B, T_local, n_moe_layers, k] ids (None: the batch
        has none, which stops the run: replay was asked for)."""
        if ids is None:
            raise RuntimeError(f"moe.routing_replay=true, but this batch's records carry no {FIELD} (written "
                               f"after the check before launch?); see {SKILL}")
        n, k = len(self.layers), self.top_k
        if ids.dim() != 4 or ids.shape[2] != n or ids.shape[3] != k:
            raise RuntimeError(f"moe.routing_replay: routed_experts of shape {list(ids.shape)}, the model wants "
                               f"[B, T, {n} MoE layers, top-k {k}]")
        if bool(((ids < -1) | (ids >= self.num_experts)).any()):  # one small reduction per micro-batch
            raise RuntimeError(f"moe.routing_replay: an expert id in routed_experts is outside "
                               f"[0, {self.num_experts})")
        ids = ids.long()
        for i, m in enumerate(self.layers):
            setattr(m, _IDS, ids[:, :, i, :])

    def clear(self) -> None:
        for m in self.layers:
            setattr(m, _IDS, None)


def attach(model: torch.nn.Module) -> Routing:
    """The model's Routing (installed once: a forward hook on every MoE layer's router)."""
    routing = model.__dict__.get(_ROUTING)
    if routing is None:
        routing = Routing(model)
        model.__dict__[_ROUTING] = routing
    return routing


def replay(model: torch.nn.Module, ids: torch.Tensor | None) -> None:
    """Route ``model``'s next forwards by ``ids`` [B, T, n_moe_layers, k] (None: the router decides)."""
    routing = attach(model)
    if ids is None:
        routing.clear()
    else:
        routing.set_replay(ids)


class Captured:
    ids: torch.Tensor | None = None  # [B, T, n_moe_layers, k] long, after the ``with`` block


@contextmanager
def capture(model: torch.nn.Module):
    """``with capture(model) as c: model(tokens, ...)``: ``c.ids`` is the routing the forward used
    ([B, T, n_moe_layers, k], layers in forward order; the replayed ids where replay is on)."""
    routing = attach(model)
    out = Captured()
    routing.captured = {}
    try:
        yield out
    finally:
        got, routing.captured = routing.captured, None
    if len(got) != len(routing.layers):
        raise RuntimeError(f"capture: {len(got)} of {len(routing.layers)} MoE layers ran")
    out.ids = torch.stack([got[i] for i in range(len(got))], dim=2)


def install(tc, key: str) -> None:
    """At apply time: the model the trainer builds gets the router hooks (before torchtitan's
    parallelize wraps its blocks for recompute / FSDP) and the batch consumer of ``key`` (the batch
    key of the routed experts, components/moe/replay.py ``REPLAY_KEY``)."""
    spec = tc.model_spec
    inner = spec.parallelize_fn

    def parallelize(model, **kwargs):
        routing = attach(model)
        out = inner(model, **kwargs)
        contracts.add_batch_consumer(out if out is not None else model, key, routing.set_replay)
        return out

    tc.model_spec = replace(spec, parallelize_fn=parallelize)


# ------------------------------------------------------------------ before launch


def moe_shape(ctx) -> tuple[int, int, int]:
    """(MoE layers, top-k, experts) of the recipe's model (0, 0, 0 for a dense one)."""
    facts = ctx.facts
    if not getattr(facts, "num_experts", 0):
        return 0, 0, 0
    n = getattr(facts, "n_moe_layers", None)
    if n is None:  # count them in the model config (a family may mix dense and MoE layers)
        family, options = ctx.components["model"], ctx.options["model"]
        config = family.model_spec(options.flavor, **family.model_kwargs(options, ctx)).model
        n = sum(1 for _ in config.traverse(MoE.Config))
    return int(n), int(facts.top_k), int(facts.num_experts)


def check_model(ctx) -> tuple[int, int, int]:
    """Refuse replay on a dense model or a layout it does not support; the model's MoE shape."""
    n, k, e = moe_shape(ctx)
    if n == 0:
        raise UserError("moe.routing_replay=true", f"the model ({ctx.cfg.model.family} {ctx.cfg.model.flavor}) "
                        "has no MoE layers, so there is no routing to replay.",
                        "Drop moe.routing_replay, or train an MoE model.")
    if ctx.layout is not None and getattr(ctx.layout, "tp", 1) > 1:
        raise UserError("moe.routing_replay=true", "is not supported with tensor parallelism (the router's "
                        "scores are DTensors there).", "Set parallel.tp=1.")
    return n, k, e


def check_data(ctx) -> None:
    """The recipe's rollout records (``data.path``, not followed) against the model's MoE shape. Data
    that cannot be read is left to the data component's check, which names the problem."""
    path = source(ctx.cfg.data.name, ctx.cfg.data.path)
    try:
        index = RolloutIndex(path) if path is not None else None
    except (ValueError, OSError, KeyError, TypeError):  # malformed: the data check's to report
        return
    if index is not None:
        check_records(index, ctx, path)


def check_records(index, ctx, path: str) -> None:
    """Every record has ``routed_experts`` of shape [L, n_moe_layers, k] with ids in [0, experts)
    (reads the records once more; only with moe.routing_replay=true). Followed shards are checked as
    they arrive (components/data/follow.py), with the same rules (``rollouts.routed_problem``)."""
    n, k, e = check_model(ctx)
    for i in range(len(index.lengths)):
        problem = routed_problem(index.where(i), index.fetch(i), n, k, e)
        if problem:
            index.close()
            raise UserError("moe.routing_replay=true", f"{problem} (data.path={path}).",
                            f"Write {FIELD} [L, {n}, {k}] per record with this model's generator (see {SKILL}), "
                            "or drop moe.routing_replay.")
    index.close()
