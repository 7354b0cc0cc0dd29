"""RL rollouts from jsonl / parquet files -> padded (optionally packed) tensors for the RL losses.

One record per sampled sequence (prompt + response):

    input_ids     list[int]              the whole sequence, length L
    loss_mask     list[0/1] (L)          1 where the token is trained (response tokens)
    old_logprobs  list[float] (L)        log p_old(input_ids[t] | input_ids[:t]) from the sampler;
                                         any value where loss_mask is 0 (position 0 must be 0)
    advantages    float | list[float]    per sequence, or per token (L)
    ref_logprobs  list[float] (L)        optional: reference policy, for a KL term
    gen_logprobs  list[float] (L)        optional: the inference engine's log-probs of the same tokens,
                                         when old_logprobs are the trainer's old policy (recomputed
                                         by the trainer's engine): truncated importance sampling then
                                         weighs each token by min(exp(old - gen), rl.tis_cap) and the
                                         mismatch metrics compare against gen (docs/skills/tis.md)
    sequence_id   int | str              optional: kept in ``meta``
    group_id      int | str              optional: the prompt group (GRPO), kept in ``meta``

Per-token fields describe the token at the same index (``field[t]`` is about ``input_ids[t]``).
The model's output at position t predicts token t+1, so the reader shifts them by one:
``labels[t] = input_ids[t+1]`` where ``loss_mask[t+1]`` (else IGNORE_INDEX, -100), and likewise loss_mask,
old_logprobs, advantages, ref_logprobs and gen_logprobs, so that everything lines up with
``token_logprobs(hidden, weight, labels)``. Output (B rows, T columns):

    input_ids [B, T] long (pad_id), labels [B, T] long (IGNORE_INDEX where not trained), loss_mask [B, T] bool,
    old_logprobs / advantages / ref_logprobs / gen_logprobs [B, T] float32 (0 at padding and where
    not trained),
    positions [B, T] long (restart at every packed sequence; a row's padding counts on from 0 as
    one more sequence, never one per pad token), sequence_ids [B, T] long (index of
    the sequence inside its row, -1 at padding), seq_tokens [B, T] long (trained tokens of the
    token's sequence, the |o_i| of sequence-level means; 0 at padding), meta: list per row of
    the records' (index, sequence_id, group_id).

ref_logprobs and gen_logprobs are each in every record or in none (ValueError naming the first
record that differs from the first one).

Packing (``pack_to``): sequences are placed in order, each row filled until the next one does
not fit (no sequence is split); without it each row holds one sequence and T is the longest.
``pad_multiple`` rounds T up (context parallelism wants T divisible by 2 x cp).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from components.data.rollout_sources import file_digest, located_records, record_where, rollout_files
from components.data.rollout_values import _convert, _routed_experts
from components.labels import IGNORE_INDEX

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are made (start-up time)
    import torch

RL_KEYS = ("rl_old_logprobs", "rl_advantages", "rl_ref_logprobs", "rl_gen_logprobs", "rl_sequence_ids",
           "rl_seq_tokens", "rl_routed_experts")  # per token (routed_experts: [T, n_moe_layers, k], model input, not shifted)
STEP_KEYS = ("rl_num_seqs",)  # per sample, not per token: not context-sharded
PACKAGED_ROLLOUTS = Path(__file__).with_name("tiny_rollouts.jsonl")  # see make_tiny_rollouts.py
REQUIRED = ("input_ids", "loss_mask", "old_logprobs", "advantages")


def source(name: str, path: str | None) -> str | None:
    """The rollouts a recipe's ``data`` section names: ``data.path``, or the packaged ones."""
    if path is not None:
        return str(path)
    return str(PACKAGED_ROLLOUTS) if name == "packaged" else None


