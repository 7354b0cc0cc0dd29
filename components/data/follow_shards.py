"""Follow mode's rollout folder (``data.follow=true``, components/data/follow.py): which entries are
shards a writer has finished (the writer's convention, docs/rl.md), reading and checking a shard once,
and what changed under the trainer since it read one (a shard rewritten, renamed over, copied or
deleted), each named once. ``FollowRows`` plans a step's rows from what ``ShardWatch`` reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from components.data.rollout_sources import file_digest, located_records, not_a_file, record_where
from components.data.rollout_values import _convert, routed_problem
from components.data.rollouts import _check, _id_key, gen_presence_error

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
class StepPlan:
    """One step's rows as ``FollowRows`` planned them, and what the step passed on its way."""

    step: int  # 0-based step index
    rows: list  # per row: [(record id, record), ...]
    end: tuple  # position after the step
    report: dict = field(default_factory=dict)
    consumed: dict = field(default_factory=dict)  # sequence_id key -> (shard, line, record): passed by the step
    digests: dict = field(default_factory=dict)  # shard digest -> shard name: shards the step entered
    notes: list = field(default_factory=list)  # warnings said once the step is planned
    gone: list = field(default_factory=list)  # shard names reported as deleted


class ShardWatch:
    """The shards ``FollowRows`` has read: their records (checked as the static reader checks them),
    what identifies each on disk, the records and shards it has passed, and the warnings it said.
    The state lives on the dataset (``FollowRows.__init__`` sets it: ``dir``, ``seq_len``, ``vocab``,
    ``routing``, ``pos``, ``with_ref``, ``with_gen`` and the ``_cache``, ``_idents``, ``_digests``,
    ``_seen``, ``_seen_digests``, ``_known``, ``_gone``, ``_said``, ``_pos_len``, ``_resumed_with``, ``_passed``
    it keeps); these are its methods that read the folder."""

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
        is not trained twice; a shard the run had not listed before it stopped was never trained."""
        first_name, first_idx = self.pos
        self._resumed_with = {f.name for f in listed}
        for f in listed:
            if f.name > first_name:
                break
            if self._passed is not None and f.name != first_name and f.name not in self._passed:
                continue  # appeared while the run was stopped: never trained (named), so a later copy trains
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

    def _changes(self, listed: list[Path], names: set[str], plan: StepPlan) -> None:
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
