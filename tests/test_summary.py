"""The end-of-run summary (framework/report/summary.py) on synthetic run folders: every number derived
from the records by hand, the labels, the checkpoint it names, the next commands, summary.json,
and the short form of a stopped run. (A real training's summary: tests/test_train_cpu.py and
tests/test_progress.py's terminal run.)"""

from __future__ import annotations

import io
import json

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from framework.compose import recipes
from framework.report import summary
from framework.resolve import resume, values

H100 = "NVIDIA H100 80GB HBM3"


def _run(tmp_path, records, steps=4, checkpoints=(), incomplete=(), tb=True, extra_configs=(), overrides=None):
    """A run folder; ``overrides``: its config.yaml is debug_moe's real one with them (else a stub)."""
    d = tmp_path / "run"
    d.mkdir(parents=True)
    if overrides is None:
        (d / "config.yaml").write_text(f"recipe: debug_moe\ntraining:\n  steps: {steps}\n")
    else:
        given = [f"training.steps={steps}", f"output_dir={d}", *overrides]
        OmegaConf.save(recipes.load("debug_moe", given), d / "config.yaml")
        resume.write_launch(d, {"recipe": "debug_moe", "overrides": given})  # as rank 0 writes it
    for name, text in extra_configs:
        (d / name).write_text(text)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for n in checkpoints:
        (d / "checkpoint" / f"step-{n}").mkdir(parents=True)
        (d / "checkpoint" / f"step-{n}" / "manifest.json").write_text("{}")
    for n in incomplete:  # a save cut short: no manifest, no .metadata
        (d / "checkpoint" / f"step-{n}").mkdir(parents=True)
    if tb:
        (d / "tb").mkdir()
    return d


def _rec(step, loss, elapsed, tokens=1000, tflops=400.0, mfu=40.0, device=H100, peak=989.0, mem=10 * 2**30,
         kind="cuda_max_memory_reserved"):
    """A record as framework/report/metrics.py writes it: apiary's count (``tflops``) and torchtitan's, here 1.5x."""
    return {"step": step, "loss": loss, "grad_norm": 1.0, "tokens_per_s": 1.0, "tokens": tokens,
            "tflops_per_gpu": tflops, "tflops_per_gpu_torchtitan": 1.5 * tflops if tflops is not None else None,
            "mfu_pct": mfu, "peak_tflops_per_gpu": peak, "device": device,
            "step_time_s": 1.0, "elapsed_s": elapsed, "peak_mem_bytes": mem, "peak_mem_kind": kind}


def _text(s) -> str:
    buf = io.StringIO()
    summary.render(s, Console(file=buf, width=100, color_system=None), color=False)
    return buf.getvalue()


