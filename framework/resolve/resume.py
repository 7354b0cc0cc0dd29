"""What a resume may change, and the configs each launch of a run leaves behind.

A run folder keeps the first launch's resolved config as ``config.yaml`` (never overwritten) and
each later launch's as ``config.resume-K.yaml`` (K = 1, 2, ...). A resume compares its resolved
config with the newest of those, key by key, before any worker starts:

- ``FIXED`` keys hold what the checkpoint's tensors, the data position or the optimizer's state
  were saved under (the model's shape, the data source and its tokens per step, the parallel
  degrees the data position is kept per rank, the optimizer and its schedule, the state backend,
  the seed): a change is refused, naming the key, its old and new value, and the way to get it
  (a new run that loads the weights only: ``checkpoint.load_path=RUN/checkpoint/step-N``).
- ``FREE`` keys change how the rest of the run is run or reported (steps, checkpoint cadence,
  logging, kernels, recompute, launcher, loss and RL coefficients, publication, validation, ...);
  their changes are listed on the run's first lines.
- ``training.steps`` moves the learning-rate schedule's horizon (``lr.total_steps``, default
  ``training.steps``). If the learning rate of the next step under the new horizon differs from
  the old schedule's, the resume is refused with both choices and their learning rates, unless
  ``lr.total_steps`` is given: the schedule then spans that many steps (steps after it keep its
  final rate).

A schema key in neither list fails tests/test_resume.py: each new key must be classified.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from framework import contracts
from framework.errors import UserError
from framework.resolve import paths
from framework.train import integrity

FIRST = "config.yaml"
LAUNCHES = "launches.jsonl"  # one line per launch: {"recipe": as given, "overrides": [...], "cwd": the folder}
# overrides a resume does not keep from the launch before it: what it sets itself, or what starts a run
NOT_KEPT = ("recipe", "output_dir", "training.steps", "checkpoint.resume", "checkpoint.load_step",
            "checkpoint.load_path", "checkpoint.create_seed", "checkpoint.verify")  # verify=false: one load's opt-in
_LAUNCH = re.compile(r"config\.resume-(\d+)\.yaml$")
WORLD = ("dp_replicate", "dp_shard", "cp", "tp", "pp")  # the parallel degrees whose product is the ranks

# prefixes (a section, or one key) whose change a resume refuses
FIXED = (
    "model.family", "model.flavor", "model.n_layers", "model.vocab_size", "model.hf_checkpoint",
    "parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.ep", "parallel.pp", "parallel.tp",
    "parallel.cp_load_balancer", "parallel.pp_schedule", "parallel.pp_microbatch_size",
    "training.seq_len", "training.local_batch", "training.global_batch", "training.dtype", "training.seed",
    "data.format", "data.name", "data.path", "data.tokenizer", "data.sharding", "data.follow",
    "loss.name", "precision.name", "moe.routing_replay",
    "optimizer.name", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
    "lr.warmup_steps", "lr.decay_ratio", "lr.decay_type", "lr.min_lr_factor",
    "adapter.name", "adapter.rank", "adapter.alpha", "adapter.targets", "adapter.init", "adapter.dtype",
)
# prefixes whose change takes effect from the resumed step on (listed on the first lines)
FREE = (
    "recipe", "description", "registry", "output_dir", "layout", "preflight", "logging", "launcher",
    "validation", "publish", "rl", "recompute", "model.attn_backend", "model.flex_autotune", "parallel.gpus",
    "training.steps", "training.max_norm", "training.deterministic", "training.cache_autotuning",
    "training.kernel_cache", "training.autotune_configs", "training.on_nonfinite", "training.max_skips",
    "data.num_workers", "data.wait_timeout", "loss", "state", "state.reshard_after_forward", "state.offload",
    "state.offload_threads", "precision", "moe.comm", "moe.chunk", "moe.load_balance_coeff",
    "moe.lean_combine", "checkpoint", "lr.total_steps", "adapter.dropout", "optimizer.lr",
)


def classify(key: str) -> str | None:
    """'fixed', 'free' or None (unclassified) for a dotted config key; the longest prefix wins."""
    best, kind = -1, None
    for group, name in ((FIXED, "fixed"), (FREE, "free")):
        for p in group:
            if (key == p or key.startswith(p + ".")) and len(p) > best:
                best, kind = len(p), name
    return kind


def leaves(cfg, prefix: str = "") -> dict:
    """Dotted key -> plain value of every leaf of a config (lists are leaves)."""
    out = {}
    node = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(leaves(v, key + "."))
        else:
            out[key] = v
    return out


def launch_configs(run_dir: Path) -> list[Path]:
    """The run's launch configs, oldest first: config.yaml, then config.resume-1.yaml, ..."""
    run_dir = Path(run_dir)
    later = sorted((int(m.group(1)), p) for p in run_dir.glob("config.resume-*.yaml")
                   if (m := _LAUNCH.search(p.name)))
    first = [run_dir / FIRST] if (run_dir / FIRST).is_file() else []
    return first + [p for _, p in later]


