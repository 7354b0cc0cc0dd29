"""Validation loss on held-out text (``validation.*``).

torchtitan's ``Validator`` does the pass: the model in eval mode under ``torch.no_grad``, the same
loss as training over ``validation.steps`` batches that are the same every time (a fresh loader of
the held-out set per pass), summed over data- and context-parallel ranks, the model put back in
training mode. apiary runs it at step 1, every ``validation.interval`` steps and at the last step;
its loss is ``val_loss`` in the step's metrics.jsonl record (framework/report/metrics.py),
``validation_metrics/loss`` in TensorBoard, and it shows in the progress line and the summary.
Which documents are held out is the data component's choice (components/data/formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass


def validator_config(dataloader, interval: int, steps: int, last_step: int):
    """torchtitan's validator config for a validation ``dataloader`` config."""
    from torchtitan.components.validate import Validator  # reason: imports torch (workers only)

    class HeldOutValidator(Validator):
        @dataclass(kw_only=True, slots=True)
        class Config(Validator.Config):
            last_step: int = 0  # training.steps: validated whatever the interval

        def should_validate(self, step: int) -> bool:
            return step == 1 or step % self.config.freq == 0 or step == self.config.last_step

    return HeldOutValidator.Config(enable=True, freq=interval, steps=steps, dataloader=dataloader,
                                   last_step=last_step)