def test_gpu_run_numbers_are_derived_from_the_records(tmp_path):
    recs = [_rec(1, 6.0, 30.0, tokens=1000, tflops=100.0, mfu=10.0, mem=9 * 2**30),  # compile step: left out
            _rec(2, 5.0, 32.0, tokens=1000, tflops=400.0, mfu=40.0),
            _rec(3, 4.5, 38.0, tokens=3000, tflops=300.0, mfu=30.0, mem=12 * 2**30),
            {"step": 3, "val_loss": 4.9, "val_tokens_per_s": 10.0},  # a validation record of its own
            _rec(4, 4.7, 40.0, tokens=1000, tflops=500.0, mfu=50.0)]
    d = _run(tmp_path, recs, steps=4, checkpoints=(2, 4), incomplete=(6,),
             overrides=["loss=chunked", "loss.num_chunks=4", "launcher.nproc=2", "training.seq_len=64"])
    s = summary.summarize(d)
    assert s["status"] == "completed" and s["step"] == 4 and s["total_steps"] == 4 and s["launches"] == 1
    assert s["tokens"] == 6000 and s["wall_time_s"] == 40.0
    # after the first record: 5000 tokens in 40 - 30 = 10 s; intervals of 2, 6 and 2 s weigh the means
    assert s["tokens_per_s_mean"] == pytest.approx(500.0)
    assert s["tflops_per_gpu_mean"] == pytest.approx((400 * 2 + 300 * 6 + 500 * 2) / 10)
    assert s["tflops_per_gpu_torchtitan_mean"] == pytest.approx(1.5 * (400 * 2 + 300 * 6 + 500 * 2) / 10)
    assert s["mfu_pct_mean"] == pytest.approx((40 * 2 + 30 * 6 + 50 * 2) / 10)
    assert s["mfu_missing_because"] is None and s["peak_tflops_per_gpu"] == 989.0
    assert s["peak_mem_bytes"] == 12 * 2**30 and s["peak_mem_label"] == "torch max reserved on rank 0's GPU"
    assert (s["loss_first"], s["loss_last"], s["loss_best"], s["loss_best_step"]) == (6.0, 4.7, 4.5, 3)
    assert (s["val_loss_last"], s["val_loss_step"]) == (4.9, 3)
    assert s["checkpoint"] == str(d / "checkpoint" / "step-4")  # step-6 is incomplete
    # a finished run trains on, its schedule stretched over the new steps, repeating the run's overrides (a
    # resume refuses another model, data or schedule: framework/resolve/resume.py); the stretch alone would
    # raise the lr at step 5 (0.003 x 1/2 at step 4 of 4, x 2/3 at step 5 of 8), so it starts from step 4's
    # rate: optimizer.lr 0.003 x (1/2) / (2/3)
    assert s["next"] == {
        "resume": f"train recipe=debug_moe output_dir={d} checkpoint.resume=true training.steps=8 loss=chunked "
                  "loss.num_chunks=4 launcher.nproc=2 training.seq_len=64 lr.total_steps=8 optimizer.lr=0.00225",
        "export": f"apiary export {d} --hf {d / 'hf'}",
        "plot": f"apiary plot {d}",
        "tensorboard": f"tensorboard --logdir {d / 'tb'}",
    }
    assert json.loads(summary.write(s).read_text()) == s and (d / "summary.json").is_file()
    text = _text(s)
    for line in ("steps         4/4", "tokens        6,000", "tok/s (mean)  500 (first step left out",
                 "TFLOPs/GPU    360.0 apiary's count (causal attention halved, frozen weights without weight "
                 "gradients) · 540.0 torchtitan's count (full attention)",
                 f"MFU           36.0% of 989 peak ({H100}, dense BF16; apiary's count)",
                 "peak memory   12.00 GiB (torch max reserved on rank 0's GPU)",
                 "loss          first 6.0000 · last 4.7000 · best 4.5000 (step 3)", "val_loss      4.9000 (step 3)",
                 f"checkpoint    {d / 'checkpoint' / 'step-4'}", f"resume        {s['next']['resume']}"):
        assert line in text, (line, text)


