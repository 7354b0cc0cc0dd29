"""On each rank: torchtitan's Trainer.Config built from the resolved run (build.py), apiary's Trainer
(trainer.py), the worker's run (run.py), atomic checkpoints (integrity.py), weight publication
(publish.py), preemption (preempt/), kernel caches and autotuning tables, the first step's timing."""
