"""Run the second pass of bad inputs (docs/bad_inputs_second_pass.md) and print its table.

    python benchmarks/bad_inputs_pass.py [--only 3,7,12] [--timeout 120] [--json FILE]

Each case runs the real console entry (`train` or `apiary`, as `python -m framework.cli` /
`python -m toolkit.cli`) in a fresh interpreter, in its own empty folder, on CPU, with the shared
fixtures of a temporary folder (data files, a run with checkpoints, one without). The outcome column says:

- ``ok: exit 2: ...``: refused before launch with one paragraph (its first words);
- ``traceback: ErrorType``: a Python traceback reached the user;
- ``accepted (exit 0)``: the command ran (for a bad input: silently accepted);
- ``exit N: ...``: another exit code with the last line printed;
- ``+ wrote F``: the case's folder holds files afterwards (a refusal must write nothing).

Fixtures take about a minute (two short debug_moe runs); each case 3-10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    cmd: str  # `train ...` or `apiary ...`; {F} is the fixtures folder
    expected: str
    env: dict = field(default_factory=dict)
    writes_ok: bool = False  # a case that is expected to write (a deliberate acceptance)
    verify: Optional[Callable[[Path], str]] = None  # what an accepted run did (its folder -> a few words)


def _metrics(folder: Path) -> list:
    path = folder / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


def _last_step(cwd: Path) -> str:
    m = _metrics(cwd / "out")
    return f"last record: step {m[-1]['step']} of 5" if m else "no metrics.jsonl"


def _first_loss(cwd: Path) -> str:
    m = _metrics(cwd / "out")
    return f"step-1 loss {m[0]['loss']:.4f} (initialised weights: 5.7984)" if m else "no metrics.jsonl"


def _data_line(cwd: Path) -> str:
    cfg = cwd / "out" / "config.yaml"
    line = next((ln.strip() for ln in cfg.read_text().splitlines() if ln.strip().startswith("path:")), "") \
        if cfg.is_file() else ""
    return f"config.yaml data {line}" if line else "no config.yaml"


TRAIN1 = "training.steps=1 checkpoint.enable=false"  # a short run where a case must get as far as training

CASES: list[Case] = [
    # ---------------------------------------------------------------- model.*
    Case("train model.vocab_size=0 --cfg job", "exit 2 naming model.vocab_size (>= 2)"),
    Case("train model.vocab_size=-5 --cfg job", "exit 2 naming model.vocab_size (>= 2)"),
    Case("train model.family=qwen4 --cfg job", "exit 2: unknown family, did-you-mean qwen3"),
    Case("train model.flavor=[tiny_moe,tiny_dense] --cfg job", "exit 2: a list where a name belongs"),
    Case("train model.hf_checkpoint={F}/nowhere --cfg job", "exit 2 naming the missing folder"),
    Case("train model.flex_autotune=maybe --cfg job", "exit 2: not a boolean"),
    # ---------------------------------------------------------------- parallel.*
    Case("train parallel.ep=[1,2] --cfg job", "exit 2: a list where an integer belongs"),
    Case("train parallel.tp=2 --cfg job", "exit 2: tp does not fit one rank"),
    Case("train parallel.gpus=eight --cfg job", "exit 2: not an integer"),
    # ---------------------------------------------------------------- training.*
    Case("train training.steps=1e3 --cfg job", "exit 2: not an integer (write 1000)"),
    Case("train training.global_batch=3", "exit 2: global_batch not a multiple of local_batch x DP"),
    Case("train training.max_skips=3", "exit 2: max_skips acts with on_nonfinite=skip only (ignored)"),
    Case("train training.dtype=fp16 --cfg job", "exit 2 naming training.dtype"),
    Case("train training.kernel_cache= --cfg job", "exit 2: an empty path (null for the default caches)"),
    Case("train training.seed=[1,2] --cfg job", "exit 2: a list where an integer belongs"),
    Case("train training.on_nonfinite=skip training.max_skips=inf --cfg job", "exit 2: not an integer"),
    # ---------------------------------------------------------------- data.*
    Case("train data.format=rollouts loss=grpo data.path={F}/text.jsonl", "exit 2 naming file:line: not a rollout record"),
    Case("train recipe=debug_grpo data.path={F}/missing.jsonl", "exit 2 naming the missing path"),
    Case("train data.format=rollouts --cfg job", "deliberate: a language-model loss trains on rollouts' tokens "
         "(ce and linear_ce read both formats); the packaged rollouts"),
    Case("train data.wait_timeout=30", "exit 2: data.wait_timeout acts with data.follow=true only (ignored)"),
    Case("train data.tokenizer={F}/missing_tok", "exit 2 naming data.tokenizer: no folder there"),
    Case("train data.tokenizer={F}/notes.txt", "exit 2: data.tokenizer is a file, not a folder"),
    Case("train data.path=", "exit 2: empty data.path"),
    Case(f"train data.path=~/text.jsonl {TRAIN1} output_dir=out", "exit 2: the shell leaves ~ after key= as it "
         "is; write $HOME/..., or quote it", env={"HOME": "{F}"}),
    Case(f"train \"data.path='~/text.jsonl'\" {TRAIN1} output_dir=out", "trains on $HOME/text.jsonl (~ expanded)",
         env={"HOME": "{F}"}, writes_ok=True, verify=_data_line),
    Case("train data.name=", "exit 2: empty data.name"),
    Case("train recipe=debug_grpo data.follow=true data.path={F}/missing_dir training.steps=1 data.wait_timeout=5 "
         "output_dir=out", "deliberate: the generator creates the folder; the trainer waits, names it, and "
         "exits 77 after data.wait_timeout", writes_ok=True),
    Case("train recipe=debug_grpo_live data.path={F}/live_rollouts data.wait_timeout=nan publish.dir={F}/w "
         "output_dir=out",
         "exit 2: data.wait_timeout must be a finite number of seconds > 0"),
    # ---------------------------------------------------------------- moe.*
    Case("train moe.comm=deepep --cfg job", "exit 2: deep_ep not installed"),
    Case("train moe.load_balance_coeff=inf --cfg job", "exit 2 naming moe.load_balance_coeff (finite)"),
    Case("train recipe=debug_dense moe.chunk=chunk2 --cfg job", "exit 2: a dense model has no MoE layers to chunk"),
    Case("train recipe=debug_dense moe.comm=deepep --cfg job", "exit 2 (deep_ep missing; a dense model has no dispatch)"),
    Case("train moe.routing_replay=maybe --cfg job", "exit 2: not a boolean"),
    # ---------------------------------------------------------------- rl.*
    Case("train recipe=debug_grpo rl.mismatch_threshold=nan --cfg job", "exit 2 naming rl.mismatch_threshold"),
    Case("train recipe=debug_grpo rl.tis_cap=inf --cfg job", "exit 2 naming rl.tis_cap (inf caps nothing: null)"),
    Case("train recipe=debug_grpo rl.max_lag=abc --cfg job", "exit 2: not an integer"),
    # ---------------------------------------------------------------- publish.*
    Case("train publish.dir={F}/weights", "exit 2: publish.dir with publish.interval=0 (ignored)"),
    Case("train publish.keep=5", "exit 2: publish.keep with publish.interval=0 (ignored)"),
    Case("train publish.dtype=bfloat16", "exit 2: publish.dtype with publish.interval=0 (ignored)"),
    Case("train publish.interval=1 publish.dir={F}/notes.txt", "exit 2: publish.dir is a file"),
    # ---------------------------------------------------------------- optimizer.* / lr.*
    Case("train optimizer.eps=inf --cfg job", "exit 2 naming optimizer.eps (finite > 0)"),
    Case("train optimizer.weight_decay=inf --cfg job", "exit 2 naming optimizer.weight_decay (finite >= 0)"),
    Case("train optimizer.beta2=1 --cfg job", "exit 2 naming optimizer.beta2 in [0, 1)"),
    Case("train optimizer.name=SGD --cfg job", "exit 2 listing Adam, AdamW"),
    Case("train lr.decay_type=Cosine --cfg job", "exit 2 with did-you-mean cosine"),
    Case("train lr.warmup_steps=5 lr.decay_ratio=0.9 training.steps=20 --cfg job",
         "exit 2: warm-up + decay steps exceed training.steps (torchtitan would shorten the warm-up)"),
    # ---------------------------------------------------------------- validation.*
    Case("train validation.steps=3", "exit 2: validation.steps with validation.interval=0 (ignored)"),
    Case("train validation.interval=5 validation.path={F}/emptydir", "exit 2 naming validation.path: no data files"),
    Case("train validation.interval=5 validation.fraction=0.1 validation.steps=-1 --cfg job",
         "exit 2 naming validation.steps"),
    # ---------------------------------------------------------------- checkpoint.*
    Case("train checkpoint.keep_latest_k=1 training.steps=2 checkpoint.interval=1 output_dir=out",
         "exit 2 or keeps one step (torchtitan needs >= 2)", writes_ok=True),
    Case("train checkpoint.resume=true checkpoint.enable=false output_dir={RUN} training.steps=4 "
         "lr.total_steps=4", "exit 2: a resume that loads and saves nothing"),
    Case("train checkpoint.resume=true checkpoint.load_step=-1 output_dir={RUN} training.steps=4",
         "exit 2 listing the complete steps"),
    Case("train checkpoint.resume=true checkpoint.load_path={F}/run_ck/checkpoint/step-1 output_dir={RUN} "
         "training.steps=4 lr.total_steps=4", "exit 2: both name what to load"),
    Case("train checkpoint.interval=-5 --cfg job", "exit 2 naming checkpoint.interval"),
    Case("train checkpoint.enable=false checkpoint.interval=5",
         "exit 2: checkpoint.interval with checkpoint.enable=false (ignored)"),
    Case("train checkpoint.load_path={F}/notes.txt", "exit 2: not a DCP checkpoint folder"),
    Case("train checkpoint.enable=false checkpoint.load_path={F}/run_ck/checkpoint/step-2 training.steps=1 "
         "output_dir=out", "exit 2: with checkpointing off the weights would not be loaded"),
    Case("train checkpoint.load_path=../../F/run_ck/checkpoint/step-2 training.steps=1 output_dir=out",
         "loads the step (a path relative to the working folder)", writes_ok=True, verify=_first_loss),
    Case("train checkpoint.create_seed=true checkpoint.resume=true output_dir={RUN} training.steps=4 "
         "lr.total_steps=4",
         "exit 2: a seed checkpoint starts a run; it does not resume one"),
    # ---------------------------------------------------------------- logging.*
    Case(f"train logging.wandb=true {TRAIN1} output_dir=out", "deliberate: wandb is a dependency; without "
         "WANDB_API_KEY it logs offline", writes_ok=True),
    Case("train logging.wandb_project=bees", "exit 2: logging.wandb_project with logging.wandb=false (ignored)"),
    Case("train logging.log_freq=100 training.steps=5 checkpoint.enable=false output_dir=out",
         "trains; the last step is logged whatever log_freq (the summary's steps and last loss are step 5's)",
         writes_ok=True, verify=_last_step),
    Case("train logging.color=sometimes --cfg job", "exit 2: not a boolean"),
    # ---------------------------------------------------------------- precision.* / adapter.* / loss / state / recompute
    Case("train precision=fp8 precision.backend=xyz --cfg job", "exit 2 listing torchao, te"),
    Case("train precision.compile=true training.steps=1 checkpoint.enable=false output_dir=out",
         "deliberate: trains with torch.compile on CPU", writes_ok=True),
    Case("train adapter=lora adapter.alpha=-1 --cfg job", "exit 2 naming adapter.alpha"),
    Case("train adapter=lora adapter.dropout=1.5 --cfg job", "exit 2 naming adapter.dropout"),
    Case("train adapter=lora adapter.targets=attn --cfg job", "exit 2: a list of targets, did-you-mean"),
    Case("train adapter=lora adapter.init=xavier --cfg job", "exit 2 listing kaiming, gaussian"),
    Case("train state=zero1 state.offload=everything --cfg job", "exit 2 naming state.offload"),
    Case("train recompute=sometimes --cfg job", "exit 2 listing none, selective, full"),
    # ---------------------------------------------------------------- launchers
    Case("apiary launch launcher=slurm nodes=0 --dry-run", "exit 2 naming launcher.nodes"),
    Case("apiary launch launcher=slurm gpus_per_node=-8 --dry-run", "exit 2 naming launcher.gpus_per_node"),
    Case("apiary launch launcher=slurm time=forever --dry-run", "exit 2 naming launcher.time"),
    Case("apiary launch launcher=slurm mem=lots --dry-run", "exit 2 naming launcher.mem (e.g. 500G)"),
    Case("apiary launch launcher=slurm rdzv_port=70000 --dry-run", "exit 2 naming launcher.rdzv_port (1-65535)"),
    Case("apiary launch launcher=slurm partition= --dry-run", "exit 2: an empty partition"),
    Case("apiary launch launcher=slurm extra_sbatch=--exclusive --dry-run", "exit 2: a list of sbatch flags"),
    Case("apiary launch launcher=slurm setup=[\"module load cuda\"] job_name='my job' --dry-run",
         "exit 2: a job name with a space (or quoted in the script)"),
    Case("apiary launch launcher=slurm nodes=2 launcher.nodes=3 --dry-run", "deliberate: the last value wins, as "
         "in Hydra's grammar for train; the script says --nodes=3"),
    Case("apiary launch launcher=local nproc=2 --wait", "exit 2: launcher local has no wait option"),
    Case("apiary launch launcher=slurm", "exit 2: sbatch not on PATH (a login node without Slurm); add --dry-run",
         env={"PATH": "{BIN}"}),
    Case("apiary launch launcher=slurm time=00:00:30 --dry-run", "exit 2: the checkpoint signal comes after the limit"),
    # ---------------------------------------------------------------- apiary subcommands
    Case("apiary export {F}/run_nockpt --hf exported", "exit 2: the run has no checkpoint"),
    Case("apiary export {F}/notes.txt --hf exported", "exit 2: not a run folder"),
    Case("apiary export {F}/run_ck --hf {F}/notes.txt", "exit 2: --hf is a file"),
    Case("apiary export", "exit 2: the run folder and --hf are needed"),
    Case("apiary cp debug_moe /proc/apiary.yaml", "exit 2: the destination cannot be written"),
    Case("apiary cp-template slurm /proc/train.sbatch.j2", "exit 2: the destination cannot be written"),
    Case("apiary cp-template local tpl.j2", "exit 2: launcher local has no template"),
    Case("apiary autotune-table {F}/notes.txt --out t.json", "exit 2: not a folder"),
    Case("apiary plan calib.nope=1", "exit 2: unknown planner constant, did-you-mean"),
    Case("apiary plan calibration={F}/bad_calib.json", "exit 2: the calibration file is not JSON/YAML"),
    Case("apiary plan gpu=H300", "exit 2 listing H100, H200"),
    Case("apiary plan gpus_per_node=0", "exit 2: a positive integer"),
    Case("apiary compare recipe=debug_moe", "exit 2: no key with variants"),
    Case("apiary compare loss=ce,nope training.steps=2", "exit 2: unknown loss, did-you-mean"),
    Case("apiary warmup nproc=2", "exit 2: warmup runs one process"),
    Case("apiary show {F}/emptydir", "exit 2: no recipe, registry name or HF folder"),
    Case("apiary logprobs", "exit 2: the model, rollouts and --out are needed"),
    Case("apiary plot {F}/run_ck --out {F}/emptydir", "exit 2: --out must be a .png file"),
    Case("apiary ls registry=", "exit 2: registry= names no file"),
    # ---------------------------------------------------------------- environment variables
    Case("train --cfg job", "exit 2 naming WORLD_SIZE (not an integer)", env={"WORLD_SIZE": "abc"}),
    Case("train --cfg job", "exit 2 naming WORLD_SIZE (must be >= 1)", env={"WORLD_SIZE": "0"}),
    Case(f"train {TRAIN1} output_dir=out", "exit 2: WORLD_SIZE without RANK is a stale launcher variable",
         env={"WORLD_SIZE": "4"}),
    Case("train --cfg job", "exit 2 naming APIARY_DEVICE (cpu, or unset)", env={"APIARY_DEVICE": "gpux"}),
    Case(f"train {TRAIN1} output_dir=out", "exit 2: RANK and WORLD_SIZE without a launcher (no MASTER_PORT to "
         "meet the other ranks)", env={"RANK": "0", "WORLD_SIZE": "2"}),
]


def _fixtures(f: Path, timeout: int) -> None:
    f.mkdir(parents=True, exist_ok=True)
    doc = "Bees visit flowers and turn nectar into honey. "
    (f / "text.jsonl").write_text("".join(json.dumps({"text": f"{n}: {doc * 4}"}) + "\n" for n in range(60)))
    (f / "notes.txt").write_text("a plain file, not a folder\n")
    (f / "emptydir").mkdir(exist_ok=True)
    (f / "live_rollouts").mkdir(exist_ok=True)
    (f / "bad_calib.json").write_text("{not: [json\n")
    for name, extra in (("run_nockpt", ["training.steps=1", "checkpoint.enable=false"]),
                        ("run_ck", ["training.steps=2", "checkpoint.interval=1"])):
        if not (f / name / "config.yaml").is_file():
            p = _run(["train", *extra, f"output_dir={f / name}"], f, {}, timeout)
            assert p.returncode == 0, (name, p.stdout[-2000:], p.stderr[-2000:])


def _run(argv: list[str], cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    mod = "toolkit.cli" if argv[0] == "apiary" else "framework.cli"
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled", **env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
              "MASTER_PORT"):
        if k not in env:
            e.pop(k, None)
    try:
        return subprocess.run([sys.executable, "-m", mod, *argv[1:]], cwd=cwd, env=e, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        out = t.stdout.decode() if isinstance(t.stdout, bytes) else (t.stdout or "")
        err = t.stderr.decode() if isinstance(t.stderr, bytes) else (t.stderr or "")
        return subprocess.CompletedProcess(t.cmd, 124, out, err + f"\n(timed out after {timeout} s)")


def outcome(p: subprocess.CompletedProcess) -> str:
    """One short line: how the command ended, as the table shows it."""
    text = p.stderr + p.stdout
    if "Traceback (most recent call last)" in text:
        last = [ln for ln in text.splitlines() if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", ln)]
        return f"traceback: {last[-1].split(':')[0] if last else '?'} (exit {p.returncode})"
    flat = " ".join(p.stderr.split())
    if p.returncode == 124:
        tail = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
        return f"hung: killed at the time limit{f', after printing `{tail[-1][:80]}`' if tail else ''}"
    if p.returncode == 2 and "error apiary:" in flat:
        msg = flat[flat.index("error apiary:") + len("error "):]
        return f"ok: exit 2: {msg[:150]}{'...' if len(msg) > 150 else ''}"
    if p.returncode == 0:
        return "accepted (exit 0)"
    tail = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"exit {p.returncode}: {(tail[-1] if tail else '')[:150]}"


def _listing(folder: Path) -> list:
    """Every file under ``folder`` with its size and modification time (nothing when it is absent)."""
    return sorted((str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in folder.rglob("*")) if folder.is_dir() else []


def run_case(i: int, c: Case, fixtures: Path, work: Path, timeout: int) -> dict:
    cwd = work / f"case{i}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    run = work / f"case{i}-run"  # {RUN}: a fresh copy of the fixture run with checkpoints (steps 1, 2)
    if "{RUN}" in c.cmd:
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(fixtures / "run_ck", run)
    before = _listing(run)
    argv = shlex.split(c.cmd.replace("{F}", str(fixtures)).replace("{RUN}", str(run)))
    t = time.perf_counter()
    env = {k: v.replace("{F}", str(fixtures)).replace("{BIN}", str(Path(sys.executable).parent))
           for k, v in c.env.items()}
    p = _run(argv, cwd, env, timeout)
    got = outcome(p)
    if c.verify is not None and p.returncode == 0:
        got += f"; {c.verify(cwd)}"
    written = sorted(str(q.relative_to(cwd)) for q in cwd.iterdir())
    if written and not c.writes_ok:
        got += f" + wrote {', '.join(written[:3])}"
    if _listing(run) != before and not c.writes_ok:
        got += " + changed RUN"
    shown = " ".join(f"{k}={v}" for k, v in c.env.items())
    return {"n": i, "input": f"{shown} {c.cmd}".strip(), "expected": c.expected, "observed": got,
            "rc": p.returncode, "seconds": round(time.perf_counter() - t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated case numbers (1-based)")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--before", default="", help="rows of an earlier run (--json): adds them as `observed before`, "
                    "matched by command")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = ap.parse_args()
    only = {int(x) for x in a.only.split(",") if x.strip()}
    before = {r["input"]: r["observed"] for r in json.loads(Path(a.before).read_text())} if a.before else None
    tmp = Path(tempfile.mkdtemp(prefix="apiary-bad-inputs-"))
    rows = []
    try:
        _fixtures(tmp / "F", a.timeout)
        if before is None:
            print("| # | input (exact command) | expected | observed |")
            print("|---|---|---|---|")
        else:
            print("| # | input (exact command) | expected | observed before | after |")
            print("|---|---|---|---|---|")
        for i, c in enumerate(CASES, 1):
            if only and i not in only:
                continue
            r = run_case(i, c, tmp / "F", tmp / "work", a.timeout)
            rows.append(r)
            short = {str(tmp / "work" / f"case{i}-run"): "RUN", str(tmp / "work" / f"case{i}"): ".",
                     str(tmp / "F"): "F", f"{ROOT}/": ""}
            for path, name in short.items():
                r["observed"] = r["observed"].replace(path, name)
            cells = [str(i), f"`{r['input']}`", r["expected"], r["observed"]]
            if before is not None:
                cells.insert(3, before.get(r["input"], "(not run)"))
            print("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |", flush=True)
    finally:
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
