"""apiary's torchtitan ``Trainer``: torchtitan's, plus the RL batch path.

The data component names the extra batch keys (``batch_keys`` per token, ``step_keys`` per
sample; the rollout loader's samples carry per-token RL tensors (``rl_*``: old log-probs, advantages,
sequence ids, ...) next to ``input`` and ``positions``). torchtitan would pass every extra key to
the model's forward, so ``post_dataloading_process`` takes them out first, lets torchtitan shard
inputs, labels and positions for context parallelism, shards the per-token ``rl_*`` tensors the
same way (same load balancer, so token t of every tensor lands on the same rank), and hands them
to the policy loss together with the context-parallel group. Batches without ``rl_*`` keys go
through unchanged.

Non-finite guard (``training.on_nonfinite``): every micro-step's loss and the step's global grad
norm (torchtitan's ``clip_grad_norm_``) are checked before ``optimizers.step()``; one all-reduced
flag makes every rank decide alike. ``stop`` raises ``NonFiniteStop`` (exit 76) with no update
applied; ``skip`` leaves the optimizer, its state and the LR schedule untouched for that step
(the schedule counts applied updates; the data moves on), counts it in metrics.jsonl
(``skipped_steps``, ``nonfinite``) and stops like ``stop`` once more than ``training.max_skips``
steps in a row would be skipped. Each checkpoint save first checks that the model and optimizer
state are finite, and writes atomically with a manifest (framework/train/integrity.py).

Memory listeners (``contracts.add_memory_listener``, e.g. recompute=auto's per-block wrappers): after
each step the CUDA caching allocator's retries in that step, the most over all ranks (one small
all-reduce, only in runs with a listener), go to each listener; a reaction's line is printed on rank 0,
its learned state written to the run folder (``contracts.LEARNED_FILE``) and its metrics logged.

Policy metrics (clip fractions, KL, entropy) are reduced over the step's micro-steps and the
data/context-parallel ranks, weighted by trained tokens. Under context parallelism it also reports a true
``max_loss``: torchtitan divides each rank's loss by the tokens of its whole (unsharded) sequences, so its max
over ranks is a max of CP shares (about loss / cp). Here each data-parallel rank's loss is summed over its CP group and
divided by that rank's tokens, then the max is taken over data parallel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed.context_parallel.api import cp_shard
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from framework import compat, contracts, devices
from framework.compose.schema import TrainingConfig
from framework.train import atomic_save, first_step, integrity, learned
from framework.train.follow import FollowMode, FollowStop
from framework.train.preempt import Guard

_GRAD_NORM = compat.LAST_GRAD_NORM  # the last global grad norm torchtitan's clip_grad_norm_ returned


def _init_from_seed() -> None:
    """The model's initial weights depend on ``training.seed`` alone: the CPU and CUDA generators'
    states right after torchtitan's ``set_determinism`` are put back just before the model's
    ``init_weights``, whatever ran in between. Building and parallelizing the model may draw
    random numbers: with precision.backend=te, TransformerEngine's linears advanced the CUDA
    generator by 288 before the initialization (measured on an H200), which gave that run other
    initial weights than bf16 at the same seed (the patch: framework/compat/torchtitan_patches.py)."""
    compat.init_weights_from_seed()


class ApiaryTrainer(FollowMode, Trainer):
    # Set when follow mode stopped waiting for data (a timeout, a malformed shard, a signal), and read
    # by framework/train/run.py after the loop; None when the loop ended any other way.
    follow_stop: FollowStop | None = None
    # The preemption guard framework/train/preempt.install hooked on this trainer (run.py, after the
    # build); None until then. Follow mode reads it to say whether its last step was saved.
    preempt_guard: Guard | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        on_nonfinite: str = TrainingConfig.on_nonfinite  # stop | skip (training.on_nonfinite; its default there)
        max_skips: int = TrainingConfig.max_skips  # skip: stop after more than this many non-finite steps in a row
        resume_hint: str = ""  # how to rerun this run (printed when it stops on a non-finite step)
        keep_checkpoints: int = 0  # checkpoint.keep_latest_k (0: all), applied as each step completes
        batch_keys: tuple = ()  # per-token batch tensors for the loss (the data component's BATCH_KEYS)
        step_keys: tuple = ()  # per-sample batch tensors for the loss (its STEP_KEYS)
        follow_wait_timeout: float = 0.0  # > 0: the dataloader follows a growing folder (data.follow); seconds
        publish: object = None  # framework.train.publish.PublishSettings, or None (publish.interval=0)
        validation_dataloader: object = None  # the data component's held-out loader config (validation.*)

    @property
    def _loss_set_batch(self):
        """The loss's ``set_batch`` (contracts.LossFn), or None for a loss that reads no batch keys."""
        return contracts.member(self.loss_fn, "loss_fn", "set_batch")

    def __init__(self, config, **kwargs):
        _init_from_seed()
        super().__init__(config, **kwargs)
        self._skips_total = self._skips_in_row = 0
        self._nonfinite: set[int] = set()  # this process's non-finite steps (skipped or stopped): integrity.restart_hint
        self.begin_step()
        compat.patch_clip_grad_norm()  # keeps the grad norm train_step computes (local to it) for the finite check
        self._step_optimizers, self._step_schedulers = compat.guard_trainer_steps(
            self, lambda original, *a, **k: self._guarded_optimizer_step(*a, **k),
            lambda original, *a, **k: self._guarded_scheduler_step(*a, **k))
        # components that react to the allocator's retries (contracts.add_memory_listener); their metrics
        self._memory_listeners, self._retries_before = contracts.memory_listeners(self.model_parts), 0
        skip = self.config.on_nonfinite == "skip"
        if skip or self._memory_listeners:
            def log_with_extras(log, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
                extra = dict(extra_metrics or {})
                if skip:
                    if self._skipped_now and self._loss_was_bad:  # the logged copy was zeroed (see below)
                        global_avg_loss = global_max_loss = float("nan")
                    extra.update({"health/skipped_steps": self._skips_total, "health/nonfinite": int(self._skipped_now)})
                for listener in self._memory_listeners:
                    extra.update({f"memory/{k}": v for k, v in listener.metrics.items()})
                return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

            self.metrics_processor.log_wrapper = log_with_extras
        self._atomic = atomic_save.install_atomic_save(self.checkpointer, before_save=self._check_state_finite,
                                                       keep=self.config.keep_checkpoints) if self.checkpointer.enable else None
        if self._loss_set_batch is not None:  # policy losses log their clip fractions / KL / entropy
            self.metrics_processor.extra_source = self._extra_metrics
        elif isinstance(getattr(self.dataloader, "dataset", None), (contracts.FollowedData, contracts.DataStepMetrics)):
            self.metrics_processor.extra_source = self._extra_metrics  # a dataset's own scalars (data/...)
        if self.parallel_dims.cp_enabled and not self.parallel_dims.pp_enabled:
            self.metrics_processor.max_loss_source = self._max_loss_over_dp
        if self.parallel_dims.pp_enabled:  # the held-out loss too: only the last stage computes it
            self.metrics_processor.stage_loss_source = lambda v: float(
                self._last_stage_loss(torch.as_tensor(float(v), device=self.device)))
        self._follow_source = self.follow_stop = self.preempt_guard = None
        self._ledger_started, self._waited_s, self._start_step = False, 0.0, None
        self._publisher, self._published_initial = None, False
        if self.config.publish is not None:
            from framework.train.publish import Publisher  # reason: only runs that publish weights

            self._publisher = Publisher(self.config.publish, self)

    def train(self):
        """torchtitan's loop. One process (world size 1) skips the 2 s sleep that ends it on rank 0
        ("for other ranks to complete": there are none; compat.no_closing_sleep); a larger world keeps it."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = super().train()
        else:
            with compat.no_closing_sleep():
                out = super().train()
        self.flush_publication()  # the last weights reach the engine (publish.when_busy=skip may have deferred them)
        return out

    def flush_publication(self) -> None:
        """A version deferred while the engine took the last one goes now (every rank, between steps)."""
        if self._publisher is not None:
            self._publisher.flush(self)

    def close(self) -> None:
        if getattr(self, "_publisher", None) is not None:  # a background publication lands first
            self._publisher.close()
        if getattr(self, "_atomic", None) is not None:  # the last saves become visible (step-N) now
            self._atomic.finish()
        super().close()

    def train_step(self, data_iterator):
        if self._publisher is not None and not self._published_initial:  # the weights this run starts from
            self._published_initial = True
            t0 = time.monotonic()
            self._publisher.publish(self, self.step - 1, initial=True)
            first_step.STATE.before_first_step(publish_s=time.monotonic() - t0)  # not the trainer's build
        if self._start_step is None:
            self._start_step = self.step - 1  # the step this process started from (0, or the resumed one)
        if self.config.follow_wait_timeout > 0:
            self._wait_for_data()
            first_step.STATE.before_first_step(data_wait_s=self._waited_s)  # counted only before the first step
        first_step.STATE.step_started()  # the first step's breakdown (framework/train/first_step.py)
        self.begin_step()
        out = super().train_step(data_iterator)
        self._after_step()
        return out

    def begin_step(self) -> None:
        """Clears this step's sums over its micro-steps (policy metrics x trained tokens, loss shares, tokens, the
        finite checks): in train_step, and in the step-0 probe (toolkit/probe.py), which runs the micro-steps itself."""
        self._policy_sums, self._policy_tokens = {}, 0.0
        self._loss_share, self._rank_tokens, self._global_tokens = 0.0, 0, None
        self._bad_loss, self._skipped_now, self._loss_was_bad = None, False, False
        _GRAD_NORM[0] = None

    def _after_step(self) -> None:
        """After step ``self.step`` was applied: the allocator's retries to the memory listeners, the
        rollout ledger (follow mode), then publication."""
        if self._memory_listeners:
            self._react_to_retries()
        if self._follow_source is not None:
            self._write_ledger()
        if self._publisher is not None:
            self._publisher.maybe_publish(self, self.step)

    def _react_to_retries(self) -> None:
        """The allocator's retries in this step (the most of any rank: one small all-reduce, so every
        rank's listeners decide alike) to each memory listener; a reaction's line is printed (rank 0)
        and its learned state written into the run folder (contracts.LEARNED_FILE, under its kind)."""
        now = int(devices.allocator_counters().get("alloc_retries", 0))
        mine, self._retries_before = max(0, now - self._retries_before), now
        t = torch.tensor([mine], device=self.device, dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        retries = int(t.item())
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        for listener in self._memory_listeners:
            reaction = listener.on_step(self.step, self.step - self._start_step, retries)
            if reaction is None or not rank0:
                continue
            jsonl = self.metrics_processor._jsonl
            (jsonl.progress.note if jsonl is not None else print)(reaction.line)
            if reaction.learned:
                learned.record(self.config.dump_folder, listener.kind, reaction.learned)

    # -- the non-finite guard ----------------------------------------------------------------
    def _agree(self, flags: list) -> list[bool]:
        """Each flag OR-ed over every rank (one small all-reduce on the default group)."""
        t = torch.stack([torch.as_tensor(f, device=self.device).float().reshape(()) for f in flags])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def _guarded_optimizer_step(self, *args, **kwargs):
        norm = _GRAD_NORM[0]
        bad_loss = self._bad_loss if self._bad_loss is not None else torch.zeros((), dtype=torch.bool)
        bad_norm = ~torch.isfinite(norm.detach().float()) if norm is not None else torch.zeros((), dtype=torch.bool)
        if isinstance(bad_norm, torch.Tensor) and hasattr(bad_norm, "full_tensor"):
            bad_norm = bad_norm.full_tensor()
        loss_bad, norm_bad = self._agree([bad_loss, bad_norm])
        if not (loss_bad or norm_bad):
            self._skips_in_row = 0
            return self._step_optimizers(*args, **kwargs)
        what = " and ".join(w for w, b in (("the loss", loss_bad), ("the gradient norm", norm_bad)) if b)
        self._nonfinite.add(self.step)
        if self.config.on_nonfinite == "skip" and self._skips_in_row < self.config.max_skips:
            self._skips_in_row += 1
            self._skips_total += 1
            self._skipped_now, self._loss_was_bad = True, loss_bad
            self.optimizers.zero_grad()
            logger.warning(f"step {self.step}: {what} is not finite; update skipped "
                           f"({self._skips_in_row} in a row, {self._skips_total} in all)")
            return None
        self._stop_nonfinite(what)

    def _guarded_scheduler_step(self, *args, **kwargs):
        if self._skipped_now:  # the schedule counts applied updates
            return None
        return self._step_schedulers(*args, **kwargs)

    def _stop_nonfinite(self, what: str) -> None:
        if getattr(self, "_atomic", None) is not None:
            self._atomic.finish()  # the saves before this step are complete before naming the last good one
        ck = Path(self.config.dump_folder) / self.config.checkpoint.folder
        norm = _GRAD_NORM[0]
        norm_s = f"{float(norm.full_tensor() if hasattr(norm, 'full_tensor') else norm):.4g}" if norm is not None else "?"
        if self.config.on_nonfinite == "skip":
            why = (f"more than training.max_skips={self.config.max_skips} steps in a row were non-finite, "
                   f"{self._skips_total} skipped in all")
            tries = "lower optimizer.lr or training.max_norm (a resume may change both)"
        else:
            why = "training.on_nonfinite=stop"
            tries = ("lower optimizer.lr or training.max_norm (a resume may change both); or set "
                     "training.on_nonfinite=skip to skip such steps (training.max_skips in a row)")
        hint = integrity.restart_hint(ck, self.config.resume_hint, self._nonfinite)
        raise integrity.NonFiniteStop(
            f"apiary: step {self.step}: {what} is not finite (grad norm {norm_s}); no update was applied and "
            f"nothing was saved from this step ({why}). {hint} after a "
            f"change: {tries}. Exit code {integrity.EXIT_NONFINITE}.")

    def _check_state_finite(self) -> None:
        """Before any checkpoint is written: every model and optimizer tensor is finite (all ranks)."""
        if isinstance(self.optimizers, contracts.StagedHostState):  # state.offload_update=device: copies in flight
            self.optimizers.host_state_ready()
        flags = []
        for m in self.model_parts:
            for p in m.parameters():
                t = p.to_local() if hasattr(p, "to_local") else p
                if t.is_floating_point() and t.numel():
                    flags.append(~torch.isfinite(t.detach()).all())
        for opt in getattr(self.optimizers, "optimizers", [self.optimizers]):
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                        t = v.to_local() if hasattr(v, "to_local") else v
                        flags.append(~torch.isfinite(t).all())
        by_device: dict = {}  # optimizer state may live on the host (state.offload=optimizer)
        for f in flags:
            by_device.setdefault(f.device, []).append(f)
        bad = any(bool(torch.stack(fs).any()) for fs in by_device.values())
        if self._agree([bad])[0]:
            if getattr(self, "_atomic", None) is not None:
                self._atomic.finish()
            ck = Path(self.config.dump_folder) / self.config.checkpoint.folder
            hint = integrity.restart_hint(ck, self.config.resume_hint, self._nonfinite)
            raise integrity.NonFiniteStop(
                f"apiary: step {self.step}: the model or optimizer state holds NaN or Inf values; the checkpoint "
                f"of this step was not written. {hint} after lowering "
                f"optimizer.lr or training.max_norm. Exit code {integrity.EXIT_NONFINITE}.")

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)
        if self.parallel_dims.pp_enabled and self.metrics_processor.should_log(self.step):
            loss = self._last_stage_loss(loss)
        bad = ~torch.isfinite(loss.detach().float()).all()  # stays on device: no sync here
        self._bad_loss = bad if self._bad_loss is None else (self._bad_loss | bad)
        if self.config.on_nonfinite == "skip":  # only the logged copy: torchtitan raises on a NaN it logs
            loss = torch.where(bad, torch.zeros_like(loss), loss)
        weight = contracts.member(self.loss_fn, "loss_fn", "metric_weight")
        if self.metrics_processor.extra_source is not None and weight is not None:
            w = weight.float()
            for k, v in contracts.member(self.loss_fn, "loss_fn", "metrics").items():
                if k.endswith("_max"):  # a max over the step's micro-steps that had trained tokens (no sync)
                    v = torch.where(w > 0, v.float(), torch.full_like(v.float(), float("-inf")))
                    self._policy_sums[k] = v if k not in self._policy_sums else torch.maximum(self._policy_sums[k], v)
                else:
                    self._policy_sums[k] = self._policy_sums.get(k, 0.0) + v.float() * w
            self._policy_tokens = self._policy_tokens + w
        if self.metrics_processor.max_loss_source is not None:
            self._loss_share = self._loss_share + loss.detach().float()
            self._rank_tokens = self._rank_tokens + (labels != IGNORE_INDEX).sum()  # before CP sharding
            self._global_tokens = global_valid_tokens
        return loss

    def _last_stage_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """With pipeline stages only the last one computes the loss (torchtitan returns -1 on the
        others, which rank 0, a first stage, logged; its validator likewise): the last stage's loss,
        summed over the stage group with 0 from the others, so every stage logs the real loss. One
        scalar all-reduce, on the steps that are logged and at each validation."""
        mine = loss.detach().float().sum() if self.pp_has_last_stage else torch.zeros((), device=loss.device)
        dist.all_reduce(mine, group=self.parallel_dims.get_mesh("pp").get_group())
        return mine

    def _extra_metrics(self) -> dict[str, float]:
        """The step's extra scalars: policy metrics (a collective), and what a followed stream consumed."""
        out = self._policy_metrics() if self._loss_set_batch is not None else {}
        if self._follow_source is not None:
            out.update(self._follow_source.step_metrics(self.step))
            out["data/waited_s"] = float(self._waited_s)
        elif isinstance(dataset := getattr(self.dataloader, "dataset", None), contracts.DataStepMetrics):
            out.update(dataset.step_metrics(self.step))  # a static rollout file: the step's mean reward
        return out

    def _policy_metrics(self) -> dict[str, float]:
        """The policy metrics as means over the step's trained tokens: each micro-step's value
        weighed by its local trained tokens, summed over micro-steps and data/context-parallel
        ranks (a collective: every rank calls it when a step is logged). A key ending in ``_max``
        is the max over the micro-steps and ranks that had trained tokens (0 where none had)."""
        if not self._policy_sums:
            return {}
        keys = sorted(k for k in self._policy_sums if not k.endswith("_max"))
        max_keys = sorted(k for k in self._policy_sums if k.endswith("_max"))
        sums = torch.stack([torch.as_tensor(v).float() for v in (*(self._policy_sums[k] for k in keys),
                                                                 self._policy_tokens)])
        maxes = torch.stack([torch.as_tensor(self._policy_sums[k]).float().to(sums.device) for k in max_keys]) \
            if max_keys else None
        mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
        if mesh is not None:
            dist.all_reduce(sums, group=mesh.get_group())
            if maxes is not None:
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=mesh.get_group())
        out = {f"policy/{k}": float(v / sums[-1].clamp_min(1)) for k, v in zip(keys, sums[:-1])}
        for k, v in zip(max_keys, maxes if maxes is not None else ()):
            out[f"policy/{k}"] = float(v) if torch.isfinite(v) else 0.0
        return dict(sorted(out.items()))

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
        keys = (*self.config.batch_keys, *self.config.step_keys)
        rl = {k: input_dict.pop(k) for k in keys if k in input_dict}
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        # per-token model inputs a component registered on the model (contracts.add_batch_consumer)
        consumers = contracts.batch_consumers(self.model_parts)
        if self._loss_set_batch is None and not consumers:
            return inputs, labels, extra_kwargs
        group = None
        if rl and self.parallel_dims.cp_enabled:  # seq dim 1; trailing dims ([B, T, ...]) are kept
            per_token = [k for k in self.config.batch_keys if k in rl]
            cp_mesh = self.parallel_dims.get_mesh("cp")
            sharded, _ = cp_shard(cp_mesh, tuple(rl[k] for k in per_token), None,
                                  self.config.parallelism.context_parallel_load_balancer)
            rl.update(zip(per_token, sharded))
            group = cp_mesh.get_group()
        for key, fns in consumers.items():  # every micro-batch: its tensor, or None (stale state is cleared)
            for fn in fns:
                fn(rl.get(key))
        if self._loss_set_batch is not None:
            self._loss_set_batch(rl, group)
        return inputs, labels, extra_kwargs
