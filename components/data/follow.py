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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from components.data.rollout_sources import file_digest, located_records, not_a_file, record_where
from components.data.rollout_values import _convert, routed_problem
from components.data.rollouts import (
    _check,
    _id_key,
    build_rows,
    duplicate_error,
    gen_presence_error,
    mean_reward,
    record_reward,
    trainer_sample,
    trains_a_token,
)

SHARD_SUFFIXES = (".jsonl", ".parquet")


def ready_shards(folder: Path) -> list[Path]:
    """Shards a writer has finished: the right suffix, not a dot-file, in name order."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.suffix in SHARD_SUFFIXES and not p.name.startswith(".")
                   and p.is_file()), key=lambda p: p.name)


def odd_entries(folder: Path, ready: set[str]) -> list[tuple[str, str]]:
    """(name, why) of the folder's entries that are not shards and not the writer's files in progress
    (dot-files, NAME.tmp): a wrong suffix, a folder or something other than a regular file under a
    shard's name, a dangling link. They are not read; the trainer names each once."""
    out = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        if name in ready or name.startswith(".") or name.endswith(".tmp"):
            continue
        f = folder / name
        if f.suffix not in SHARD_SUFFIXES:
            out.append((name, "not read: a shard's name ends in .jsonl or .parquet"))
        else:
            why = not_a_file(f)
            if why:
                out.append((name, f"not read: {why}"))
    return out


def _ident(f: Path) -> tuple | None:
    """What changes when a file is replaced or rewritten (None when it is gone)."""
    try:
        st = os.stat(f)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def record_id(shard: str, line: int, rec: dict) -> str:
    """A record's id in the ledger: its ``sequence_id`` when it has one, else ``shard:line``."""
    sid = rec.get("sequence_id")
    return str(sid) if sid is not None else f"{shard}:{line}"


def _jsonl_records(f: Path):
    """(line, None, record) of a jsonl shard; a line that is not JSON is named as file:line."""
    with open(f, "rb") as fh:
        for i, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield i, None, json.loads(raw)
            except ValueError as e:
                raise ValueError(f"{record_where(f, i)}: not a JSON object ({e}); a shard still being written must "
                                 "be named NAME.tmp or .NAME until it is complete") from None


@dataclass
class _Plan:
    step: int  # 0-based step index
    rows: list  # per row: [(record id, record), ...]
    end: tuple  # position after the step
    report: dict = field(default_factory=dict)
    consumed: dict = field(default_factory=dict)  # sequence_id key -> (shard, line, record): passed by the step
    digests: dict = field(default_factory=dict)  # shard digest -> shard name: shards the step entered
    notes: list = field(default_factory=list)  # warnings said once the step is planned
    gone: list = field(default_factory=list)  # shard names reported as deleted


