"""The trainer's data loader for RL rollouts (``data.format=rollouts``): jsonl/parquet records
(format in ``rollouts.py``) packed into ``seq_len`` rows, dealt to data-parallel ranks.

Each sample is ``({"input", "positions", "rl_*"}, labels)``: ``input``/``positions`` go to the
model (positions restart at every packed sequence, so attention stays inside it), ``labels`` are
-100 except on trained tokens (so the trainer's global valid-token count is the number of
trained tokens of the step), and the ``rl_*`` tensors travel to the policy loss (the trainer
takes them out before the model call and context-shards them like the labels):

    rl_old_logprobs, rl_advantages[, rl_ref_logprobs][, rl_gen_logprobs]   [T] float32
    rl_routed_experts                                   [T, n_moe_layers, k] long (-1 at padding; moe.routing_replay)
    rl_sequence_ids                                     [T] long (-1 at padding)
    rl_seq_tokens                                       [T] long, |o_i| of the token's sequence
    rl_num_seqs                                         []  float, sequences with a trained token
                                                            in the whole optimizer step (all ranks)

Rows go to ranks in blocks of ``local_batch`` (global row g belongs to data-parallel rank
(g // local_batch) % dp), and one optimizer step takes ``global_batch`` consecutive rows, so a
step sees the same rows for any data-parallel size. The rows repeat when the file is used up
(epochs). The position in the stream is checkpointed, so a resumed run continues with the next
row. A rank keeps only the index of the records (offsets, lengths) and reads the records of its
own rows when it reaches them, so its memory does not grow with the rollout set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from components.data.follow import FollowRows
from components.data.rollouts import (  # noqa: F401
    RL_KEYS,
    STEP_KEYS,
    RolloutIndex,
    build_rows,
    mean_reward,
    pack_rows,
    trainer_sample,
)


class RolloutRows(IterableDataset, Stateful):
    def __init__(self, path: str, *, seq_len: int, dp_rank: int, dp_world_size: int, local_batch: int,
                 global_batch: int):
        # (resolve has already checked the records, their lengths and their token ids)
        self.index = RolloutIndex(path)
        self.rows, _ = pack_rows(self.index.lengths, seq_len, self.index.where)
        self.seq_len, self.n = seq_len, len(self.rows)
        self.rank, self.world, self.block, self.step_rows = dp_rank, dp_world_size, local_batch, global_batch
        # sequences with at least one trained token, per row
        self.row_seqs = torch.tensor([sum(self.index.trained[i] for i in row) for row in self.rows],
                                     dtype=torch.float32)
        self._g = 0  # next global row index (all ranks')

    def _num_seqs(self, step: int) -> torch.Tensor:
        rows = torch.arange(step * self.step_rows, (step + 1) * self.step_rows) % self.n
        return self.row_seqs[rows].sum()

    def step_metrics(self, step: int) -> dict[str, float]:
        """Scalars for step ``step``'s metrics record (1-based, as the trainer counts): the mean
        ``reward`` of the records of its rows, where they carry one (all ranks' rows)."""
        rows = range((step - 1) * self.step_rows, step * self.step_rows)
        reward = mean_reward(self.index.rewards[i] for g in rows for i in self.rows[g % self.n])
        return {} if reward is None else {"data/reward_mean": reward}

    def row(self, i: int) -> dict:
        """Row ``i`` of the packed stream, as tensors [seq_len] (see rollouts.build_rows)."""
        t = build_rows([[(j, self.index.fetch(j)) for j in self.rows[i]]], self.seq_len,
                       with_ref=self.index.with_ref, with_gen=self.index.with_gen)
        return {k: v[0] for k, v in t.items() if k != "meta"}

    def __iter__(self):
        while True:
            g = self._g
            self._g += 1
            if (g // self.block) % self.world != self.rank:
                continue
            t = self.row(g % self.n)
            yield trainer_sample(t, self._num_seqs(g // self.step_rows))

    def state_dict(self):
        return {"row": self._g}

    def load_state_dict(self, state):
        self._g = int(state["row"])


class RolloutDataLoader(ParallelAwareDataloader):
    """Packed RL rollouts for the policy losses (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        path: str = ""
        global_batch: int = -1  # rows per optimizer step; -1: local batch x data-parallel ranks
        follow: bool = False  # data.follow: read shards as a generator writes them (components/data/follow.py)
        max_lag: int = -1  # rl.max_lag (follow): drop records more versions behind; -1: keep all
        publish_interval: int = 0  # publish.interval: the trainer's version is the step it last published
        vocab_size: int = 0  # follow: token ids checked as shards arrive
        routing: tuple = ()  # follow with moe.routing_replay: (MoE layers, top-k, experts), checked as shards arrive

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        del tokenizer  # rollouts come tokenized
        step_rows = config.global_batch if config.global_batch > 0 else local_batch_size * dp_world_size
        if config.follow:
            ds = FollowRows(config.path, seq_len=seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size,
                            local_batch=local_batch_size, global_batch=step_rows,
                            max_lag=config.max_lag if config.max_lag >= 0 else None,
                            publish_interval=config.publish_interval, vocab_size=config.vocab_size,
                            routing=tuple(config.routing) or None)
        else:
            ds = RolloutRows(config.path, seq_len=seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size,
                             local_batch=local_batch_size, global_batch=step_rows)
        super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, num_workers=config.num_workers,
                         batch_size=local_batch_size, snapshot_every_n_steps=snapshot_every_n_steps)

    def load_state_dict(self, state_dict) -> None:
        """As torchtitan's; a followed stream also takes its position now (not at the first batch), so
        the trainer's wait before the first resumed step asks about the right step."""
        super().load_state_dict(state_dict)
        pending = getattr(self, "next_iter_state", None)
        if isinstance(self.dataset, FollowRows) and pending and pending.get("dataset_state") is not None:
            self.dataset.load_state_dict(pending["dataset_state"])

