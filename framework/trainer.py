"""apiary's torchtitan ``Trainer``: torchtitan's, plus the RL batch path.

The rollout loader's samples carry per-token RL tensors (``rl_*``: old log-probs, advantages,
sequence ids, ...) next to ``input`` and ``positions``. torchtitan would pass every extra key to
the model's forward, so ``post_dataloading_process`` takes them out first, lets torchtitan shard
inputs, labels and positions for context parallelism, shards the per-token ``rl_*`` tensors the
same way (same load balancer, so token t of every tensor lands on the same rank), and hands them
to the policy loss together with the context-parallel group. Batches without ``rl_*`` keys go
through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.trainer import Trainer

from components.data.rollout_loader import RL_KEYS, STEP_KEYS


class ApiaryTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        if hasattr(self.loss_fn, "set_batch"):  # policy losses log their clip fractions / KL
            self.metrics_processor.extra_source = lambda: {f"policy/{k}": float(v)
                                                           for k, v in self.loss_fn.metrics.items()}

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
