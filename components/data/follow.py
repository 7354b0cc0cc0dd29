"""Follow mode (``data.format=rollouts data.follow=true``): train on rollout shards as a generator
writes them into ``data.path``, each record exactly once.

The writer's convention (docs/rl.md): write a shard as ``NAME.tmp`` (or a dot-file ``.NAME.jsonl``),
then rename it to ``NAME.jsonl`` / ``NAME.parquet``; shard names sort in the order they are written
(a zero-padded counter: ``000017.jsonl``). The trainer reads only renamed shards, in name order, and
never a file that is still being written.

Rows: records are packed into ``seq_len`` rows in order, as the static reader packs them, except
that a row never spans two shards (so a shard's rows depend on that shard alone). A step takes
``global_batch`` consecutive rows, which may span shards. Records whose ``policy_version`` is more
than ``rl.max_lag`` versions behind the trainer's version are dropped (counted per step). The
trainer's version at step s (1-based) is the step of the weights it last published before it:
``((s - 1) // publish.interval) * publish.interval``, or ``s - 1`` when it does not publish.

Position: ``(shard name, record index)`` of the first record not yet consumed, at a step boundary;
it is the dataset's state in the checkpoint, so a resumed run continues with the next record. A
step's rows are planned only when all of them can be formed from the shards present (``ready``),
so a rank never waits in the middle of a step. Every rank plans the same rows from the same shards
(planning depends on the records and the step alone) and keeps those of its data-parallel rank.

Reading the folder's shards and noticing what changed under the trainer: components/data/follow_shards.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from components.data.follow_shards import ShardWatch, StepPlan, ready_shards, record_id
from components.data.rollout_sources import record_where
from components.data.rollouts import (
    _id_key,
    build_rows,
    duplicate_error,
    mean_reward,
    record_reward,
    trainer_sample,
    trains_a_token,
)


class FollowRows(ShardWatch, IterableDataset, Stateful):
    NOUN = "rollouts"  # framework/contracts/protocols.py FollowedData
    LEDGER = "rollouts.jsonl"

    def __init__(self, path: str, *, seq_len: int, dp_rank: int, dp_world_size: int, local_batch: int,
                 global_batch: int, max_lag: int | None = None, publish_interval: int = 0, vocab_size: int = 0,
                 poll_s: float = 0.2, routing: tuple | None = None):
        self.dir = Path(path)
        self.seq_len, self.rank, self.world, self.block, self.step_rows = (seq_len, dp_rank, dp_world_size,
                                                                          local_batch, global_batch)
        self.max_lag, self.interval, self.vocab, self.poll_s = max_lag, publish_interval, vocab_size, poll_s
        self.routing = tuple(routing) if routing else None  # moe.routing_replay: (MoE layers, top-k, experts)
        self.pos: tuple[str, int] = ("", 0)  # (shard name, next record index): everything before is consumed
        self._pos_len: int | None = 0  # records in the position's shard (None: not known)
        self._g = 0  # global rows consumed (all ranks'), a multiple of step_rows between steps
        self._plan: StepPlan | None = None
        self._cache: dict[str, list] = {}  # shard name -> [(line, record)], read once, dropped once passed
        self._known: set[str] = set()  # shard names seen by this process (the first listing: all of them)
        self._listed = False
        self._reports: dict[int, dict] = {}
        self._note = ""
        self._held = ""  # what the folder holds of the step waited for ("": nothing)
        self.with_ref: bool | None = None
        self.with_gen: tuple[bool, str] | None = None  # (gen_logprobs present, the first record's file:line)
        # what the trainer has read, to name shards changed under it and records it would train twice
        self._idents: dict[str, tuple] = {}  # shard name -> (inode, size, mtime) when it was read
        self._digests: dict[str, bytes] = {}  # shard name -> digest of its bytes when it was read
        self._seen: dict[str, tuple[str, int]] = {}  # sequence_id key -> (shard, line) of records passed
        self._seen_digests: dict[bytes, str] = {}  # digest -> shard name of shards entered
        self._gone: set[str] = set()  # shards reported as deleted
        self._said: set[str] = set()  # warnings printed once
        self._resumed = False
        self._resumed_with: set[str] = set()  # a resumed run's shards present at its first listing
        self._passed: set[str] | None = None  # a resumed run's: shards before its position the run had listed

    # -- versions ----------------------------------------------------------------------------
    def version(self, step: int) -> int:
        """The trainer's policy version while it trains 1-based step ``step``."""
        done = step - 1
        return (done // self.interval) * self.interval if self.interval > 0 else done

    # -- planning ----------------------------------------------------------------------------
    def _plan_step(self, k: int) -> StepPlan | None:
        """The rows of 0-based step ``k`` from ``self.pos``, or None while the shards present do not fill it."""
        version = self.version(k + 1)
        rows, cur, used = [], [], 0
        dropped, lags, shards, missing, stale_pv = 0, [], [], [], set()
        first_name, first_idx = self.pos
        end = None
        plan = StepPlan(step=k, rows=rows, end=None)
        listed = ready_shards(self.dir)
        names = {f.name for f in listed}
        if not self._listed and self._resumed:
            self._history(listed)
        self._changes(listed, names, plan)
        missing += plan.gone
        duplicates, ahead, untrained = [], {}, {}
        for f in listed:
            if f.name not in self._known:
                self._known.add(f.name)
                if self._listed and first_name and f.name < first_name:
                    print(f"apiary: rollout shard {f} appeared after the trainer passed its name "
                          f"(position {first_name}); shard names must sort in the order they are written, "
                          "so it is not trained", flush=True)
                elif not self._listed and self._passed is not None and first_name and f.name < first_name \
                        and f.name not in self._passed:
                    print(f"apiary: rollout shard {f} appeared while the trainer was stopped, with a name before the "
                          f"position it resumes from ({first_name}); shard names must sort in the order they are "
                          "written, so it is not trained (rename it to sort after the last shard to train it)",
                          flush=True)
            if f.name < first_name:
                continue
            recs = self._load(f)
            if recs is None:
                missing.append(f.name)
                continue
            start = first_idx if f.name == first_name else 0
            if start == 0 and recs:
                digest = self._digests[f.name]
                other = self._seen_digests.get(digest) or plan.digests.get(digest)
                if other is not None and other != f.name:
                    duplicates.append(f.name)
                    plan.notes.append(f"rollout shard {f} has the bytes of {self.dir / other} (a copy): its "
                                      f"{len(recs)} records are trained once, from {other}; not read again")
                    continue
                plan.digests.setdefault(digest, f.name)
            for j in range(start, len(recs)):
                line, rec = recs[j]
                sid = rec.get("sequence_id")
                key = _id_key(sid) if sid is not None else None
                if key is not None:
                    prev = plan.consumed.get(key) or self._seen.get(key)
                    if prev is not None:
                        earlier = prev[2] if len(prev) > 2 else self._earlier(prev[0], prev[1])
                        there = record_where(self.dir / prev[0], prev[1])
                        if earlier is None or earlier != rec:
                            gone = " (no longer there to compare)" if earlier is None else ""
                            raise ValueError(duplicate_error(record_where(f, line), sid, there + gone))
                        duplicates.append(record_id(f.name, line, rec))
                        plan.notes.append(f"{record_where(f, line)}: sequence_id {sid!r} again, the same record as {there}: "
                                          "trained once, skipped here")
                        continue
                if not trains_a_token(rec):  # nothing to train (and no step of such records only)
                    untrained.setdefault(f.name, []).append(record_id(f.name, line, rec))
                    if key is not None:
                        plan.consumed[key] = (f.name, line, rec)
                    continue
                pv = rec.get("policy_version")
                lag = version - pv if pv is not None else None
                if lag is not None and lag < 0:
                    if not (self._resumed and f.name in self._resumed_with):
                        raise ValueError(
                            f"{record_where(f, line)}: policy_version {pv} is ahead of the trainer's version {version} "
                            f"(step {k + 1}): no weights of that version exist yet, so the record was sampled by "
                            "another run's weights or its version is wrong; fix policy_version (drop it to skip "
                            "the lag check), or write this run's rollouts into a fresh data.path")
                    ahead[f.name] = ahead.get(f.name, 0) + 1  # written before this resume, by versions it discarded
                    lag = None
                if self.max_lag is not None and lag is not None and lag > self.max_lag:
                    dropped += 1
                    stale_pv.add(pv)
                    if key is not None:
                        plan.consumed[key] = (f.name, line, rec)
                    continue
                n = len(rec["input_ids"])
                if used + n > self.seq_len:
                    rows.append(cur)
                    cur, used = [], 0
                    if len(rows) == self.step_rows:
                        end = (f.name, j)
                        break
                cur.append((record_id(f.name, line, rec), rec))
                if key is not None:
                    plan.consumed[key] = (f.name, line, rec)
                used += n
                if lag is not None:
                    lags.append(lag)
                if f.name not in shards:
                    shards.append(f.name)
            if end is not None:
                break
            if cur:  # a row never spans two shards
                rows.append(cur)
                cur, used = [], 0
            if len(rows) == self.step_rows:
                end = (f.name, len(recs))
                break
        self._listed = True
        pvs = f"{min(stale_pv)}" if len(stale_pv) == 1 else f"{min(stale_pv, default=0)} to {max(stale_pv, default=0)}"
        self._note = (f"; {dropped} record(s) dropped as stale: their policy_version {pvs} is more than "
                      f"rl.max_lag={self.max_lag} versions behind the trainer's version {version} (raise rl.max_lag, "
                      "or have the generator sample with the trainer's newer published weights)" if dropped else "")
        if missing:
            self._note += f"; shard(s) deleted before they were read: {', '.join(missing)}"
        self._held = ""
        if end is None:
            if rows:  # part of the step is there: say how much (rows never span shards)
                records = sum(len(row) for row in rows)
                tokens = sum(len(rec["input_ids"]) for row in rows for _, rec in row)
                self._held = (f"the folder holds {len(rows)} of the {self.step_rows} rows of step {k + 1} "
                              f"({len(shards)} shard{'s' if len(shards) != 1 else ''} read, {records} records, "
                              f"{tokens:,} tokens); packing rows never span shards, so a generator writing shards "
                              "smaller than one step makes the trainer wait for the next shards")
            return None
        for name, count in ahead.items():
            plan.notes.append(f"rollout shard {self.dir / name}: {count} record(s) with a policy_version ahead of the "
                              f"trainer's version {version}, written before this run resumed (by versions the resume "
                              "discarded): trained, their lag not counted")
        report = {"records": [rid for row in rows for rid, _ in row], "shards": shards,
                  "dropped_stale": dropped, "missing_shards": missing, "version": version,
                  "lag_mean": (sum(lags) / len(lags)) if lags else None, "lag_max": max(lags) if lags else None}
        reward = mean_reward(record_reward(rec) for row in rows for _, rec in row)
        if reward is not None:  # records that carry a reward (optional, docs/rl.md)
            report["reward_mean"] = reward
        if duplicates:
            report["duplicates"] = duplicates
        if untrained:
            report["untrained"] = [rid for ids in untrained.values() for rid in ids]
        for name, ids in untrained.items():
            plan.notes.append(f"rollout shard {self.dir / name}: {len(ids)} record(s) with no loss_mask=1 token after "
                              f"position 0 skipped (they train nothing; first: {ids[0]})")
        for name in missing:
            if name not in plan.gone:
                print(f"apiary: rollout shard {self.dir / name} was deleted before it was read; its records are "
                      "not trained", flush=True)
        for note in plan.notes:
            self._say(note)
        plan.end, plan.report = end, report
        return plan

    def ready(self) -> bool:
        k = self._g // self.step_rows
        if self._plan is None or self._plan.step != k:
            self._plan = self._plan_step(k)
        return self._plan is not None

    def waiting_note(self) -> str:
        return (f"; {self._held}" if self._held else "") + self._note

    def held(self) -> str:
        return self._held

    def step_report(self, step: int) -> dict | None:
        return self._reports.pop(step, None)

    def step_metrics(self, step: int) -> dict[str, float]:
        r = self._reports.get(step)
        if r is None:
            return {}
        out = {"data/records": float(len(r["records"])), "data/dropped_stale": float(r["dropped_stale"]),
               "data/version": float(r["version"])}
        if r["lag_mean"] is not None:
            out["data/lag_mean"], out["data/lag_max"] = float(r["lag_mean"]), float(r["lag_max"])
        if r.get("reward_mean") is not None:
            out["data/reward_mean"] = float(r["reward_mean"])
        return out

    # -- iteration ---------------------------------------------------------------------------
    def _sample(self, row: list) -> tuple[dict, torch.Tensor]:
        t = build_rows([[(i, rec) for i, (_, rec) in enumerate(row)]], self.seq_len, with_ref=bool(self.with_ref),
                       with_gen=bool(self.with_gen and self.with_gen[0]), with_routed=self.routing is not None)
        t = {k: v[0] for k, v in t.items() if k != "meta"}
        n_seqs = float(sum(any(rec["loss_mask"][1:]) for plan_row in self._plan.rows for _, rec in plan_row))
        return trainer_sample(t, n_seqs)

    def _mine(self, g: int) -> bool:
        return (g // self.block) % self.world == self.rank

    def __iter__(self):
        while True:
            k = self._g // self.step_rows
            while not self.ready():  # the trainer waits (and agrees over ranks) before each step
                time.sleep(self.poll_s)
            plan = self._plan
            base = k * self.step_rows
            mine = [g for g in range(base, base + self.step_rows) if self._mine(g)]
            for g in range(self._g, base + self.step_rows):
                if g not in mine:
                    continue
                sample = self._sample(plan.rows[g - base])
                if g == mine[-1]:  # this rank's last row of the step: the step is consumed
                    self._finish(plan)
                else:
                    self._g = g + 1
                yield sample
            if not mine:  # no row of this step on this rank (cannot happen with blocks of local_batch)
                self._finish(plan)

    def _finish(self, plan: StepPlan) -> None:
        self._g = (plan.step + 1) * self.step_rows
        self.pos = plan.end
        end_recs = self._cache.get(self.pos[0])
        self._pos_len = len(end_recs) if end_recs is not None else None
        self._reports[plan.step + 1] = plan.report
        for key, (name, line, _) in plan.consumed.items():
            self._seen.setdefault(key, (name, line))
        for digest, name in plan.digests.items():
            self._seen_digests.setdefault(digest, name)
        self._gone.update(plan.report["missing_shards"])
        self._plan = None
        for name in [n for n in self._cache if n < self.pos[0]]:
            del self._cache[name]

    def state_dict(self):
        # the shards before the position the run listed: a resume names one renamed into place while it was stopped
        return {"row": self._g, "shard": self.pos[0], "record": self.pos[1],
                "listed": sorted(n for n in self._known if n < self.pos[0])}

    def load_state_dict(self, state):
        self._g = int(state["row"])
        self.pos = (str(state.get("shard", "")), int(state.get("record", 0)))
        self._pos_len = None  # known again once the shard is read (a resumed run reads it first)
        self._resumed = self._g > 0 or bool(self.pos[0])
        listed = state.get("listed")  # absent in a checkpoint written before it was kept: every shard counts as listed
        self._passed = {str(n) for n in listed} if listed is not None else None
        self._plan = None
