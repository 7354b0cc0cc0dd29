"""apiary's tools: plan, compare, probe, launch, show/export, warmup and the `apiary` command
(toolkit.cli). Tools import framework (the training path); framework never imports toolkit."""

import framework  # noqa: F401  (first: its device shims must run before any tool imports torchtitan)
