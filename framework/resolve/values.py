"""Value ranges of the framework's own keys and the learning-rate schedule's fit.

    check(cfg, overrides) -> notes

runs them all, the ranges first; the notes say what a schedule cut short on the command line shortened
(the run's first lines, after the components' own).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from framework.compose import schema
from framework.errors import UserError, did_you_mean
from framework.resolve import resume

_MAX_STEPS = 2 ** 63 - 1  # torch's int64: the step counters a checkpoint and the LR scheduler keep


# Values every recipe must keep in range: (key, test, rule, fix). Checked before anything starts.
_RANGES = [
    ("training.steps", lambda v: 1 <= v <= _MAX_STEPS, "must be >= 1 and at most 2**63-1 (the largest step a "
     "checkpoint records)", "Set training.steps to the number of optimizer steps."),
    ("training.seq_len", lambda v: v >= 2, "must be >= 2 (a token and its next)", "For example training.seq_len=256."),
    ("training.local_batch", lambda v: v >= 1, "must be >= 1", "For example training.local_batch=2."),
    ("training.global_batch", lambda v: v is None or v >= 1, "must be >= 1 (or null: local x data-parallel)", ""),
    ("training.max_norm", lambda v: v > 0, "must be > 0 (gradients are clipped to this norm; 0 would zero "
     "every gradient)", "To clip nothing, set training.max_norm=inf."),
    ("optimizer.lr", lambda v: v >= 0 and v != float("inf"), "must be a finite number >= 0 (0: a control run "
     "whose weights never change)", "For example optimizer.lr=3e-4."),
    ("optimizer.weight_decay", lambda v: 0 <= v < float("inf"), "must be a finite number >= 0 (inf would make "
     "the weights infinite at the first step)", "For example optimizer.weight_decay=0.1; 0 for none."),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", ""),
    ("optimizer.eps", lambda v: 0 < v < float("inf"), "must be a finite number > 0 (inf divides every update "
     "to 0: nothing would train)", "For example optimizer.eps=1e-8."),
    ("moe.load_balance_coeff", lambda v: v is None or 0 < v < float("inf"), "must be > 0 and finite (the step "
     "of the MoE routing bias that balances the experts' load)",
     "To turn the balancing off, set moe.load_balance_coeff=null."),
    ("lr.warmup_steps", lambda v: v >= 0, "must be >= 0", "Set 0 for no warm-up."),
    ("lr.decay_ratio", lambda v: v is None or 0 <= v <= 1, "must be in [0, 1] (or null)", ""),
    ("lr.min_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]", ""),
    ("lr.total_steps", lambda v: v is None or 1 <= v <= _MAX_STEPS, "must be >= 1 and at most 2**63-1 (the "
     "steps the schedule spans) or null (training.steps)", ""),
    ("checkpoint.interval", lambda v: v >= 1, "must be >= 1 (steps between saves)",
     "To save no checkpoints, set checkpoint.enable=false."),
    ("checkpoint.keep_latest_k", lambda v: v == 0 or v >= 2, "must be 0 (keep all) or >= 2 (the newest steps "
     "kept; torchtitan keeps at least 2, as the last may still be being written)", "For example "
     "checkpoint.keep_latest_k=2."),
    ("model.vocab_size", lambda v: v is None or v >= 2, "must be >= 2 (the token ids the model predicts among) or "
     "null (the flavor's)", "Leave it out for the flavor's vocabulary, or give the tokenizer's size."),
    ("logging.log_freq", lambda v: v >= 1, "must be >= 1 (steps between metrics records)",
     "For example logging.log_freq=1."),
    ("training.seed", lambda v: -2 ** 63 <= v <= 2 ** 64 - 1, "must be an integer from -2**63 to 2**64-1 (the "
     "range torch.manual_seed accepts)", "For example training.seed=42."),
    ("parallel.gpus", lambda v: v is None or v >= 1, "must be >= 1 (the GPU count the recipe is laid out for) or "
     "null", ""),
    ("parallel.dp_replicate", lambda v: v >= 1, "must be >= 1 (the replicated copies of the model; 1: none)",
     "For example parallel.dp_replicate=1."),
    *((f"parallel.{dim}", lambda v: v is None or v >= 1, "must be >= 1 (a parallel degree; 1: not split that "
       "way), or null to derive it from the layout table", f"For example parallel.{dim}=1, or ~parallel.{dim}.")
      for dim in ("dp_shard", "cp", "ep", "pp", "tp")),
    ("parallel.pp_microbatch_size", lambda v: v >= 1, "must be >= 1 (sequences per pipeline microbatch)",
     "For example parallel.pp_microbatch_size=1."),
]


# torch.distributed.pipelining's schedule names (get_schedule_class; matched without case, as there);
# checked whatever parallel.pp (tests/test_bad_inputs_config.py compares the list with torch's)
PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                "DualPipeV")


def check_values(cfg) -> None:
    """Numbers out of range and names outside their set, each named by its key."""
    for key, ok, rule, fix in _RANGES:
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            raise UserError(f"{key}={value}", f"{rule}.", fix)
    for key, names in schema.choices().items():  # the schema's one_of keys
        value = OmegaConf.select(cfg, key)
        if value not in names:
            raise UserError(f"{key}={value}", f"unknown; valid: {', '.join(names)}.", did_you_mean(str(value), names))
    schedule = str(cfg.parallel.pp_schedule)
    if schedule.lower() not in {s.lower() for s in PP_SCHEDULES}:
        raise UserError(f"parallel.pp_schedule={schedule}", f"unknown pipeline schedule; valid: "
                        f"{', '.join(PP_SCHEDULES)} (read only with parallel.pp > 1).",
                        did_you_mean(schedule, PP_SCHEDULES) or "The default is 1F1B.")
    if cfg.output_dir is not None and not str(cfg.output_dir).strip():
        raise UserError("output_dir=", "is empty, which names the current folder: the run would write its "
                        "config, metrics and checkpoints among the files there.",
                        "Name a folder (output_dir=runs/my_run), or leave output_dir out for "
                        "runs/RECIPE/TIMESTAMP.")


def check_warmup(cfg, overrides: list[str], notes: list[str]) -> None:
    """lr.warmup_steps must be shorter than the schedule (lr.total_steps, else training.steps): a warm-up
    that never ends never reaches optimizer.lr. One case is shortened instead, and the run's first lines
    say so: a schedule cut short on the command line (training.steps=N or lr.total_steps=N: a smoke test,
    a benchmark, the resume command a finished run prints) below the warm-up the recipe sets."""
    warmup, total = int(cfg.lr.warmup_steps), resume.horizon(cfg)
    if warmup < total:
        return
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    horizon_key = "lr.total_steps" if cfg.lr.total_steps is not None else "training.steps"
    if horizon_key in given and "lr.warmup_steps" not in given:
        used = resume.warmup_steps(cfg)
        notes.append(f"lr: warm-up shortened to {used} step{'s' if used != 1 else ''} (lr.warmup_steps="
                     f"{warmup} is not shorter than {horizon_key}={total}, the schedule's length); set "
                     "lr.warmup_steps or lr.total_steps to choose another")
        return
    raise UserError(f"lr.warmup_steps={warmup}", f"is not shorter than the learning-rate schedule ({horizon_key}="
                    f"{total}): the warm-up would never end, and optimizer.lr would never be reached.",
                    f"Lower it below {total} (e.g. lr.warmup_steps={total // 5}); or, if resumes will extend this "
                    "run, give the whole schedule now with lr.total_steps=N (N > the warm-up; "
                    "docs/skills/resume.md).")


def check_decay(cfg, overrides: list[str], notes: list[str]) -> None:
    """lr.decay_ratio: warm-up and decay must fit the schedule, else torchtitan shortens the decay (a
    warning in its log). A schedule cut short on the command line (a smoke test) is shortened, and said."""
    ratio = cfg.lr.decay_ratio
    if ratio is None:
        return
    total, warmup = resume.horizon(cfg), resume.warmup_steps(cfg)
    decay = round(total * float(ratio))
    if warmup + decay <= total:
        return
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    horizon_key = "lr.total_steps" if cfg.lr.total_steps is not None else "training.steps"
    if horizon_key in given and not given & {"lr.decay_ratio", "lr.warmup_steps"}:
        notes.append(f"lr: decay shortened to {total - warmup} steps (lr.decay_ratio={ratio} of {horizon_key}="
                     f"{total} is {decay} steps, after {warmup} of warm-up)")
        return
    raise UserError(f"lr.decay_ratio={ratio}", f"decays over {decay} of the schedule's {total} steps ({horizon_key}), "
                    f"and lr.warmup_steps={warmup} warm up first: {warmup + decay} steps do not fit in {total}, so "
                    "the decay would be cut short.", f"Use lr.decay_ratio <= {int((total - warmup) / total * 1000) / 1000:g} "
                    "or fewer lr.warmup_steps.")


def check_tail(cfg, overrides: list[str] = (), kept: list[str] = ()) -> None:
    """Steps past the schedule's horizon (``lr.total_steps`` < ``training.steps``) keep its final
    learning rate; where that is 0 they would train nothing: refused (a fresh run or a resume alike),
    naming the horizon that covers them, and where each value came from when not typed (``kept``: a
    resume's overrides kept from the run's last launch)."""
    total, steps = resume.horizon(cfg), int(cfg["training"]["steps"])
    if steps <= total or resume.lr_at(cfg, total + 1) != 0:
        return
    kept_note = (" (kept from the run's last launch, not typed now)"
                 if "lr.total_steps" in {resume._key(o) for o in kept} else "")
    steps_note = "" if "training.steps" in {resume._key(o) for o in overrides} else " (the recipe's)"
    raise UserError(f"lr.total_steps={total}{kept_note}", f"the learning-rate schedule ends at step {total} with lr 0 "
                    f"(lr.min_lr_factor={cfg['lr']['min_lr_factor']}), so steps {total + 1}-{steps} of "
                    f"training.steps={steps}{steps_note} would train nothing.",
                    f"Use lr.total_steps={steps} (the schedule over every step; on a resume it stretches what "
                    f"is left of it), or training.steps={total}.")


def check(cfg, overrides: list[str], kept: list[str] = ()) -> list[str]:
    """Every value's range and choice, then the warm-up, the decay and the steps past the horizon; returns
    the notes of a schedule shortened. ``kept``: the overrides a resume kept from the run's last launch."""
    check_values(cfg)
    notes: list[str] = []
    check_warmup(cfg, overrides, notes)
    check_decay(cfg, overrides, notes)
    check_tail(cfg, overrides, kept)
    if cfg.optimizer.lr > 1:  # a clear threshold (was: optimizer.lr=1e30 started without a word)
        notes.append(f"optimizer: lr={cfg.optimizer.lr:g} is above 1, far above where a transformer trains (1e-5 to "
                     "1e-3): expect non-finite steps (exit code 76, docs/troubleshooting.md)")
    return notes
