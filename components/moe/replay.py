"""``moe.routing_replay`` wired by the moe components: the decision, the checks before launch and the
router hooks (every ``moe_chunk`` policy's ``check`` and ``apply`` call ``check`` and ``apply`` here,
after ``moe.lean_combine``'s). The mechanism (hooks, batch consumer, record checks) is
components/moe/routing_replay.py, imported only when replay is on (it imports torchtitan).

The data provides the routed experts: a data format whose batches carry ``REPLAY_KEY`` lists it in
its ``BATCH_KEYS`` (the rollouts format); a followed stream checks each arriving record against
``follow_shape`` (the model's MoE shape, () when replay is off).
"""

from __future__ import annotations

from framework import contracts
from framework.errors import UserError

REPLAY_KEY = "rl_routed_experts"  # the batch key of the routed experts (components/data/rollouts.py RL_KEYS)


def check(options, ctx) -> None:
    """``moe.routing_replay=true`` before launch: data whose batches carry the routed experts; for
    training, an MoE model replay supports, and every (not followed) record's routed_experts fit it."""
    if not options.routing_replay:
        return
    data = ctx.components.get("data")
    if data is not None and REPLAY_KEY not in contracts.member(data, "data", "BATCH_KEYS"):
        raise UserError("moe.routing_replay=true", f"replays the expert routing that rollout records carry "
                        f"(routed_experts), and data.format={ctx.cfg.data.format} has none.",
                        "Set data.format=rollouts with records that carry routed_experts "
                        "(docs/skills/routing_replay.md), or drop moe.routing_replay.")
    if not ctx.for_training:
        return
    from components.moe import routing_replay  # reason: imports torchtitan

    routing_replay.check_model(ctx)
    if not ctx.cfg.data.follow:  # a followed stream's records are checked as they arrive (follow_shape)
        routing_replay.check_data(ctx)


def apply(options, tc) -> None:
    """``moe.routing_replay=true``: the built model's routers follow each batch's routed experts."""
    if not options.routing_replay:
        return
    from components.moe import routing_replay  # reason: imports torchtitan

    routing_replay.install(tc, REPLAY_KEY)


def follow_shape(ctx) -> tuple:
    """(MoE layers, top-k, experts) each record of a followed stream must carry routed_experts for; ()
    when moe.routing_replay is off (the records' routed_experts, if any, are not read)."""
    if not ctx.cfg.moe.routing_replay:
        return ()
    from components.moe import routing_replay  # reason: imports torchtitan

    return routing_replay.moe_shape(ctx)