def test_resume_command_of_a_recipe_file_runs(tmp_path, monkeypatch):
    """A run of `train recipe=my_recipe.yaml optimizer.lr=1e-2`: the resume command names the file as
    given (the config holds its stem, an unknown recipe), repeats the overrides and stretches the
    schedule from the rate the run reached (its optimizer.lr replaced by the scaled one: 3/4 of it here);
    with no overrides it claims none."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_recipe.yaml").write_text((recipes.RECIPES_DIR / "debug_moe.yaml").read_text())
    recs = [_rec(n, 6.0 - n, 2.0 * n) for n in (1, 2, 3, 4)]
    for over, want in ((["optimizer.lr=1e-2"], " lr.total_steps=8 optimizer.lr=0.0075"),
                       ([], " lr.total_steps=8 optimizer.lr=0.00225")):
        d = tmp_path / "run"
        if d.exists():
            import shutil

            shutil.rmtree(d)
        d.mkdir()
        cfg = recipes.load("my_recipe.yaml", ["training.steps=4", "output_dir=run", *over])
        assert cfg.recipe == "my_recipe" and "my_recipe" not in recipes.recipe_names()
        OmegaConf.save(cfg, d / "config.yaml")
        resume.write_launch(d, {"recipe": "my_recipe.yaml", "overrides": ["training.steps=4", "output_dir=run", *over]})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (d / "checkpoint" / "step-4").mkdir(parents=True)
        (d / "checkpoint" / "step-4" / "manifest.json").write_text("{}")
        s = summary.summarize("run")
        assert s["next"]["resume"] == ("train recipe=my_recipe.yaml output_dir=run checkpoint.resume=true "
                                       "training.steps=8" + want), s["next"]["resume"]


def test_rank_0s_resume_line_composes_nothing(tmp_path, monkeypatch):
    """Rank 0 prints the summary's resume command from the launch the hand-off carries
    (``Resolved.launch``): nothing is composed (compose raises here), the folder's own launch record is
    not what it reads, and the last of a key given twice is the one repeated."""
    from types import SimpleNamespace

    from framework.train import run

    d = _run(tmp_path, [_rec(n, 6.0 - n, 2.0 * n) for n in (1, 2)], steps=2, checkpoints=(2,), tb=False,
             overrides=["optimizer.lr=1e-3"])

    composed = []

    def compose(*a, **k):
        composed.append(a)
        raise AssertionError("composed the recipe again")

    monkeypatch.setattr(recipes, "load", compose)
    launch = {"recipe": "debug_moe", "overrides": ["loss=chunked", "training.steps=2", f"output_dir={d}",
                                                   "optimizer.lr=1e-3", "optimizer.lr=2e-3", "checkpoint.resume=true"]}
    resolved = SimpleNamespace(cfg=OmegaConf.create({"output_dir": str(d), "logging": {"color": False}}), launch=launch)
    run._report(resolved)
    got = json.loads((d / "summary.json").read_text())["next"]["resume"]
    assert got == (f"train recipe=debug_moe output_dir={d} checkpoint.resume=true training.steps=4 loss=chunked "
                   "optimizer.lr=2e-3 lr.total_steps=4 lr.warmup_steps=1"), got  # the warm-up 2 steps shortened
    assert composed == []


def test_records_of_an_older_apiary_show_torchtitans_count_as_torchtitans(tmp_path):
    """Before apiary logged its own count, ``tflops_per_gpu`` and ``mfu_pct`` were torchtitan's (full
    attention): the summary shows them under torchtitan's label and claims no MFU."""
    recs = [{k: v for k, v in _rec(n, 6.0 - n, 2.0 * n, tflops=500.0, mfu=50.0).items()
             if k != "tflops_per_gpu_torchtitan"} for n in (1, 2, 3)]
    s = summary.summarize(_run(tmp_path, recs, steps=3))
    assert s["tflops_per_gpu_mean"] is None and s["tflops_per_gpu_torchtitan_mean"] == pytest.approx(500.0)
    assert s["mfu_pct_mean"] is None and "older apiary" in s["mfu_missing_because"]
    text = _text(s)
    assert "TFLOPs/GPU    n/a apiary's count" in text and "500.0 torchtitan's count" in text, text


def test_cpu_run_claims_no_tflops_or_mfu(tmp_path):
    recs = [_rec(n, 6.0 - n, 2.0 * n, tflops=None, mfu=None, device="cpu", peak=None, mem=2**30, kind="cpu_max_rss")
            for n in (1, 2, 3)]
    s = summary.summarize(_run(tmp_path, recs, steps=3, checkpoints=(3,), tb=False))
    assert s["tflops_per_gpu_mean"] is None and s["mfu_pct_mean"] is None
    assert s["mfu_missing_because"] == "no known peak for cpu"
    assert s["peak_mem_label"] == "max RSS of rank 0's process" and "tensorboard" not in s["next"]
    text = _text(s)
    assert "MFU           n/a (no known peak for cpu)" in text and "TFLOPs" not in text
    assert "peak memory   1.00 GiB (max RSS of rank 0's process)" in text