def _check(where: str, rec: dict) -> int:
    """The record's fields are there and of one length; its length L (ValueError naming ``where``)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a rollout record is a JSON object (one per line), got {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec or rec[k] is None]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}; a rollout record needs "
                         f"{', '.join(REQUIRED)} (ref_logprobs, gen_logprobs optional)")
    for k in ("input_ids", "loss_mask", "old_logprobs"):
        if not isinstance(rec[k], (list, tuple)):
            raise ValueError(f"{where}: {k} must be a list (one value per token), got {type(rec[k]).__name__}")
    n = len(rec["input_ids"])
    if n < 2:
        raise ValueError(f"{where}: input_ids needs at least 2 tokens, got {n}")
    per_token = ("loss_mask", "old_logprobs", "ref_logprobs", "gen_logprobs")
    if isinstance(rec["advantages"], list):
        per_token += ("advantages",)
    if rec.get("routed_experts") is not None:
        per_token += ("routed_experts",)
    for k in per_token:
        if rec.get(k) is not None:
            if not isinstance(rec[k], (list, tuple)):
                raise ValueError(f"{where}: {k} must be a list (one value per token), got {type(rec[k]).__name__}")
            if len(rec[k]) != n:
                raise ValueError(f"{where}: {k} has {len(rec[k])} entries, input_ids {n}")
    return n


class RolloutIndex:
    """Where each record of a rollouts path is, its length and whether it trains any token, read
    in one pass; records are fetched again on demand (``fetch``), so a reader holds a few numbers
    per record instead of the records. jsonl: byte offsets (one open file at a time); parquet:
    (row group, row), the current row group kept as an Arrow table (rows are read in order; write
    row groups of a few hundred records). ``validate``: also convert every field as the loader
    will (the pre-launch check), so a malformed value stops the run before it starts."""

    def __init__(self, path: str | Path, validate: bool = False, vocab_size: int = 0):
        self.files = rollout_files(path)
        if not self.files:
            raise FileNotFoundError(f"{path}: no .jsonl or .parquet rollout file there")
        self.loc, self.lengths, self.trained, with_ref = [], [], [], []
        self.max_token = -1
        self.rewards: list[float | None] = []  # each record's reward (record_reward), None without one
        self.with_gen, first = False, ""  # gen_logprobs: in every record or in none (the first one decides)
        self._open = (None, None)  # (file index, open jsonl file or parquet file)
        self._group = (None, None)  # ((file index, row group), its Arrow table)
        # duplicates (docs/rl.md): a file with the bytes of an earlier one, or a record whose sequence_id
        # an earlier record has, with the same content, is skipped (said in ``skipped``); another record
        # under the same sequence_id is refused (ValueError naming both)
        self.skipped: list[str] = []
        self.untrained: list[str] = []  # records with no loss_mask=1 after position 0: they train nothing, skipped
        digests: dict[bytes, Path] = {}
        ids: dict[str, int] = {}
        for fi, f in enumerate(self.files):
            digest = file_digest(f)
            if digest in digests:
                self.skipped.append(f"{f}: the same bytes as {digests[digest]} (a copy): not read")
                continue
            digests[digest] = f
            for line, loc, rec in located_records(f):
                where = record_where(f, line)
                n = _check(where, rec)
                if validate:
                    _convert(where, rec, vocab_size)
                if not trains_a_token(rec):
                    self.untrained.append(where)
                    continue
                sid = rec.get("sequence_id")
                if sid is not None:
                    key = _id_key(sid)
                    if key in ids:
                        i = ids[key]
                        if rec != self.fetch(i):
                            raise ValueError(duplicate_error(where, sid, self.where(i)))
                        self.close()
                        self.skipped.append(f"{where}: sequence_id {sid!r} again, the same record as "
                                            f"{self.where(i)}: skipped")
                        continue
                    ids[key] = len(self.loc)
                self.lengths.append(n)
                self.max_token = max(self.max_token, max(rec["input_ids"]))
                self.trained.append(any(rec["loss_mask"][1:]))
                self.rewards.append(record_reward(rec))  # optional: the step's mean reward (metrics)
                with_ref.append(rec.get("ref_logprobs") is not None)
                with_gen = rec.get("gen_logprobs") is not None
                if not self.loc:
                    self.with_gen, first = with_gen, where
                elif with_gen != self.with_gen:
                    raise ValueError(gen_presence_error(where, with_gen, first))
                self.loc.append((fi, line, *loc))
        self.close()
        if not self.lengths:
            raise ValueError(f"{path}: no rollout records" + (
                f" with a token to train ({len(self.untrained)} record(s), none with loss_mask=1 after position 0)"
                if self.untrained else ""))
        if any(with_ref) and not all(with_ref):
            raise ValueError(f"{path}: ref_logprobs present in some records but not all")
        self.with_ref = all(with_ref)

    def where(self, i: int) -> str:
        fi, line = self.loc[i][:2]
        return record_where(self.files[fi], line)

    def close(self) -> None:
        if self._open[1] is not None and hasattr(self._open[1], "close"):
            self._open[1].close()
        self._open, self._group = (None, None), (None, None)

    def __getstate__(self):  # data-loader workers reopen the files
        return {**self.__dict__, "_open": (None, None), "_group": (None, None)}

    def _file(self, fi: int):
        if self._open[0] != fi:
            self.close()
            f = self.files[fi]
            if f.suffix == ".jsonl":
                handle = open(f, "rb")
            else:
                import pyarrow.parquet as pq  # optional dependency: pyarrow (parquet files only)

                handle = pq.ParquetFile(f)
            self._open = (fi, handle)
        return self._open[1]

    def fetch(self, i: int) -> dict:
        fi, _, a, b = self.loc[i]
        handle = self._file(fi)
        if self.files[fi].suffix == ".jsonl":
            handle.seek(a)
            return json.loads(handle.readline())
        if self._group[0] != (fi, a):
            self._group = ((fi, a), handle.read_row_group(a))
        return self._group[1].slice(b, 1).to_pylist()[0]


def gen_presence_error(where: str, has: bool, first: str) -> str:
    """The message for a record whose gen_logprobs presence differs from the first record's."""
    return (f"{where}: gen_logprobs {'present' if has else 'missing'} here but {'absent' if has else 'present'} "
            f"in {first}; gen_logprobs must be in every record or in none")


