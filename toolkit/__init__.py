"""apiary's tools: plan, compare, probe, launch, show/export, warmup and the `apiary` command
(toolkit.cli). Tools import framework (the training path); framework never imports toolkit."""
