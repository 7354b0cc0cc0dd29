"""The planner: per-GPU memory and step-time estimate for a resolved recipe, before any launch.

Memory is a list of named terms, each ``count x bytes_per`` (a tensor's element count times the
bytes of one element), for the busiest pipeline stage:

* static state: parameters, gradients, optimizer states (fp32 master + Adam moments), sharded
  as the state backend shards them;
* activations as the recompute policy keeps them, per layer kind (what the model's
  ``ModelFacts.layer_kinds`` say, and norms) on the local tokens ``micro_batch x seq_len / cp``
  (divided by TP: sequence parallel);
* MoE dispatch/combine buffers, the loss's temporaries, the state backend's all-gather /
  reduce-scatter or gradient buckets, CP buffers;
* a reserve for the CUDA context, NCCL and allocator fragmentation.

Step time is a roofline: model FLOPs per part (dense GEMMs, routed experts, each mixer layer
kind's own, LM head) over the GPU's peak times a per-part efficiency, plus recompute, plus the
exposed (not overlapped) part of EP / CP / TP / state-backend traffic over NVLink or IB, times the
pipeline bubble, plus the optimizer step.

Every number the estimate uses lives in ``Constants`` with its reason (the components' and the
layer kinds' own in their ``PLAN_CONSTANTS``, gathered into it); a calibration dict (dotted keys,
e.g. ``{"eff_expert": 0.35, "hardware.H100.ib_bw": 40e9}``) overrides any of them.
The memory estimate has been compared with measured GPU peaks (docs/benchmarks.md; each GPU run's
``estimate_for_run`` writes the estimate next to its measured peak, ``plan_error_fraction``).

The package knows no component and no layer kind: each chosen component (registry kinds loss,
state, recompute, moe_chunk, precision, adapter) adds its terms through ``plan_terms(options, ctx)
-> PlanTerms`` (framework.contracts), asked through ``framework.compose.registry`` (``parts``), and each of
the model's layer kinds through ``LayerKind.plan_terms(shape) -> LayerTerms``. Modules: ``constants``
(GPU table, Constants, calibration), ``memory`` (shapes, terms per stage), ``time`` (step time),
``estimate`` (``plan``), ``search`` (layouts and choices that fit), ``records`` (next to a run).
"""

from framework.errors import UserError
from framework.plan.planner.constants import HARDWARE, Constants, GiB, Hardware, MiB
from framework.plan.planner.estimate import Plan, model_flops_per_token, plan
from framework.plan.planner.memory import Term, layer_counts, param_split, per_token_saved
from framework.plan.planner.records import detect_gpu, estimate_for_run, merge_into_last_record
from framework.plan.planner.search import search

_param_split = param_split  # the name tests and benchmarks have used

__all__ = ["GiB", "HARDWARE", "MiB", "Constants", "Hardware", "Plan", "Term", "UserError", "detect_gpu",
           "estimate_for_run", "layer_counts", "merge_into_last_record", "model_flops_per_token", "param_split",
           "per_token_saved", "plan", "search"]
