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
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from components.data.rollouts import (
    _check,
    _convert,
    _located_records,
    _where,
    build_rows,
    gen_presence_error,
    mean_reward,
    record_reward,
    trainer_sample,
)

SHARD_SUFFIXES = (".jsonl", ".parquet")


def ready_shards(folder: Path) -> list[Path]:
    """Shards a writer has finished: the right suffix, not a dot-file, in name order."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.suffix in SHARD_SUFFIXES and not p.name.startswith(".")
                   and p.is_file()), key=lambda p: p.name)


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
                raise ValueError(f"{_where(f, i)}: not a JSON object ({e}); a shard still being written must "
                                 "be named NAME.tmp or .NAME until it is complete") from None


@dataclass
class _Plan:
    step: int  # 0-based step index
    rows: list  # per row: [(record id, record), ...]
    end: tuple  # position after the step
    report: dict = field(default_factory=dict)


class FollowRows(IterableDataset, Stateful):
    NOUN = "rollouts"  # framework/contracts.py FollowedData
    LEDGER = "rollouts.jsonl"

    def __init__(self, path: str, *, seq_len: int, dp_rank: int, dp_world_size: int, local_batch: int,
                 global_batch: int, max_lag: int | None = None, publish_interval: int = 0, vocab_size: int = 0,
                 poll_s: float = 0.2):
        self.dir = Path(path)
        self.seq_len, self.rank, self.world, self.block, self.step_rows = (seq_len, dp_rank, dp_world_size,
                                                                          local_batch, global_batch)
        self.max_lag, self.interval, self.vocab, self.poll_s = max_lag, publish_interval, vocab_size, poll_s
        self.pos: tuple[str, int] = ("", 0)  # (shard name, next record index): everything before is consumed
        self._g = 0  # global rows consumed (all ranks'), a multiple of step_rows between steps
        self._plan: _Plan | None = None
        self._cache: dict[str, list] = {}  # shard name -> [(line, record)], read once, dropped once passed
        self._known: set[str] = set()  # shard names seen by this process (the first listing: all of them)
        self._listed = False
        self._reports: dict[int, dict] = {}
        self._note = ""
        self.with_ref: bool | None = None
        self.with_gen: tuple[bool, str] | None = None  # (gen_logprobs present, the first record's file:line)

    # -- versions ----------------------------------------------------------------------------
    def version(self, step: int) -> int:
        """The trainer's policy version while it trains 1-based step ``step``."""
        done = step - 1
        return (done // self.interval) * self.interval if self.interval > 0 else done

    # -- reading shards ----------------------------------------------------------------------
    def _load(self, f: Path) -> list | None:
        """The shard's records, checked as the static reader checks them; None when it vanished."""
        if f.name in self._cache:
            return self._cache[f.name]
        try:
            located = list(_jsonl_records(f) if f.suffix == ".jsonl" else _located_records(f))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError) as e:
            if str(e).startswith(str(f)):
                raise
            raise ValueError(f"{f}: not a readable rollout shard ({e})") from None
        recs = []
        for line, _, rec in located:
            where = _where(f, line)
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: a rollout record is a JSON object")
            n = _check(where, rec)
            _convert(where, rec)
            if n > self.seq_len:
                raise ValueError(f"{where}: {n} tokens do not fit training.seq_len={self.seq_len}")
            top = max(rec["input_ids"])
            if self.vocab and top >= self.vocab:
                raise ValueError(f"{where}: token id {top} is outside the model's vocabulary ({self.vocab})")
            v = rec.get("policy_version")
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{where}: policy_version must be an integer >= 0, got {v!r}")
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
        return recs

    # -- planning ----------------------------------------------------------------------------
    def _plan_step(self, k: int) -> _Plan | None:
        """The rows of 0-based step ``k`` from ``self.pos``, or None while the shards present do not fill it."""
        version = self.version(k + 1)
        rows, cur, used = [], [], 0
        dropped, lags, shards, missing = 0, [], [], []
        first_name, first_idx = self.pos
        end = None
        for f in ready_shards(self.dir):
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
            for j in range(start, len(recs)):
                line, rec = recs[j]
                pv = rec.get("policy_version")
                lag = version - pv if pv is not None else None
                if self.max_lag is not None and lag is not None and lag > self.max_lag:
                    dropped += 1
                    continue
                n = len(rec["input_ids"])
                if used + n > self.seq_len:
                    rows.append(cur)
                    cur, used = [], 0
                    if len(rows) == self.step_rows:
                        end = (f.name, j)
                        break
                cur.append((record_id(f.name, line, rec), rec))
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
        if end is None:
            return None
        report = {"records": [rid for row in rows for rid, _ in row], "shards": shards,
                  "dropped_stale": dropped, "missing_shards": missing, "version": version,
                  "lag_mean": (sum(lags) / len(lags)) if lags else None, "lag_max": max(lags) if lags else None}
        reward = mean_reward(record_reward(rec) for row in rows for _, rec in row)
        if reward is not None:  # records that carry a reward (optional, docs/rl.md)
            report["reward_mean"] = reward
        for name in missing:
            print(f"apiary: rollout shard {self.dir / name} was deleted before it was read; its records are "
                  "not trained", flush=True)
        return _Plan(step=k, rows=rows, end=end, report=report)

    def ready(self) -> bool:
        k = self._g // self.step_rows
        if self._plan is None or self._plan.step != k:
            self._plan = self._plan_step(k)
        return self._plan is not None

    def waiting_note(self) -> str:
        return self._note

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
                       with_gen=bool(self.with_gen and self.with_gen[0]))
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
        self._reports[plan.step + 1] = plan.report
        self._plan = None
        for name in [n for n in self._cache if n < self.pos[0]]:
            del self._cache[name]

    def state_dict(self):
        return {"row": self._g, "shard": self.pos[0], "record": self.pos[1]}

    def load_state_dict(self, state):
        self._g = int(state["row"])
        self.pos = (str(state.get("shard", "")), int(state.get("record", 0)))
        self._plan = None


def ledger_line(step: int, report: dict) -> str:
    """One line of ``rollouts.jsonl`` (the run's record of which rollouts each step trained)."""
    return json.dumps({"step": step, **report})
