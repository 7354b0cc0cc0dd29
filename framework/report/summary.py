"""The end-of-run summary: what a run did, computed from its folder alone (metrics.jsonl, the
newest config, the checkpoint folders), printed by rank 0 when training ends and written as
``summary.json`` beside metrics.jsonl. A run stopped by a signal, a non-finite loss or its rollout
stream gets the short form: the step reached, the checkpoint, and how to resume.

The numbers (docs/skills/progress.md):

* wall time: the last logged record's ``elapsed_s`` of each launch (from the start of
  ``framework.train.run.train``, building the trainer included, to that step), summed over the launches
  of the folder (a resume starts a new launch, whose first record carries ``first_step_wall_s``);
* tokens: the sum of the records' ``tokens`` (every data-parallel rank's);
* mean tok/s: tokens over time of each launch after its first logged step (the first step compiles
  and warms up), so ``sum(tokens[1:]) / (elapsed_s[-1] - elapsed_s[0])`` per launch;
* TFLOPs/GPU and MFU: the same intervals' time-weighted means of ``tflops_per_gpu`` (apiary's count:
  the planner's model FLOPs per token, causal attention halved, frozen weights without weight
  gradients) and ``mfu_pct`` (from it), torchtitan's count (``tflops_per_gpu_torchtitan``) beside
  them, or the reason there are none (no GPU; no known peak for the device; quantized GEMMs;
  records of an apiary that logged torchtitan's count as ``tflops_per_gpu``);
* peak memory: the largest ``peak_mem_bytes``, labelled by ``peak_mem_kind``;
* loss: the first, last and lowest (finite, its update applied) training loss, and the last ``val_loss``; for an RL
  objective (rollout records trained by a policy loss) the loss is no measure of progress: the first and
  last only, and the mean reward of the steps' records (``data/reward_mean``) first, last and best,
  the records' lag behind the trainer (follow mode), the training-inference mismatch
  (``policy/mismatch_abs_mean``) and the time waited for records;
* checkpoint: the last complete ``checkpoint/step-N`` (framework/train/integrity.py), or none;
* skipped updates (``training.on_nonfinite=skip``): on the steps line (framework/report/skips.py).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.text import Text

from framework import contracts
from framework.compose import registry
from framework.errors import UserError
from framework.report import skips
from framework.report.export_note import routing_bias_note
from framework.report.progress import duration, loss_text, make_console, memory_label
from framework.report.resume_command import continuation, from_weights, launch_steps, ranks, run_overrides
from framework.resolve import resume
from framework.train import integrity

SUMMARY_NAME = "summary.json"
_LAUNCH_CONFIG = re.compile(r"config\.resume-(\d+)\.yaml$")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records (a line cut short by a crash is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
    return out


def _config(run_dir: Path):
    """The newest launch's resolved config (config.resume-K.yaml, else config.yaml), or None."""
    launches = sorted(((int(m.group(1)), p) for p in run_dir.glob("config.resume-*.yaml")
                       if (m := _LAUNCH_CONFIG.search(p.name))), key=lambda kp: kp[0])
    path = launches[-1][1] if launches else run_dir / "config.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def _launches(train: list[dict]) -> list[list[dict]]:
    """The records split by launch: each process's first record carries the first step's breakdown
    (``first_step_wall_s``, framework/train/first_step.py), and its ``elapsed_s`` starts again."""
    out: list[list[dict]] = []
    prev = None
    for r in train:
        el = r.get("elapsed_s")
        if not out or "first_step_wall_s" in r or (_finite(el) and _finite(prev) and el < prev):
            out.append([])
        out[-1].append(r)
        prev = el
    return out


def _steady(launches: list[list[dict]]):
    """(tokens, seconds, intervals) after each launch's first record; intervals: (record, seconds)."""
    tokens, seconds, intervals = 0, 0.0, []
    for seg in launches:
        for a, b in zip(seg, seg[1:]):
            if not (_finite(a.get("elapsed_s")) and _finite(b.get("elapsed_s"))):
                return None, None, []
            dt = b["elapsed_s"] - a["elapsed_s"]
            seconds += dt
            intervals.append((b, dt))
            tokens = tokens + b["tokens"] if _finite(b.get("tokens")) and tokens is not None else None
    return tokens, seconds, intervals