def config_path_for_launch(run_dir: Path) -> Path:
    """Where this launch's resolved config goes: config.yaml the first time, never overwritten."""
    run_dir = Path(run_dir)
    have = launch_configs(run_dir)
    if not have:
        return run_dir / FIRST
    n = max([int(m.group(1)) for p in have if (m := _LAUNCH.search(p.name))] or [0])
    return run_dir / f"config.resume-{n + 1}.yaml"


def schedule_factor(step: int, total: int, warmup: int, decay_ratio, decay_type: str, min_lr_factor: float) -> float:
    """The factor of optimizer.lr that training step ``step`` (1-based) uses under a schedule of
    ``total`` steps: torchtitan's warm-up, stable and decay phases; steps past ``total`` keep the
    final rate. The same arithmetic as framework/train/build.py's schedule (tests check them against each other)."""
    warmup = min(warmup, total)
    decay = total - warmup if decay_ratio is None else min(round(total * decay_ratio), total - warmup)
    stable_end = total + 1 - decay
    s = min(step - 1, total)  # the scheduler's index of this step, held at the end past the horizon
    if s < warmup:
        return (s + 1) / warmup
    if s < stable_end:
        return 1.0
    progress = (s + 1 - stable_end) / decay
    curve = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[decay_type]
    return min_lr_factor + (1 - min_lr_factor) * curve


def horizon(cfg) -> int:
    t = cfg["lr"].get("total_steps")
    return int(t) if t is not None else int(cfg["training"]["steps"])


def warmup_steps(cfg) -> int:
    """The warm-up the schedule uses: lr.warmup_steps, shortened to leave one step of the horizon."""
    return min(int(cfg["lr"]["warmup_steps"]), max(horizon(cfg) - 1, 0))


def schedule(cfg) -> dict:
    """The learning-rate schedule the run follows, as torchtitan's LR scheduler config takes it: the
    warm-up (``warmup_steps``), the horizon (``horizon``) and the decay."""
    lr = cfg["lr"]
    return {"warmup_steps": warmup_steps(cfg), "total_steps": horizon(cfg), "decay_ratio": lr["decay_ratio"],
            "decay_type": lr["decay_type"], "min_lr_factor": lr["min_lr_factor"]}


