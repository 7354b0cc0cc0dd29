"""data.format=rollouts: RL rollout records (input_ids, loss_mask, old_logprobs, advantages; jsonl or
parquet) for the policy losses, read once (components/data/rollouts.py) or followed as a generator
writes them (data.follow=true, components/data/follow.py); the rl.* settings they bring. The text
format and what both formats share: components/data/formats.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from components.data.formats import DataOptions, _check_common, _tokenizer
from components.data.rollout_sources import rollout_files
from components.data.rollouts import RL_KEYS, STEP_KEYS, RolloutIndex, pack_rows, source
from components.moe import replay
from framework.errors import UserError

_MAX_LAG = 2 ** 63 - 1  # int64: the trainer's version is a step count
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# validation.* on a rollout run: what it would do, and what to do (validation.steps: ``ignored_keys``, so that
# framework/resolve/needs.py names this before it asks for validation.interval)
_NO_VALIDATION = ("validation computes the language-model loss on held-out text; this run trains a policy on rollouts "
                  "(data.format=rollouts), where it has no meaning")
_DROP_VALIDATION = "Drop the validation.* keys (policy metrics are in metrics.jsonl as policy/*)."


def _check_rollout_settings(d: DataOptions, ctx) -> None:
    """Settings a rollout run refuses before anything is read (``--cfg job`` refuses them as the launch
    does): pipeline parallelism, keys that would be ignored, and follow mode's values (a data.name given
    with data.follow=true: framework/resolve/needs.py's _NEEDS)."""
    cfg = ctx.cfg
    pp = ctx.layout.pp if ctx.layout is not None else int(cfg.parallel.pp or 1)
    if pp > 1:
        raise UserError("data.format=rollouts", f"policy training runs without pipeline parallelism (parallel.pp="
                        f"{pp}).", "Set parallel.pp=1.")
    if d.sharding != "blocks":
        raise UserError(f"data.sharding={d.sharding}", "splits text documents over the data-parallel ranks; rollout "
                        "rows are always dealt in blocks (global row g goes to rank (g // training.local_batch) % dp, "
                        "every rank planning the same rows), so the setting would be ignored.",
                        "Drop data.sharding (or set data.sharding=blocks).")
    v = cfg.validation
    given = [f"validation.{k}={v[k]}" for k in ("interval", "path", "fraction") if v[k]]
    if given:
        followed = (" (and a followed stream has no end, so no last fraction to hold out)"
                    if d.follow and v.fraction else "")
        raise UserError(" ".join(given), f"{_NO_VALIDATION}{followed}.", _DROP_VALIDATION)
    if not d.follow:
        return
    if d.path is None:
        raise UserError("data.follow=true", "needs data.path, the folder a generator writes rollout shards into.",
                        "Set data.path=DIR (docs/rl.md: write NAME.tmp, then rename to NAME.jsonl).")
    if _URL.match(str(d.path)):
        raise UserError(f"data.path={d.path}", "is a URL; with data.follow=true data.path is the folder a generator "
                        "writes rollout shards into, read as a local path (or one on a shared file system), so the "
                        f"trainer would wait for a local folder named {Path(str(d.path))} that no generator writes.",
                        "Have the generator write into a local or shared folder (an object store mounted as a file "
                        "system will do) and set data.path to that folder's path.")
    if d.num_workers != 0:
        raise UserError(f"data.num_workers={d.num_workers}", "with data.follow=true the rollouts are read in the "
                        "training process (it waits for shards between steps and its position is checkpointed "
                        "at step boundaries).", "Set data.num_workers=0.")
    if not 0 < d.wait_timeout < math.inf:
        raise UserError(f"data.wait_timeout={d.wait_timeout}", "must be a finite number of seconds > 0 (how long the "
                        "trainer waits for a step's rollouts before it checkpoints and exits 77).",
                        "Set data.wait_timeout=3600, for example; to wait as long as it takes, give a large number "
                        "(data.wait_timeout=1e9 is about 32 years): a signal (SIGTERM, Ctrl-C) still stops the wait "
                        "with a checkpoint (exit 75).")
    lag = cfg.rl.max_lag
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= _MAX_LAG):
        raise UserError(f"rl.max_lag={lag}", "must be an integer from 0 to 2**63-1 (versions a record may lag the "
                        "trainer's; the trainer's version is a step count).", "Set rl.max_lag=1, for example; for "
                        "no limit, drop it or set rl.max_lag=null (every record is kept, whatever its version).")


def _check_follow(d: DataOptions, ctx) -> None:
    """data.follow=true at launch: the folder the trainer reads shards from as they appear (the generator
    makes it; nothing is created here, so a refused launch leaves nothing behind). Its settings were
    checked by _check_rollout_settings."""
    p = Path(str(d.path))
    if p.exists() and not p.is_dir():
        raise UserError(f"data.path={p}", "is a file; with data.follow=true it names the folder a generator "
                        "writes rollout shards into.", "Point data.path at a folder, or drop data.follow.")
    # the shards' records are checked as they arrive (a malformed one stops the run at its step,
    # naming file and line, with the position of the last complete step saved)
    ctx.shared.records_with_ref = None
    ctx.summary.append(f"data: rollouts followed in {p} (shards in name order; waiting up to "
                       f"{d.wait_timeout:g} s for each step's rows)")