class FollowRows(IterableDataset, Stateful):
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
        self._plan: _Plan | None = None
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

    # -- versions ----------------------------------------------------------------------------
    def version(self, step: int) -> int:
        """The trainer's policy version while it trains 1-based step ``step``."""
        done = step - 1
        return (done // self.interval) * self.interval if self.interval > 0 else done

    # -- reading shards ----------------------------------------------------------------------
    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            print(f"apiary: {message}", flush=True)

    def _read(self, f: Path) -> list | None:
        """(line, None, record) of a shard; None when it vanished."""
        try:
            return list(_jsonl_records(f) if f.suffix == ".jsonl" else located_records(f))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError) as e:
            if str(e).startswith(str(f)):
                raise
            raise ValueError(f"{f}: not a readable rollout shard ({e})") from None

    def _load(self, f: Path) -> list | None:
        """The shard's records, checked as the static reader checks them; None when it vanished."""
        if f.name in self._cache:
            return self._cache[f.name]
        ident = _ident(f)
        located = self._read(f)
        if located is None or ident is None:
            return None
        try:
            digest = file_digest(f)
        except OSError:
            return None
        recs = []
        for line, _, rec in located:
            where = record_where(f, line)
            n = _check(where, rec)
            _convert(where, rec, self.vocab)
            if n > self.seq_len:
                raise ValueError(f"{where}: {n} tokens do not fit training.seq_len={self.seq_len}")
            if self.routing:
                problem = routed_problem(where, rec, *self.routing)
                if problem:
                    raise ValueError(problem)
            with_ref = rec.get("ref_logprobs") is not None
            if self.with_ref is None:
                self.with_ref = with_ref
            elif with_ref != self.with_ref:
                raise ValueError(f"{where}: ref_logprobs present in some records but not all")
            with_gen = rec.get("gen_logprobs") is not None
            if self.with_gen is None:
                self.with_gen = (with_gen, where)
            elif with_gen != self.with_gen[0]:
                raise ValueError(gen_presence_error(where, with_gen, self.with_gen[1]))
            recs.append((line, rec))
        self._cache[f.name] = recs
        self._idents[f.name], self._digests[f.name] = ident, digest
        return recs

    def _history(self, listed: list[Path]) -> None:
        """A resumed run's first listing: the records of the shards before its position (trained before
        the checkpoint) are remembered by sequence_id and the shards by digest, so a copy that comes later
        is not trained twice."""
        first_name, first_idx = self.pos
        self._resumed_with = {f.name for f in listed}
        for f in listed:
            if f.name > first_name:
                break
            if f.name == first_name:
                recs = self._load(f) or []
                for line, rec in recs[:first_idx]:
                    if rec.get("sequence_id") is not None:
                        self._seen.setdefault(_id_key(rec["sequence_id"]), (f.name, line))
                if f.name in self._digests:
                    self._seen_digests.setdefault(self._digests[f.name], f.name)
                continue
            ident = _ident(f)
            try:
                located, digest = self._read(f), file_digest(f)
            except (ValueError, OSError):  # never trained (it would have stopped the run): nothing to remember
                continue
            if located is None or ident is None:
                continue
            self._idents[f.name] = ident
            self._seen_digests.setdefault(digest, f.name)
            for line, _, rec in located:
                sid = rec.get("sequence_id") if isinstance(rec, dict) else None
                if sid is not None:
                    self._seen.setdefault(_id_key(sid), (f.name, line))

    def _earlier(self, name: str, line: int):
        """The record at shard ``name``, line ``line`` as read now (None when it cannot be read)."""
        recs = self._cache.get(name)
        if recs is None:
            try:
                recs = [(ln, rec) for ln, _, rec in self._read(self.dir / name) or []]
            except (ValueError, OSError):
                return None
        return next((rec for ln, rec in recs if ln == line), None)

    def _changes(self, listed: list[Path], names: set[str], plan: _Plan) -> None:
        """Shards changed under the trainer since it read them, and entries that are not shards:
        each named (once); a changed shard not yet trained is read again, a deleted one is not trained."""
        first_name, first_idx = self.pos
        for name, why in odd_entries(self.dir, names):
            self._say(f"{self.dir / name} in the rollout folder is {why}")
        for f in listed:
            old = self._idents.get(f.name)
            if old is None:
                continue
            now = _ident(f)
            if now is None or now == old:
                continue
            cached = self._cache.get(f.name)
            passed = f.name < first_name or (f.name == first_name and cached is not None and first_idx >= len(cached))
            entered = f.name == first_name and first_idx > 0 and not passed
            if passed or entered:
                self._idents[f.name] = now
                what = ("after its records were trained" if passed else
                        f"after {first_idx} of its records were trained (the rest of the copy read before trains)")
                self._say(f"rollout shard {f} changed {what} (a new file renamed over it, or rewritten): its new "
                          "content is not trained; write new records under a new name that sorts after the last "
                          "shard")
            else:
                self._cache.pop(f.name, None)
                self._idents.pop(f.name, None)
                self._say(f"rollout shard {f} changed after the trainer read it, before it was trained: it is "
                          "read again")
        for name in sorted(set(self._cache) | self._known):
            if name in names or name in self._gone or name <= first_name:  # the position's shard: below
                continue
            cached = self._cache.pop(name, None)
            plan.gone.append(name)
            plan.notes.append(f"rollout shard {self.dir / name} was deleted "
                              f"{'after it was read, ' if cached is not None else ''}before it was trained; "
                              "its records are not trained")
        if first_name and first_name not in names and first_name not in self._gone:
            cached = self._cache.pop(first_name, None)
            total = len(cached) if cached is not None else self._pos_len
            if total is None or first_idx < total:
                what = (f"{first_idx} of its {total} records were trained: the other {total - first_idx} are"
                        if total is not None else
                        f"{first_idx} of its records were trained: any records after those are")
                plan.gone.append(first_name)
                plan.notes.append(f"rollout shard {self.dir / first_name} was deleted after {what} not trained")
            else:
                self._gone.add(first_name)  # trained whole, then deleted (a writer cleaning up): nothing lost

    # -- planning ----------------------------------------------------------------------------
    def _plan_step(self, k: int) -> _Plan | None:
        """The rows of 0-based step ``k`` from ``self.pos``, or None while the shards present do not fill it."""
        version = self.version(k + 1)
        rows, cur, used = [], [], 0
        dropped, lags, shards, missing = 0, [], [], []
        first_name, first_idx = self.pos
        end = None
        plan = _Plan(step=k, rows=rows, end=None)
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
        self._note = (f"; {dropped} record(s) dropped as more than rl.max_lag={self.max_lag} versions behind "
                      f"the trainer's version {version}" if dropped else "")
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

    def _finish(self, plan: _Plan) -> None:
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
        return {"row": self._g, "shard": self.pos[0], "record": self.pos[1]}

    def load_state_dict(self, state):
        self._g = int(state["row"])
        self.pos = (str(state.get("shard", "")), int(state.get("record", 0)))
        self._pos_len = None  # known again once the shard is read (a resumed run reads it first)
        self._resumed = self._g > 0 or bool(self.pos[0])
        self._plan = None