def lr_at(cfg, step: int) -> float:
    lr, opt = cfg["lr"], cfg["optimizer"]
    warmup = warmup_steps(cfg)
    return float(opt["lr"]) * schedule_factor(step, horizon(cfg), warmup, lr["decay_ratio"], lr["decay_type"],
                                              float(lr["min_lr_factor"]))


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def last_launch(run_dir) -> dict | None:
    """The newest launch's recipe (as given) and overrides from ``LAUNCHES``, or None (a run of an older
    apiary, or an unreadable file)."""
    f = Path(run_dir) / LAUNCHES
    try:
        lines = [x for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
        last = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return last if isinstance(last, dict) and isinstance(last.get("overrides"), list) else None


def kept_launch(run_dir, given: list[str], recipe: str | None) -> tuple[list[str], str | None]:
    """What a resume of ``run_dir`` keeps from its newest launch: its overrides (``kept_overrides``) and, where
    no recipe= is given (``recipe`` None), its recipe as given then (else the default recipe would take
    overrides, and a checkpoint, of another recipe)."""
    last = last_launch(run_dir) if run_dir is not None and recipe is None else None
    kept = (last or {}).get("recipe")
    if kept and (kept.endswith((".yaml", ".yml")) or "/" in kept) and isinstance(last.get("cwd"), str) \
            and (typed := Path(last["cwd"], kept).expanduser()).is_file():  # a recipe file named relative
        kept = str(typed)
    return kept_overrides(run_dir, given), kept or recipe


def typed_in(override: str, cwd: str | None, stored: dict) -> str:
    """A kept ``override`` of a path key (paths.KEYS, ``registry``) as the path its launch read: resolved against
    the folder that launch ran in (``cwd``, launches.jsonl's; was: read again from the resume's folder, so a resume
    from elsewhere found no ``my_model``), or, in a run folder of an older apiary (no cwd), as the launch's config
    (``stored``, flat) holds it, absolute."""
    head, sep, val = override.partition("=")
    key = _key(override)
    if not sep or key not in (*paths.KEYS, "registry") or val in ("", "null", *paths.NAMES.get(key, ())) \
            or "://" in val or os.path.isabs(os.path.expanduser(val)):
        return override
    if cwd:
        return f"{head}={os.path.normpath(os.path.join(cwd, os.path.expanduser(val)))}"
    was = stored.get(key)
    return f"{head}={was}" if isinstance(was, str) and os.path.isabs(was) else override


def kept_overrides(run_dir, given: list[str]) -> list[str]:
    """The newest launch's overrides that a resume with ``given`` keeps: all but NOT_KEPT, those given
    again (the new value wins) and the keys of a component group given another option."""
    last = last_launch(run_dir) if run_dir is not None else None
    if last is None:
        return []
    keys = {_key(o) for o in given}
    before = {_key(o): o for o in last["overrides"]}
    regrouped = {k for k in keys if "." not in k and next((o for o in given if _key(o) == k), None) != before.get(k)}
    kept = [o for o, k in ((o, _key(o)) for o in last["overrides"])
            if k not in keys and k not in NOT_KEPT and not k.startswith("hydra.")
            and not ("." in k and k.split(".", 1)[0] in regrouped)]
    cwd = last.get("cwd") if isinstance(last.get("cwd"), str) else None
    stored = {} if cwd or not (configs := launch_configs(run_dir)) else _flat(configs[-1])
    return [typed_in(o, cwd, stored) for o in kept]


def _flat(config: Path) -> dict:
    try:
        return leaves(OmegaConf.load(config))
    except Exception:  # noqa: BLE001  (an unreadable config is check()'s refusal)
        return {}


def kept_warmup(run_dir, cfg, given: list[str]) -> list[str]:
    """``["lr.warmup_steps=N"]`` when the run's newest launch used a warm-up of N steps (shortened to fit its
    horizon) and this resume, not giving lr.warmup_steps, would use another: the schedule is the checkpoint's."""
    configs = launch_configs(run_dir) if run_dir is not None else []
    if not configs or "lr.warmup_steps" in {_key(o) for o in given}:
        return []
    try:
        was = warmup_steps(OmegaConf.to_container(OmegaConf.load(configs[-1]), resolve=True))
        now = warmup_steps(OmegaConf.to_container(cfg, resolve=True))
    except Exception:  # noqa: BLE001  (an unreadable config is check()'s refusal)
        return []
    return [f"lr.warmup_steps={was}"] if was != now else []


def write_launch(run_dir, launch: dict | None) -> None:
    """Append this launch's recipe and overrides to ``LAUNCHES`` (what the next resume keeps)."""
    if launch is not None:
        with open(Path(run_dir) / LAUNCHES, "a") as h:
            h.write(json.dumps(launch) + "\n")


@dataclass
class ResumePlan:
    step: int  # the checkpoint step loaded
    saved_from: Path  # the config it is compared with
    changes: list = field(default_factory=list)  # (key, old, new) of FREE keys
    schedule_note: str = ""
    verified: bool = True  # False: a step without manifest.json loaded with checkpoint.verify=false

    def lines(self, run_dir) -> list[str]:
        step_dir = Path(run_dir) / "checkpoint" / f"step-{self.step}"
        how = ("verified against its manifest" if self.verified else
               "has no manifest.json (checkpoint.verify=false: NOT verified)")
        out = [f"resume: {step_dir} {how}; "
               f"loading it and training from step {self.step + 1} (compared with {self.saved_from.name})"]
        if self.changes:
            out.append("resume: changed since the last launch: "
                       + "; ".join(f"{k} {_fmt(a)} -> {_fmt(b)}" for k, a, b in self.changes))
        if self.schedule_note:
            out.append(f"resume: {self.schedule_note}")
        return out


def _fmt(v) -> str:
    return "null" if v is None else str(v)


def check(cfg, run_dir: Path, step: int, given: list[str] | None = None) -> ResumePlan:
    """Compare a resume's resolved ``cfg`` with the run's newest launch config; UserError (exit 2)
    for a FIXED or unclassified change, or a schedule change not chosen with lr.total_steps (``given``: the
    launch's overrides, which say whether training.steps was typed)."""
    configs = launch_configs(run_dir)
    if not configs:
        raise UserError("checkpoint.resume=true", f"{run_dir} holds checkpoints but no {FIRST}, so what they were "
                        "trained with is unknown.", f"Put the run's {FIRST} back, or start a new run that loads the "
                        f"weights only: checkpoint.load_path={Path(run_dir) / 'checkpoint' / f'step-{step}'}.")
    saved_path = configs[-1]
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=True)
    except Exception as e:  # noqa: BLE001  (yaml's and OmegaConf's errors alike)
        raise UserError("checkpoint.resume=true", f"{saved_path} is not readable YAML ({type(e).__name__}).",
                        f"Restore it from {configs[0]} or a copy.") from None
    new = OmegaConf.to_container(cfg, resolve=True)
    old_l, new_l = paths.absolute_leaves(leaves(saved)), leaves(new)  # a config stored before paths were absolute
    # the warm-up the schedule used, not as written: a launch's shortened one (values.check_warmup) is kept
    old_l["lr.warmup_steps"], new_l["lr.warmup_steps"] = warmup_steps(saved), warmup_steps(new)
    shortened = warmup_steps(saved) != int(saved["lr"]["warmup_steps"])  # the note below explains only a real one
    refused, changes = [], []
    for key in sorted(set(old_l) | set(new_l)):
        a, b = old_l.get(key), new_l.get(key)
        if a == b or key in ("checkpoint.resume", "checkpoint.load_step"):
            continue
        kind = classify(key)
        if kind == "free":
            changes.append((key, a, b))
        else:
            refused.append((key, a, b))
    if refused:
        listed = "; ".join(f"{k}: {_fmt(a)} then, {_fmt(b)} now" + (
            " (the warm-up the schedule uses: lr.warmup_steps shortened to leave one step of its horizon; "
            f"lr.warmup_steps={a} keeps it)" if k == "lr.warmup_steps" and shortened else "") for k, a, b in refused)
        was, now = (math.prod(int((c.get("parallel") or {}).get(d) or 1) for d in WORLD) for c in (saved, new))
        ranks = (f" The parallel degrees follow the ranks: the run was trained on {was}, this launch starts {now}."
                 if was != now and any(k.startswith("parallel.") for k, _, _ in refused) else "")
        raise UserError("checkpoint.resume=true", f"{run_dir} was trained with other settings that its checkpoint "
                        f"depends on ({listed}; compared with {saved_path.name}). A resume keeps the model, data "
                        f"position, optimizer state and schedule it saved.{ranks}",
                        "Resume with the old values" + (f" (nproc={was} starts the run's {was} ranks again)" if ranks
                                                        else "") + ", or start a new run that loads only the weights: "
                        f"checkpoint.load_path={Path(run_dir) / 'checkpoint' / f'step-{step}'} "
                        "(a fresh optimizer, schedule and data order).")
    plan = ResumePlan(step=step, saved_from=saved_path, changes=changes)
    _check_schedule(saved, new, step, plan, given)
    return plan