def trains_a_token(rec: dict) -> bool:
    """Whether the record has a trained token (loss_mask 1 after position 0, which is never predicted);
    one without trains nothing, and the readers skip it (so no step is all masked out)."""
    return any(v == 1 for v in rec["loss_mask"][1:])


def duplicate_error(where: str, sid, first: str) -> str:
    """The message for a record whose sequence_id an earlier, different record has."""
    return (f"{where}: sequence_id {sid!r} is also the sequence_id of {first}, a different record; a sequence_id "
            "names one record in the whole run (the ledger counts by it), so neither is trained twice nor "
            "dropped in silence: give one of them another id, or remove it")


def _id_key(sid) -> str:
    """A sequence_id as a key (1 and "1" name the same record, as the ledger writes both as "1")."""
    return str(sid)


def pack_rows(lengths: list[int], pack_to: int | None, where=None) -> tuple[list[list[int]], int]:
    """Record indices per row and the row width before padding (see the module docstring);
    ``where(i)`` names record i in errors."""
    if pack_to is None:
        return [[i] for i in range(len(lengths))], max(lengths)
    rows, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if n > pack_to:
            raise ValueError(f"{where(i) if where else f'record {i}'}: {n} tokens do not fit pack_to={pack_to}")
        if used + n > pack_to:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    rows.append(cur)
    return rows, pack_to


def read_rollouts(path: str | Path, *, pack_to: int | None = None, pad_id: int = 0, pad_multiple: int = 1,
                  ignore_index: int = IGNORE_INDEX) -> dict:
    index = RolloutIndex(path, validate=True)
    rows, width = pack_rows(index.lengths, pack_to, index.where)
    width = int(math.ceil(width / pad_multiple) * pad_multiple)
    return build_rows([[(i, index.fetch(i)) for i in idxs] for idxs in rows], width, with_ref=index.with_ref,
                      with_gen=index.with_gen, pad_id=pad_id, ignore_index=ignore_index)