def _weighted(intervals, key: str) -> float | None:
    vals = [(r.get(key), dt) for r, dt in intervals]
    if not vals or not all(_finite(v) for v, _ in vals):
        return None
    total = sum(dt for _, dt in vals)
    return sum(v * dt for v, dt in vals) / total if total > 0 else None


def _counts_labelled(r: dict) -> dict:
    """A record whose ``tflops_per_gpu`` and ``mfu_pct`` are torchtitan's count (written before
    apiary logged its own beside ``tflops_per_gpu_torchtitan``), with them moved under that label."""
    if "tflops_per_gpu" not in r or "tflops_per_gpu_torchtitan" in r:
        return r
    return {**r, "tflops_per_gpu": None, "mfu_pct": None, "tflops_per_gpu_torchtitan": r["tflops_per_gpu"]}


def _quote(s) -> str:
    return shlex.quote(str(s))


def _rl_objective(cfg, train: list[dict]) -> bool:
    """Whether the run trained a policy objective (not a likelihood): the loss kind's declared
    ``POLICY_OBJECTIVE``. Without a config: the run's records carry policy metrics or rewards."""
    if cfg is not None and "loss" in cfg and cfg.loss.get("name"):
        try:
            loss = registry.resolve("loss", str(cfg.loss.name))
        except UserError:
            return False
        return bool(contracts.member(loss, "loss", "POLICY_OBJECTIVE"))
    return any(k.startswith("policy/") or k == "data/reward_mean" for r in train for k in r)


def _rl(train: list[dict]) -> dict:
    """An RL run's own numbers over its records (None where no record has them)."""
    rewards = [r for r in train if _finite(r.get("data/reward_mean"))]
    best = max(rewards, key=lambda r: r["data/reward_mean"]) if rewards else None
    lags = [r["data/lag_mean"] for r in train if _finite(r.get("data/lag_mean"))]
    lag_max = [r["data/lag_max"] for r in train if _finite(r.get("data/lag_max"))]
    mism = [r["policy/mismatch_abs_mean"] for r in train if _finite(r.get("policy/mismatch_abs_mean"))]
    mism_max = [r["policy/mismatch_abs_max"] for r in train if _finite(r.get("policy/mismatch_abs_max"))]
    waited = [r["data/waited_s"] for r in train if _finite(r.get("data/waited_s"))]
    return {"reward_first": rewards[0]["data/reward_mean"] if rewards else None,
            "reward_last": rewards[-1]["data/reward_mean"] if rewards else None,
            "reward_last_step": rewards[-1]["step"] if rewards else None,
            "reward_best": best["data/reward_mean"] if best else None,
            "reward_best_step": best["step"] if best else None,
            "lag_mean": sum(lags) / len(lags) if lags else None,
            "lag_max": max(lag_max) if lag_max else None,
            "mismatch_abs_mean": sum(mism) / len(mism) if mism else None,
            "mismatch_abs_max": max(mism_max) if mism_max else None,
            "mismatch_last": mism[-1] if mism else None,
            "rollout_wait_s": round(sum(waited), 3) if waited else None}


def no_base_on_disk(cfg) -> str | None:
    """Why ``apiary export`` refuses this run's checkpoints, or None: adapters trained on a base built
    from the seed (no model.hf_checkpoint, no checkpoint.load_path) have no base to be written against
    (PEFT's folder names one; a merged folder folds them into it)."""
    if cfg is None or str(OmegaConf.select(cfg, "adapter.name", default="none") or "none") == "none":
        return None
    if OmegaConf.select(cfg, "model.hf_checkpoint") or OmegaConf.select(cfg, "checkpoint.load_path"):
        return None
    return ("none: the adapters were trained on a base built from the seed, which exists on no disk, so "
            "apiary export refuses them; train adapters on model.hf_checkpoint=DIR or checkpoint.load_path=STEP "
            "to export them")


