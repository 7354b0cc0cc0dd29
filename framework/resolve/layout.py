"""Derive the parallel layout (dp_shard, cp, ep, pp, tp) from the 4D->2D table.

The table (recipes/_defaults.yaml `layout`) is data; this module applies it to the dims
a recipe leaves unset and checks every constraint torchtitan imposes, so that an
impossible layout is a user error before any process starts. ``lay_out`` is what resolve asks of
it: the dims derived, as the chosen state backend runs them, and the batch's split over them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from framework import contracts
from framework.errors import UserError

DIMS = ("dp_replicate", "dp_shard", "cp", "ep", "pp", "tp")


@dataclass
class Layout:
    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    pp: int
    tp: int
    rules: dict[str, str] = field(default_factory=dict)  # dim -> the rule that chose it

    @property
    def dims(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def params_text(n: float) -> str:
    """A parameter count for people: 35.1B, 0.3M (a tiny model is not "0.0B")."""
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def ep_from_table(table, n_params: float) -> int:
    for rule in table.ep_by_params:
        if n_params <= float(rule.max_params):
            return int(rule.ep)
    return int(table.ep_by_params[-1].ep)


def derive(parallel, training, table, facts, world_size: int) -> Layout:
    """Fill unset dims of ``parallel`` for ``world_size`` ranks; raise UserError if impossible."""
    rules: dict[str, str] = {}
    where = f"parallel (world size {world_size})"
    seq = int(training.seq_len)

    def given(name):
        v = getattr(parallel, name)
        if v is not None:
            if int(v) < 1:
                raise UserError(f"parallel.{name}={v}", "parallel degrees must be >= 1.")
            rules[name] = "set by the recipe or command line"
        return v

    dp_rep = int(parallel.dp_replicate)
    if dp_rep < 1:
        raise UserError(f"parallel.dp_replicate={dp_rep}", "parallel degrees must be >= 1 (1: no replicated copies).")
    tp = given("tp")
    if tp is None:
        tp, rules["tp"] = int(table.tp), f"table: TP {table.tp} unless the model or hardware needs it"
    pp = given("pp")
    if pp is None:
        pp, rules["pp"] = int(table.pp), f"table: PP {table.pp} (2 optional)"
    tp, pp = int(tp), int(pp)
    if facts.n_layers % pp and pp > 1:
        raise UserError(f"parallel.pp={pp}", f"PP {pp} does not divide the model's {facts.n_layers} layers.",
                        f"Choose PP among {[d for d in _divisors(facts.n_layers) if d <= 8]}.")
    base = dp_rep * tp * pp
    if world_size % base:
        raise UserError(where, f"dp_replicate x tp x pp = {base} does not divide the world size {world_size}.",
                        "Change the number of GPUs or the fixed dims.")
    room = world_size // base  # ranks left for dp_shard x cp

    cp = given("cp")
    if cp is None:
        want = max(1, math.ceil(seq / int(table.target_local_seq)))
        ok = [d for d in _divisors(room) if d >= want and (d == 1 or seq % (2 * d * (tp if tp > 1 else 1)) == 0)]
        if not ok:
            raise UserError(where, f"CP must be at least {want} to keep the per-GPU sequence at or below "
                            f"{table.target_local_seq} tokens (seq_len {seq}), but no divisor of the "
                            f"{room} rank{'s' if room != 1 else ''} left for dp_shard x cp satisfies that and divides the "
                            "sequence.",
                            "Use more GPUs, a shorter training.seq_len, or " + _explicit_cp(room, seq, tp) + ".")
        cp = ok[0]
        rules["cp"] = (f"table: seq {seq} / target {table.target_local_seq} -> {want}, "
                       f"rounded to a divisor -> {cp} ({seq // cp} tokens per GPU)")
    cp = int(cp)
    if room % cp:
        raise UserError(f"parallel.cp={cp}", f"CP {cp} does not divide the {room} rank{'' if room == 1 else 's'} left after "
                        f"dp_replicate x tp x pp = {base} of world size {world_size}.",
                        f"Choose CP among {_divisors(room)}.")
    if cp > 1 and seq % (2 * cp * (tp if tp > 1 else 1)):
        raise UserError(f"parallel.cp={cp}", f"training.seq_len {seq} is not divisible by 2 x cp"
                        f"{' x tp' if tp > 1 else ''} = {2 * cp * (tp if tp > 1 else 1)} (load-balanced CP "
                        "splits each sequence into 2 x cp chunks).",
                        "Pick a seq_len that is a multiple of it, or another cp.")

    dp_shard = given("dp_shard")
    if dp_shard is None:
        dp_shard, rules["dp_shard"] = room // cp, "the rest: world / (dp_replicate x cp x tp x pp)"
    dp_shard = int(dp_shard)
    product = dp_rep * dp_shard * cp * tp * pp
    if product != world_size:
        raise UserError(where, f"dp_replicate x dp_shard x cp x tp x pp = {dp_rep} x {dp_shard} x {cp} x {tp} x {pp}"
                        f" = {product}, not the world size {world_size}.",
                        "Leave parallel.dp_shard unset to derive it, or change the dims.")

    ep_space = dp_shard * cp * tp  # torchtitan carves EP out of dp_shard x cp x tp
    ep = given("ep")
    if facts.num_experts == 0:
        if ep not in (None, 1):
            raise UserError(f"parallel.ep={ep}", f"{facts.family} {facts.flavor} is a dense model; EP must be 1.")
        ep, rules["ep"] = 1, "dense model: no experts"
    elif ep is None:
        want = ep_from_table(table, facts.n_params)
        if want <= ep_space and ep_space % want == 0 and facts.num_experts % want == 0:
            ep = want
            rules["ep"] = f"table: {params_text(facts.n_params)} total params -> EP {want}"
        elif want > ep_space:
            ep = max(d for d in _divisors(ep_space) if facts.num_experts % d == 0)
            rules["ep"] = (f"table wants EP {want} ({params_text(facts.n_params)} params); only "
                           f"{ep_space} rank{'' if ep_space == 1 else 's'} in dp_shard x cp x tp -> EP {ep}")
        else:
            raise UserError(where, f"the table's EP {want} (for {params_text(facts.n_params)} parameters) does not "
                            f"divide dp_shard x cp x tp = {ep_space} or the {facts.num_experts} experts.",
                            "Use a GPU count that is a multiple of it, or set parallel.ep explicitly.")
    ep = int(ep)
    if ep_space % ep:
        raise UserError(f"parallel.ep={ep}", f"EP {ep} must divide dp_shard x cp x tp = {dp_shard} x {cp} x {tp} = "
                        f"{ep_space} (torchtitan carves EP out of those ranks; world size {world_size}).",
                        f"Choose EP among {[d for d in _divisors(ep_space) if facts.num_experts % d == 0]}.")
    if facts.num_experts and facts.num_experts % ep:
        raise UserError(f"parallel.ep={ep}", f"EP {ep} does not divide the model's {facts.num_experts} experts.",
                        f"Choose EP among {[d for d in _divisors(ep_space) if facts.num_experts % d == 0]}.")
    return Layout(world_size, dp_rep, dp_shard, cp, ep, pp, tp, rules)


def check_batch(training, layout: Layout, parallel=None) -> int:
    """Return gradient-accumulation steps; raise if the global batch does not split, or (``parallel``
    given, with pipeline stages) if the local batch does not split into pipeline microbatches."""
    if parallel is not None and layout.pp > 1:
        lb, mb = int(training.local_batch), int(getattr(parallel, "pp_microbatch_size", 1) or 1)
        if lb % mb:
            raise UserError(f"parallel.pp_microbatch_size={mb}", f"training.local_batch={lb} is not a multiple of it: "
                            f"with parallel.pp={layout.pp} each rank's {lb} sequences per micro-step are cut into "
                            f"pipeline microbatches of pp_microbatch_size sequences, and torchtitan stops every rank "
                            "at start on a remainder.", f"Choose parallel.pp_microbatch_size among {_divisors(lb)} "
                            f"(the divisors of training.local_batch), or a training.local_batch that is a multiple "
                            f"of {mb}.")
    per_step = int(training.local_batch) * layout.dp
    gb = training.global_batch
    if gb is None:
        return 1
    if int(gb) % per_step:
        raise UserError(f"training.global_batch={gb}", f"must be a multiple of local_batch x data-parallel ranks "
                        f"= {training.local_batch} x {layout.dp} = {per_step}.",
                        f"Try training.global_batch={per_step * max(1, int(gb) // per_step)}.")
    return int(gb) // per_step


def backend_layout(ctx: contracts.Context, layout: Layout) -> Layout:
    """``layout`` as the chosen state backend runs it (its optional ``layout`` member): the degrees it
    moves, with its reason as their rule. A backend that changes the world size is a framework bug."""
    runs = contracts.member(ctx.components["state"], "state", "layout")
    if runs is None:
        return layout
    dims, reason = runs(ctx.options["state"], dict(layout.dims))
    changed = {d: int(v) for d, v in dims.items() if int(v) != layout.dims[d]}
    if not changed:
        return layout
    if math.prod(int(v) for v in dims.values()) != math.prod(layout.dims.values()) or set(dims) != set(layout.dims):
        raise ValueError(f"the state backend's layout {dims} does not keep the degrees' product of {layout.dims}")
    return dataclasses.replace(layout, **changed, rules={**layout.rules, **{d: reason for d in changed}})


def lay_out(ctx: contracts.Context, parallel, world_size: int) -> tuple[Layout, int]:
    """The layout of ``ctx``'s run (its config, its model's facts) on ``world_size`` ranks: ``parallel``'s
    unset dims derived, as the state backend runs them, and the gradient accumulation its batch splits into."""
    cfg = ctx.cfg
    layout = backend_layout(ctx, derive(parallel, cfg.training, cfg.layout, ctx.facts, world_size))
    return layout, check_batch(cfg.training, layout, parallel)


def _explicit_cp(room: int, seq: int, tp: int) -> str:
    """The explicit parallel.cp that fits ``room`` ranks and divides the sequence, with the per-GPU
    sequence it accepts (longer than the table's target)."""
    fits = [d for d in _divisors(room) if d == 1 or seq % (2 * d * (tp if tp > 1 else 1)) == 0]
    cp = fits[-1]
    return (f"set parallel.cp={cp} to accept {seq // cp} tokens per GPU (above the table's target; "
            "`apiary plan` says whether that fits memory)")