def _check_schedule(saved: dict, new: dict, step: int, plan: ResumePlan, given: list[str] | None = None) -> None:
    old_total, new_total = horizon(saved), horizon(new)
    if old_total == new_total:
        return
    nxt = step + 1
    keep_cfg = {**new, "lr": {**new["lr"], "total_steps": old_total}}  # the new settings on the old horizon
    was, then, now = lr_at(saved, step), lr_at(keep_cfg, nxt), lr_at(new, nxt)
    explicit = new["lr"].get("total_steps") is not None
    if explicit or math.isclose(then, now, rel_tol=1e-6, abs_tol=0.0):
        plan.schedule_note = (f"the learning-rate schedule spans {new_total} steps (it spanned {old_total}): step "
                              f"{step} used lr {was:.3g}, step {nxt} uses {now:.3g}")
        return
    keep = then
    launched, steps = int(saved["training"]["steps"]), int(new["training"]["steps"])  # training.steps is not kept
    finish = (f"training.steps={launched} finishes the run as it was launched (the schedule unchanged); or "
              if launched > step and launched != steps else "")
    whose = "" if given is None or "training.steps" in {_key(o) for o in given} else (  # not typed: say so
        " (the recipe's" + (f"; the last launch's {launched} is not kept)" if launched != steps else ")"))
    raise UserError(
        f"checkpoint.resume=true training.steps={steps}{whose}",
        f"the learning-rate schedule spans the run's steps: it was trained over {old_total} steps (step {step} used "
        f"lr {was:.3g}); over {new_total} steps step {nxt} would use lr {now:.3g}.",
        f"Choose one: {finish}lr.total_steps={new_total} stretches the schedule over the new steps (lr {was:.3g} -> "
        f"{now:.3g} at step {nxt}); " + (
            f"lr.total_steps={old_total} keeps the schedule trained so far (steps after {old_total} keep its final "
            f"lr {keep:.3g})." if keep != 0 else
            f"keeping the schedule trained so far (lr.total_steps={old_total}) is refused: its final lr is 0, "
            "which trains nothing; to train on from the weights at another rate, start a new run with "
            "checkpoint.load_path=..."))