def test_unknown_gpu_has_no_mfu_and_a_resumed_run_counts_two_launches(tmp_path):
    gpu = "NVIDIA L4"
    first = [{**_rec(1, 6.0, 10.0, device=gpu, peak=None, mfu=None), "first_step_wall_s": 5.0},
             _rec(2, 5.0, 12.0, tokens=500, device=gpu, peak=None, mfu=None)]
    # the resume re-trains from step 3 in a new process: its first record has the first step's breakdown
    # (and its elapsed_s starts again, here from a slower build than the whole first launch)
    second = [{**_rec(3, 4.0, 20.0, tokens=800, device=gpu, peak=None, mfu=None), "first_step_wall_s": 5.0},
              _rec(4, 3.0, 21.0, tokens=700, device=gpu, peak=None, mfu=None)]
    d = _run(tmp_path, first + second, steps=4, checkpoints=(4,),
             extra_configs=[("config.resume-1.yaml", "recipe: my.yaml\ntraining:\n  steps: 4\n")])
    s = summary.summarize(d)
    assert s["launches"] == 2 and s["wall_time_s"] == 12.0 + 21.0 and s["tokens"] == 1000 + 500 + 800 + 700
    assert s["tokens_per_s_mean"] == pytest.approx((500 + 700) / (2.0 + 1.0))  # each launch's first step left out
    assert s["mfu_pct_mean"] is None and s["mfu_missing_because"] == f"no known peak for {gpu}"
    assert s["tflops_per_gpu_mean"] == pytest.approx(400.0)
    assert s["recipe"] == "my.yaml"  # the newest launch's config
    assert "steps         4/4 (2 launches)" in _text(s)


def test_stopped_run_gets_the_short_summary(tmp_path):
    recs = [_rec(n, 6.0 - n, float(n)) for n in (1, 2, 3)]
    d = _run(tmp_path, recs, steps=10, checkpoints=(2, 3), overrides=[])
    s = summary.summarize(d, stop="by a signal", exit_code=75, stopped_at=3)
    assert s["status"] == "stopped" and s["step"] == 3
    assert s["next"]["resume"] == f"train recipe=debug_moe output_dir={d} checkpoint.resume=true training.steps=10"
    text = _text(s).splitlines()
    assert text == [f"stopped by a signal after step 3 of 10 (exit code 75); checkpoint: {d / 'checkpoint' / 'step-3'}",
                    f"  resume: {s['next']['resume']}"]


def test_run_without_checkpoint_or_records(tmp_path):
    d = _run(tmp_path, [], steps=5, tb=False)
    s = summary.summarize(d, stop="on a non-finite loss or gradient norm", exit_code=76, stopped_at=0)
    assert s["checkpoint"] is None and s["next"] == {} and s["tokens"] is None
    assert _text(s).splitlines() == ["stopped on a non-finite loss or gradient norm after step 0 of 5 (exit code 76); "
                                     "checkpoint: none saved"]
    done = summary.summarize(_run(tmp_path / "b", [_rec(1, 5.0, 3.0)], steps=1, tb=False))
    text = _text(done)
    assert "checkpoint    none saved" in text and "tok/s (mean)  n/a (one logged step)" in text
    assert "resume" not in text and done["mfu_missing_because"].startswith("one logged step")


def test_a_lora_run_on_a_seeded_base_suggests_no_export_it_would_refuse(tmp_path):
    """Adapters on a base built from the seed: `apiary export` refuses them (the base exists on no
    disk), so the summary leaves out the `next: export` line and says what an export needs (was: it
    printed `apiary export RUN --hf RUN/hf`). On a base folder the line is there."""
    recs = [_rec(n, 6.0 - n, 2.0 * n, tflops=None, mfu=None, device="cpu", peak=None) for n in (1, 2)]
    s = summary.summarize(_run(tmp_path / "seed", recs, steps=2, checkpoints=(2,), tb=False,
                               overrides=["adapter=lora", "moe.load_balance_coeff=null"]))
    assert "export" not in s["next"] and "resume" in s["next"], s["next"]
    assert "exists on no disk" in s["export_missing_because"]
    text = " ".join(_text(s).split())
    assert "apiary export" not in text.replace("so apiary export refuses them", ""), text
    assert "export none: the adapters were trained on a base built from the seed" in text, text
    assert "model.hf_checkpoint=DIR or checkpoint.load_path=STEP" in text, text
    s = summary.summarize(_run(tmp_path / "full", recs, steps=2, checkpoints=(2,), tb=False, overrides=[]))
    assert "export" in s["next"] and s["export_missing_because"] is None