def _rollouts_line(index: RolloutIndex, path, packaged: bool) -> str:
    """The run's `data:` line for a rollouts file or folder read whole (data.follow=false)."""
    files = index.files
    where = f"{files[0]}" if len(files) == 1 else f"{path} ({len(files)} files)"
    rewards = sum(r is not None for r in index.rewards)
    n = len(index.lengths)
    extras = ["a reward each" if rewards == n else f"a reward in {rewards:,}" if rewards else "",
              "ref_logprobs" if index.with_ref else "",
              "gen_logprobs" if index.with_gen else ""]
    return (f"data: {'packaged' if packaged else 'local'} rollouts {where}: {n:,} records, "
            f"{sum(index.lengths):,} tokens" + "".join(f", {e}" for e in extras if e))


class Rollouts:
    """RL rollouts (token ids, loss masks, old log-probs, advantages), packed into windows."""

    Options = DataOptions
    NUMERICS = {"": "any"}  # apiary compare: other data trains another model
    BATCH_KEYS = RL_KEYS
    STEP_KEYS = STEP_KEYS

    @staticmethod
    def check(options: DataOptions, ctx) -> None:
        """Rollout files exist, parse, fit seq_len and the vocabulary."""
        _check_common(options, ctx)
        _check_rollout_settings(options, ctx)
        d, cfg = options, ctx.cfg
        path = source(d.name, d.path)
        if path is None and not d.follow:  # the keys alone: `train --cfg job` refuses what a launch would
            raise UserError("data.format=rollouts", f"needs data.path (data.name={d.name} names no packaged "
                            "rollouts).", "Set data.path to a rollout .jsonl/.parquet file or a folder of them.")
        if not ctx.for_training:
            return
        if d.follow:
            _check_follow(d, ctx)
            return
        try:
            files = rollout_files(path)
        except ValueError as e:
            raise UserError(f"data.path={path}", f"{e}.", "Remove that entry or replace it with the file.") from None
        if not files:
            raise UserError(f"data.path={path}", "no .jsonl or .parquet rollout file there.",
                            "Point data.path at a rollout file or a folder of them.")
        try:
            index = RolloutIndex(path, validate=True, vocab_size=int(ctx.facts.vocab_size))
            pack_rows(index.lengths, cfg.training.seq_len, index.where)
        except (ValueError, OSError) as e:
            msg = f"{e}.".replace("pack_to", "training.seq_len")
            fix = ("Raise training.seq_len above the longest sequence, or leave the longer records out."
                   if "do not fit" in msg else
                   "Fix the records (docs/rl.md, \"What a record may contain\"), or leave them out.")
            raise UserError(f"data.path={path}", msg, fix) from None
        ctx.summary.append(_rollouts_line(index, path, packaged=d.path is None))  # what trains, as text runs say
        if index.untrained:  # records that train no token: skipped, said here
            more = f" (and {len(index.untrained) - 3} more)" if len(index.untrained) > 3 else ""
            ctx.summary.append(f"data: {len(index.untrained)} record(s) with no loss_mask=1 token after position 0 "
                               f"skipped (they train nothing): {', '.join(index.untrained[:3])}{more}")
        if index.skipped:  # duplicates (the same record twice): trained once, said here
            more = f" (and {len(index.skipped) - 3} more)" if len(index.skipped) > 3 else ""
            ctx.summary.append(f"data: {len(index.skipped)} duplicate(s) skipped, each trained once: "
                               f"{'; '.join(index.skipped[:3])}{more}")
        ctx.shared.records_with_ref = bool(index.with_ref)  # a loss with a KL term needs them
        ctx.shared.records_path = str(path)

    @staticmethod
    def summary(options: DataOptions, ctx) -> str:
        return ""

    @staticmethod
    def ignored_keys(options: DataOptions, ctx) -> dict[str, tuple[str, str]]:
        """validation.steps (the other validation.* keys: _check_rollout_settings); data.name, once data.path is
        set and the rollouts are not followed: the records are read from data.path alone (data.name=packaged
        names the packaged rollouts only when data.path is unset); followed, framework/resolve/needs.py's
        _NEEDS refuses it."""
        out = {"validation.steps": (_NO_VALIDATION, _DROP_VALIDATION)}
        if options.follow or options.path is None:
            return out
        return {**out, "data.name": (f"rollouts are read from data.path={options.path} alone (data.name names a text "
                                     "dataset, or data.name=packaged the packaged rollouts when data.path is unset)",
                                     "Drop data.name (the rollouts come from data.path).")}

    @staticmethod
    def apply(options: DataOptions, tc, ctx) -> None:
        from components.data.rollout_loader import RolloutDataLoader  # reason: imports torchtitan

        cfg = ctx.cfg
        g = cfg.training.global_batch
        lag = cfg.rl.max_lag
        # moe.routing_replay (components/moe/replay.py): the MoE shape each arriving record's routed_experts must fit
        routing = replay.follow_shape(ctx) if options.follow else ()
        tc.dataloader = RolloutDataLoader.Config(path=source(options.name, options.path),
                                                 num_workers=options.num_workers,
                                                 global_batch=g if g is not None else -1,
                                                 follow=bool(options.follow), max_lag=-1 if lag is None else int(lag),
                                                 publish_interval=int(cfg.publish.interval),
                                                 vocab_size=int(ctx.facts.vocab_size), routing=routing)
        tc.follow_wait_timeout = float(options.wait_timeout) if options.follow else 0.0
        _tokenizer(options, tc, ctx)
        tc.batch_keys, tc.step_keys = Rollouts.BATCH_KEYS, Rollouts.STEP_KEYS
