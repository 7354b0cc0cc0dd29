"""apiary's torchtitan ``Trainer``: torchtitan's, plus the RL batch path.

The rollout loader's samples carry per-token RL tensors (``rl_*``: old log-probs, advantages,
sequence ids, ...) next to ``input`` and ``positions``. torchtitan would pass every extra key to
the model's forward, so ``post_dataloading_process`` takes them out first, lets torchtitan shard
inputs, labels and positions for context parallelism, shards the per-token ``rl_*`` tensors the
same way (same load balancer, so token t of every tensor lands on the same rank), and hands them
to the policy loss together with the context-parallel group. Batches without ``rl_*`` keys go
through unchanged.

Policy metrics (clip fractions, KL, entropy) are reduced over the step's micro-steps and the
data/context-parallel ranks, weighted by trained tokens. Under context parallelism it also
reports a true ``max_loss``: torchtitan divides each rank's
loss by the tokens of its whole (unsharded) sequences, so its max over ranks is a max of CP
shares (about loss / cp). Here each data-parallel rank's loss is summed over its CP group and
divided by that rank's tokens, then the max is taken over data parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.trainer import Trainer

from components.data.rollout_loader import RL_KEYS, STEP_KEYS


class ApiaryTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        if hasattr(self.loss_fn, "set_batch"):  # policy losses log their clip fractions / KL / entropy
            self.metrics_processor.extra_source = self._policy_metrics
        if self.parallel_dims.cp_enabled and not self.parallel_dims.pp_enabled:
            self.metrics_processor.max_loss_source = self._max_loss_over_dp

    def train_step(self, data_iterator):
        from framework import first_step

        first_step.STATE.step_started()  # the first step's breakdown (framework/first_step.py)
        # this step's sums over its micro-steps: policy metrics x trained tokens, loss shares, tokens
        self._policy_sums, self._policy_tokens = {}, 0.0
        self._loss_share, self._rank_tokens, self._global_tokens = 0.0, 0, None
        return super().train_step(data_iterator)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)
        if self.metrics_processor.extra_source is not None and self.loss_fn.metric_weight is not None:
            w = self.loss_fn.metric_weight.float()
            for k, v in self.loss_fn.metrics.items():
                self._policy_sums[k] = self._policy_sums.get(k, 0.0) + v.float() * w
            self._policy_tokens = self._policy_tokens + w
        if self.metrics_processor.max_loss_source is not None:
            self._loss_share = self._loss_share + loss.detach().float()
            self._rank_tokens = self._rank_tokens + (labels != IGNORE_INDEX).sum()  # before CP sharding
            self._global_tokens = global_valid_tokens
        return loss

    def _policy_metrics(self) -> dict[str, float]:
        """The policy metrics as means over the step's trained tokens: each micro-step's value
        weighed by its local trained tokens, summed over micro-steps and data/context-parallel
        ranks (a collective: every rank calls it when a step is logged)."""
        if not self._policy_sums:
            return {}
        keys = sorted(self._policy_sums)
        sums = torch.stack([torch.as_tensor(v).float() for v in (*(self._policy_sums[k] for k in keys),
                                                                 self._policy_tokens)])
        mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
        if mesh is not None:
            dist.all_reduce(sums, group=mesh.get_group())
        return {f"policy/{k}": float(v / sums[-1].clamp_min(1)) for k, v in zip(keys, sums[:-1])}

    def _max_loss_over_dp(self) -> float:
        """Max over data-parallel ranks of each rank's mean loss (its CP group's shares summed)."""
        share = self._loss_share.clone()
        dist.all_reduce(share, group=self.parallel_dims.get_mesh("cp").get_group())
        tokens = torch.as_tensor(self._rank_tokens, device=share.device).clamp_min(1)
        mean = share * self._global_tokens / tokens
        batch = self.parallel_dims.get_optional_mesh("batch")
        if batch is not None:
            dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=batch.get_group())
        return float(mean)

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        rl = {k: input_dict.pop(k) for k in (*RL_KEYS, *STEP_KEYS) if k in input_dict}
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if not hasattr(self.loss_fn, "set_batch"):
            return inputs, labels, extra_kwargs
        group = None
        if rl and self.parallel_dims.cp_enabled:
            from torchtitan.distributed.context_parallel.api import cp_shard

            per_token = [k for k in RL_KEYS if k in rl]
            cp_mesh = self.parallel_dims.get_mesh("cp")
            sharded, _ = cp_shard(cp_mesh, tuple(rl[k] for k in per_token), None,
                                  self.config.parallelism.context_parallel_load_balancer)
            rl.update(zip(per_token, sharded))
            group = cp_mesh.get_group()
        self.loss_fn.set_batch(rl, group)
        return inputs, labels, extra_kwargs