def summarize(run_dir, stop: str | None = None, exit_code: int = 0, stopped_at: int | None = None,
              launch: dict | None = None) -> dict:
    """The summary of ``run_dir`` as a JSON-able dict. ``stop``: why training stopped early (None: it
    ran to its last step), with the ``exit_code`` it exits with and the step it stopped after.
    ``launch``: the run's recipe and overrides as given (the resolved run's; default: the folder's
    newest launch), which its resume command repeats."""
    run_dir = Path(run_dir)
    cfg = _config(run_dir)
    records = read_records(run_dir)
    train = [r for r in records if "loss" in r]
    older = any("tflops_per_gpu" in r and "tflops_per_gpu_torchtitan" not in r for r in train)
    train = [_counts_labelled(r) for r in train]
    vals = [r for r in records if _finite(r.get("val_loss"))]
    launches = _launches(train)
    last = train[-1] if train else {}
    total_steps = int(cfg.training.steps) if cfg is not None else None
    step = stopped_at if stopped_at is not None else last.get("step")

    tokens_all = [r.get("tokens") for r in train]
    tokens = int(sum(tokens_all)) if tokens_all and all(_finite(t) for t in tokens_all) else None
    steady_tokens, steady_s, intervals = _steady(launches)
    tok_s = steady_tokens / steady_s if steady_tokens is not None and steady_s else None
    walls = [seg[-1].get("elapsed_s") for seg in launches]
    wall = sum(walls) if walls and all(_finite(w) for w in walls) else None

    device = last.get("device")
    peak_tflops = last.get("peak_tflops_per_gpu")
    on_gpu = device not in (None, "cpu")
    tflops = _weighted(intervals, "tflops_per_gpu") if on_gpu else None
    tflops_tt = _weighted(intervals, "tflops_per_gpu_torchtitan") if on_gpu else None
    mfu = _weighted(intervals, "mfu_pct") if on_gpu and peak_tflops else None
    if not on_gpu:
        why = f"no known peak for {device or 'this device'}"
    elif not peak_tflops:
        why = f"no known peak for {device}"
    elif not intervals:
        why = "one logged step: the first step (compile, warm-up) is left out"
    elif older:
        why = "records of an older apiary, which logged torchtitan's FLOPs count only"
    elif tflops is None:
        why = "no model FLOPs count from the planner"
    else:
        why = "quantized GEMMs (FP8): no comparable BF16 peak"

    peaks = [r["peak_mem_bytes"] for r in train if _finite(r.get("peak_mem_bytes"))]
    finite = [r for r in train if _finite(r.get("loss")) and skips.applied(r)]
    best = min(finite, key=lambda r: r["loss"]) if finite else None

    steps = integrity.complete_steps(run_dir / "checkpoint")
    checkpoint = str(run_dir / "checkpoint" / f"step-{steps[-1]}") if steps else None

    recipe = cfg.recipe if cfg is not None else "RECIPE"
    launch = launch if launch is not None else resume.last_launch(run_dir)
    given = (launch or {}).get("recipe") or recipe  # a recipe file by its path, as given at launch
    out = str(run_dir)
    commands, note = {}, ""
    if checkpoint is not None:
        unknown = (overrides := run_overrides(launch)) is None
        overrides, to = overrides or [], total_steps
        if stop is None and total_steps is not None:  # it finished: train on, the lr never raised at the next step
            to = 2 * total_steps                      # (a resume asks for a choice of schedule, framework/resolve/resume.py)
            if "lr" in cfg and "total_steps" in cfg.lr and "optimizer" in cfg:
                schedule, note = continuation(cfg, total_steps)
                overrides = [o for o in overrides if not o.startswith(tuple(x.split("=")[0] + "=" for x in schedule))] + schedule
        start, overrides = ranks(cfg, overrides)
        if not any(s > 0 for s in integrity.full_steps(run_dir / "checkpoint")):  # model-only: no resume, a new run
            commands["new run"] = from_weights(checkpoint, given, out, [*(run_overrides(launch) or []), *launch_steps(launch)],
                                                  _quote)
        else:
            commands["resume"] = (f"{start} recipe={_quote(given)} output_dir={_quote(out)} checkpoint.resume=true "
                                  f"training.steps={to}" + "".join(f" {_quote(o)}" for o in overrides)
                                  + (" (and this run's overrides)" if unknown else ""))
        if no_base_on_disk(cfg) is None:
            commands["export"] = f"apiary export {_quote(out)} --hf {_quote(str(run_dir / 'hf'))}"
    if records:
        commands["plot"] = f"apiary plot {_quote(out)}"
    if (run_dir / "tb").is_dir():
        commands["tensorboard"] = f"tensorboard --logdir {_quote(str(run_dir / 'tb'))}"

    return {
        "run_dir": out,
        "recipe": recipe if cfg is not None else None,
        "status": "completed" if stop is None else "stopped",
        "stop": stop,
        "exit_code": exit_code,
        "step": step,
        "total_steps": total_steps,
        "launches": len(launches),
        "wall_time_s": round(wall, 3) if wall is not None else None,
        "tokens": tokens,
        "data_passes": max(epochs) + 1 if (epochs := [r["data/epoch"] for r in train if _finite(r.get("data/epoch"))])
        else None,  # a text source re-read from its start (data/epoch: 0 on the first pass)
        "tokens_per_s_mean": round(tok_s, 3) if tok_s is not None else None,
        "tokens_per_s_mean_excludes": "the first logged step of each launch (compile, warm-up)",
        "tokens_per_s_missing_because": None if tok_s is not None else (
            "one logged step" if not intervals else "records without tokens (an older apiary's)"),
        "device": device,
        "tflops_per_gpu_mean": round(tflops, 3) if tflops is not None else None,
        "tflops_per_gpu_torchtitan_mean": round(tflops_tt, 3) if tflops_tt is not None else None,
        "mfu_pct_mean": round(mfu, 3) if mfu is not None else None,
        "peak_tflops_per_gpu": peak_tflops,
        "mfu_missing_because": None if mfu is not None else why,
        "peak_mem_bytes": max(peaks) if peaks else None,
        "peak_mem_kind": last.get("peak_mem_kind"),
        "peak_mem_label": memory_label(last.get("peak_mem_kind"), long=True) if peaks else None,
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": last.get("loss"),
        "loss_best": best["loss"] if best else None,
        "loss_best_step": best["step"] if best else None,
        **skips.fields(train, launches),
        "rl_objective": _rl_objective(cfg, train),
        **_rl(train),
        "val_loss_last": vals[-1]["val_loss"] if vals else None,
        "val_loss_step": vals[-1]["step"] if vals else None,
        "checkpoint": checkpoint,
        "next": commands,
        "resume_note": note or None,  # the learning rate the resume continues at, and the stretch it is not
        "export_missing_because": no_base_on_disk(cfg) if checkpoint is not None else None,
        "export_note": routing_bias_note(cfg) if "export" in commands else None,
    }