def build_rows(rows: list[list[tuple[int, dict]]], width: int, *, with_ref: bool, pad_id: int = 0,
               ignore_index: int = IGNORE_INDEX, with_routed: bool | None = None, with_gen: bool = False) -> dict:
    """Tensors (module docstring) for ``rows``: per row, its (record index, record) in order.
    ``with_gen``: every record has ``gen_logprobs`` (output key ``gen_logprobs``, shifted like old_logprobs).

    ``routed_experts`` [B, T, n_moe_layers, k] long (-1 at padding), not shifted (the routing of
    the token at that position as an input), when ``with_routed`` or (None) when every record of
    ``rows`` has the field; ValueError when they differ in [n_moe_layers, k] or only some have it."""
    import torch  # reason: start-up time (the CLI's checks read records without torch)

    b = len(rows)
    recs = [(i, rec) for row in rows for i, rec in row]
    has = [rec.get("routed_experts") is not None for _, rec in recs]
    if with_routed is None:
        with_routed = bool(has) and all(has)
        if any(has) and not with_routed:
            raise ValueError("routed_experts present in some records but not all")
    routed_shape = None
    out = {
        "input_ids": torch.full((b, width), pad_id, dtype=torch.long),
        "labels": torch.full((b, width), ignore_index, dtype=torch.long),
        "loss_mask": torch.zeros((b, width), dtype=torch.bool),
        "old_logprobs": torch.zeros((b, width), dtype=torch.float32),
        "advantages": torch.zeros((b, width), dtype=torch.float32),
        "positions": torch.zeros((b, width), dtype=torch.long),
        "sequence_ids": torch.full((b, width), -1, dtype=torch.long),
    }
    if with_ref:
        out["ref_logprobs"] = torch.zeros((b, width), dtype=torch.float32)
    if with_gen:
        out["gen_logprobs"] = torch.zeros((b, width), dtype=torch.float32)
    if with_routed:
        i0, r0 = recs[0]
        routed_shape = tuple(_routed_experts(f"record {i0}", r0).shape[1:])
        out["routed_experts"] = torch.full((b, width, *routed_shape), -1, dtype=torch.long)
    meta = []
    for r, row in enumerate(rows):
        col, row_meta = 0, []
        for k, (i, rec) in enumerate(row):
            n = len(rec["input_ids"])
            ids = torch.tensor(rec["input_ids"], dtype=torch.long)
            mask = torch.tensor(rec["loss_mask"], dtype=torch.bool)
            adv = rec["advantages"]
            adv = torch.tensor(adv, dtype=torch.float32) if isinstance(adv, list) else torch.full((n,), float(adv))
            sl = slice(col, col + n)
            out["input_ids"][r, sl] = ids
            out["positions"][r, sl] = torch.arange(n)
            out["sequence_ids"][r, sl] = k
            # shifted: position t predicts token t+1 of the same sequence
            nx = slice(col, col + n - 1)
            m = mask[1:]
            out["loss_mask"][r, nx] = m
            out["labels"][r, nx] = torch.where(m, ids[1:], torch.full_like(ids[1:], ignore_index))
            out["old_logprobs"][r, nx] = torch.tensor(rec["old_logprobs"], dtype=torch.float32)[1:] * m
            out["advantages"][r, nx] = adv[1:] * m
            if with_ref:
                out["ref_logprobs"][r, nx] = torch.tensor(rec["ref_logprobs"], dtype=torch.float32)[1:] * m
            if with_gen:
                if rec.get("gen_logprobs") is None:
                    raise ValueError(f"record {i}: no gen_logprobs (the other records have them)")
                out["gen_logprobs"][r, nx] = torch.tensor(rec["gen_logprobs"], dtype=torch.float32)[1:] * m
            if with_routed:  # not shifted: position t's routing is that of input token t
                if rec.get("routed_experts") is None:
                    raise ValueError(f"record {i}: no routed_experts (the other records have them)")
                re = _routed_experts(f"record {i}", rec)
                if tuple(re.shape[1:]) != routed_shape:
                    raise ValueError(f"record {i}: routed_experts is [L, {', '.join(map(str, re.shape[1:]))}], "
                                     f"record {recs[0][0]}'s [L, {', '.join(map(str, routed_shape))}]")
                out["routed_experts"][r, sl] = re
            row_meta.append((i, rec.get("sequence_id"), rec.get("group_id")))
            col += n
        # the padding after the row's last sequence is one more (untrained) sequence: positions count
        # on from 0 instead of staying 0, where every pad token would start a document of its own (the
        # GatedDeltaNet kernels then run one chunk per pad token: 10x their time and 24 GiB of states
        # for a row of 32K tokens with 11K padding; benchmarks/short_rollouts_profile.sh)
        out["positions"][r, col:] = torch.arange(width - col)
        meta.append(row_meta)
    out["meta"] = meta
    seg = out["sequence_ids"].clamp_min(0)
    counts = torch.zeros(b, max(int(seg.max()) + 1, 1), dtype=torch.long).scatter_add_(
        1, seg, out["loss_mask"].long())
    out["seq_tokens"] = torch.where(out["sequence_ids"] >= 0, counts.gather(1, seg), 0)
    return out


def trainer_sample(t: dict, num_seqs) -> tuple[dict, torch.Tensor]:
    """One row of ``build_rows`` (its tensors [T]) as the trainer's sample: ``input``/``positions``
    for the model, the ``rl_*`` tensors for the policy loss (optional fields when present), labels;
    ``num_seqs``: the step's sequences with a trained token (all ranks)."""
    import torch  # reason: start-up time (the CLI's checks read records without torch)

    sample = {"input": t["input_ids"], "positions": t["positions"],
              "rl_old_logprobs": t["old_logprobs"], "rl_advantages": t["advantages"],
              "rl_sequence_ids": t["sequence_ids"], "rl_seq_tokens": t["seq_tokens"],
              "rl_num_seqs": torch.as_tensor(num_seqs, dtype=torch.float32)}
    for field in ("ref_logprobs", "gen_logprobs", "routed_experts"):
        if field in t:
            sample[f"rl_{field}"] = t[field]
    return sample, t["labels"]


def record_reward(rec: dict) -> float | None:
    """A record's optional ``reward`` (the generator's score of the completion, a number), or None
    where it has none or it is not a finite number (then it is not counted in the step's mean)."""
    r = rec.get("reward")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or r != r or r in (float("inf"), float("-inf")):
        return None
    return float(r)


def mean_reward(rewards) -> float | None:
    """The mean of the rewards that are there (None: no record of the step had one)."""
    vals = [r for r in rewards if r is not None]
    return sum(vals) / len(vals) if vals else None