@pytest.mark.parametrize("schedule", [[], ["lr.min_lr_factor=0.1"], ["lr.decay_type=cosine"], ["lr.decay_ratio=0.3"],
                                      ["lr.warmup_steps=0", "optimizer.lr=1e-2"], ["training.steps=5", "lr.total_steps=20"]])
def test_the_suggested_resume_never_raises_the_learning_rate(tmp_path, schedule):
    """The summary's `next: resume` of a finished run stretched the schedule over twice the steps, which
    restarts part of its decay (the tutorial's run: step 10 at lr 3.75e-04, step 11 at 1.67e-03, 4.4x; a
    longer run 7x). Whatever the schedule, the suggested command's step N+1 uses at most step N's rate:
    the stretch where it does not raise it, the schedule kept where its end is above 0, else the stretch
    from the rate reached (optimizer.lr scaled); the note names the rate the plain stretch would jump to."""
    steps = next((int(o.split("=")[1]) for o in schedule if o.startswith("training.steps=")), 10)
    given = [o for o in schedule if not o.startswith("training.steps=")]
    d = _run(tmp_path, [_rec(n, 6.0 - 0.1 * n, 2.0 * n) for n in range(1, steps + 1)], steps=steps,
             checkpoints=(steps,), overrides=given)
    s = summary.summarize(d)
    resume_cmd = s["next"]["resume"].split()
    assert resume_cmd[:5] == ["train", "recipe=debug_moe", f"output_dir={d}", "checkpoint.resume=true",
                              f"training.steps={2 * steps}"], resume_cmd
    old = OmegaConf.to_container(OmegaConf.load(d / "config.yaml"), resolve=True)
    new = OmegaConf.to_container(recipes.load("debug_moe", resume_cmd[2:]), resolve=True)
    values.check_tail(new)  # the resume check accepts it: no steps at lr 0
    assert resume.lr_at(new, steps + 1) <= resume.lr_at(old, steps) * (1 + 1e-9), (s["next"]["resume"], s["resume_note"])
    stretched = {**new, "lr": {**new["lr"], "total_steps": 2 * steps}, "optimizer": old["optimizer"]}
    if resume.lr_at(stretched, steps + 1) > resume.lr_at(old, steps) * (1 + 1e-9):
        assert f"raises the lr to {resume.lr_at(stretched, steps + 1):.3g} at step {steps + 1}" in s["resume_note"]
        assert f"({s['resume_note']})" in _text(s)
    else:
        assert s["resume_note"] is None


def test_the_export_suggestion_says_a_trained_routing_bias_is_left_out(tmp_path):
    """debug_moe's summary offered `next: export` without a word, and `apiary export` then warned that the
    routing bias (moe.load_balance_coeff) is not in the HF format: the suggestion says so, in a line under
    it; with balancing off, or on a dense model, it says nothing."""
    recs = [_rec(n, 6.0 - n, 2.0 * n, tflops=None, mfu=None, device="cpu", peak=None) for n in (1, 2)]
    s = summary.summarize(_run(tmp_path / "moe", recs, steps=2, checkpoints=(2,), tb=False, overrides=[]))
    assert "export" in s["next"] and s["export_note"] == summary.routing_bias_note.__globals__["NOTE"]
    text = " ".join(_text(s).split())
    assert "(the MoE routing bias is not in the HF format: it may route differently; moe.load_balance_coeff=null" in text
    off = summary.summarize(_run(tmp_path / "off", recs, steps=2, checkpoints=(2,), tb=False,
                                 overrides=["moe.load_balance_coeff=null"]))
    assert "export" in off["next"] and off["export_note"] is None and "routing bias" not in _text(off)
    dense = _run(tmp_path / "dense", recs, steps=2, checkpoints=(2,), tb=False, overrides=[])
    OmegaConf.save(recipes.load("debug_dense", [f"output_dir={dense}"]), dense / "config.yaml")
    assert summary.summarize(dense)["export_note"] is None