def write(summary: dict) -> Path:
    path = Path(summary["run_dir"]) / SUMMARY_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return path


def _fmt(x, spec: str, none: str = "n/a") -> str:
    if spec == "loss":
        return loss_text(x) if _finite(x) else none
    return format(x, spec) if _finite(x) else none


def lines(s: dict) -> list[tuple[str, str]]:
    """(label, text) rows of the full summary."""
    rows = []
    of = f"/{s['total_steps']}" if s["total_steps"] is not None else ""
    rows.append(("steps", f"{s['step']}{of}" + (f" ({s['launches']} launches)" if s["launches"] > 1 else "") + skips.text(s)))
    if s["wall_time_s"] is not None:
        rows.append(("wall time", f"{duration(s['wall_time_s'])} ({s['wall_time_s']:.1f} s, trainer build to last step)"))
    if s["tokens"] is not None:
        rows.append(("tokens", f"{s['tokens']:,}"))
    if (s.get("data_passes") or 0) > 1:
        again = s["data_passes"] - 1
        rows.append(("data", f"{s['data_passes']} passes over the training data (it ran out and was reshuffled "
                             + ("once)" if again == 1 else f"{again} times)")))
    rows.append(("tok/s (mean)", f"{s['tokens_per_s_mean']:,.0f} (first step left out: compile, warm-up)"
                 if s["tokens_per_s_mean"] is not None else f"n/a ({s['tokens_per_s_missing_because']})"))
    if s["device"] not in (None, "cpu"):
        tt = s.get("tflops_per_gpu_torchtitan_mean")
        rows.append(("TFLOPs/GPU", f"{_fmt(s['tflops_per_gpu_mean'], ',.1f')} apiary's count (causal attention "
                     "halved, frozen weights without weight gradients)"
                     + (f" · {tt:,.1f} torchtitan's count (full attention)" if _finite(tt) else "")))
    peak = f" of {s['peak_tflops_per_gpu']:,.0f} peak ({s['device']}, dense BF16; apiary's count)" \
        if s["peak_tflops_per_gpu"] else ""
    rows.append(("MFU", f"{s['mfu_pct_mean']:.1f}%{peak}" if s["mfu_pct_mean"] is not None
                 else f"n/a ({s['mfu_missing_because']})"))
    if s["peak_mem_bytes"] is not None:
        rows.append(("peak memory", f"{s['peak_mem_bytes'] / 2**30:.2f} GiB ({s['peak_mem_label']})"))
    rl = s.get("rl_objective")
    if s["loss_first"] is not None and rl:  # a policy loss: its lowest value says nothing of the policy
        rows.append(("loss", f"first {_fmt(s['loss_first'], 'loss')} · last {_fmt(s['loss_last'], 'loss')} "
                             "(a policy objective: see the reward)"))
    elif s["loss_first"] is not None:
        rows.append(("loss", f"first {_fmt(s['loss_first'], 'loss')} · last {_fmt(s['loss_last'], 'loss')} · "
                             f"best {_fmt(s['loss_best'], 'loss')}"
                             + (f" (step {s['loss_best_step']})" if s["loss_best_step"] is not None else "")))
    if rl:
        rows.extend(_rl_rows(s))
    if s["val_loss_last"] is not None:
        rows.append(("val_loss", f"{s['val_loss_last']:.4f} (step {s['val_loss_step']})"))
    rows.append(("checkpoint", s["checkpoint"] or "none saved"))
    return rows