def check_resume_load_path(cfg, ctx: contracts.Context, plan) -> None:
    """A resume loads the run's own step, so a checkpoint.load_path other than the one the run was launched
    with would be ignored (the same one, as the resume command a run prints repeats it, is harmless)."""
    if ctx.shared.load_path_reader:  # a component that loads it itself, resumed or not
        return
    changed = [(a, b) for key, a, b in plan.changes if key == "checkpoint.load_path" and b is not None]
    if changed:
        before, now = (None if v is None else paths.shown(v) for v in changed[0])  # as given (stored absolute)
        raise UserError(f"checkpoint.resume=true with checkpoint.load_path={now}", "both name what to load: a resume "
                        "loads the run's own latest step (checkpoint.load_step picks another of its steps), so "
                        "checkpoint.load_path would be ignored (the run was launched "
                        f"{'without one' if before is None else f'with {before}'}).",
                        "Drop checkpoint.load_path to continue the run; or, to start a new run from those weights, "
                        "drop checkpoint.resume and output_dir.")


def plan(cfg, ctx: contracts.Context, step: int, kept: list[str], given: list[str] | None = None) -> list[str]:
    """A resume of ``cfg``'s run from ``step``: what it loads and what changed since the last launch
    (``check``), a checkpoint.load_path it would ignore refused; returns the run's resume lines, with
    the last launch's ``kept`` overrides named (``given``: all of the launch's)."""
    run_dir = Path(cfg.output_dir)
    p = check(cfg, run_dir, step, given)
    check_resume_load_path(cfg, ctx, p)
    p.verified = (run_dir / "checkpoint" / f"step-{step}" / integrity.MANIFEST).is_file()
    lines = p.lines(cfg.output_dir)
    ck = run_dir / "checkpoint"
    later = [n for n in integrity.complete_steps(ck) if n > step and integrity.is_model_only(ck / f"step-{n}")]
    if later and step == max(integrity.full_steps(ck)):
        lines.append(f"resume: {ck / f'step-{later[-1]}'} holds the model's weights only (checkpoint.model_only_last"
                     f"=true), so the resume goes on from step {step}, the last full checkpoint")
    if kept:
        lines.append(f"resume: keeps the last launch's overrides {' '.join(kept)} (give one again to change it)")
    return lines