def _rl_rows(s: dict) -> list[tuple[str, str]]:
    rows = []
    if s.get("reward_first") is not None:
        rows.append(("reward", f"first {s['reward_first']:.4g} · last {s['reward_last']:.4g} · best "
                               f"{s['reward_best']:.4g} (step {s['reward_best_step']}; mean over each step's records)"))
    else:
        rows.append(("reward", "n/a (the rollout records carry no reward field, docs/rl.md)"))
    if s.get("lag_mean") is not None:
        rows.append(("lag", f"mean {s['lag_mean']:.2f} · max {_fmt(s['lag_max'], 'g')} versions behind the trainer"))
    if s.get("mismatch_abs_mean") is not None:
        rows.append(("mismatch", f"mean |logp_gen - logp_train| {s['mismatch_abs_mean']:.2e} · last "
                                 f"{s['mismatch_last']:.2e} · max {_fmt(s['mismatch_abs_max'], '.2e')}"))
    if s.get("rollout_wait_s"):
        rows.append(("rollout wait", f"{duration(s['rollout_wait_s'])} ({s['rollout_wait_s']:.1f} s waiting for "
                                     "rollout records, in the wall time)"))
    return rows


def render(s: dict, console: Console | None = None, color: bool = True) -> None:
    """Print the summary: the full one, or the short one for a run that stopped early (``console``:
    default stdout's, plain text when it is not a terminal)."""
    console = console or make_console()
    bold = "bold" if color else ""
    if s["status"] != "completed":
        of = f" of {s['total_steps']}" if s["total_steps"] is not None else ""
        console.print(Text.assemble(("stopped", bold), f" {s['stop']} after step {s['step']}{of} "
                                    f"(exit code {s['exit_code']}); checkpoint: {s['checkpoint'] or 'none saved'}"),
                      soft_wrap=True)
        if "resume" in s["next"]:
            after = " after a change, if the paragraph above calls it good" if s["exit_code"] == integrity.EXIT_NONFINITE else ""
            console.print(Text(f"  resume{after}: {s['next']['resume']}"), soft_wrap=True)
        return
    console.print(Text.assemble(("run summary", bold), f"  {s['recipe'] or ''} -> {s['run_dir']}"), soft_wrap=True)
    width = max(len(k) for k in ("tensorboard", *(k for k, _ in lines(s))))
    for label, text in lines(s):
        console.print(Text(f"  {label:<{width}}  {text}"), soft_wrap=True)
    if s["next"]:
        console.print(Text("next", style=bold), soft_wrap=True)
        for key, cmd in s["next"].items():
            console.print(Text(f"  {key:<{width}}  {cmd}"), soft_wrap=True)
            note = s.get({"resume": "resume_note", "export": "export_note"}.get(key, ""))
            if note:
                console.print(Text(f"  {'':<{width}}  ({note})"), soft_wrap=True)
        if s.get("export_missing_because"):
            console.print(Text(f"  {'export':<{width}}  {s['export_missing_because']}"), soft_wrap=True)
