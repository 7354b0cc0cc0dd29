"""Non-finite guard (training.on_nonfinite): a diverging run (optimizer.lr=1e6 on debug_moe) stops
before applying the NaN update, with exit code 76 and one paragraph; no checkpoint it leaves holds a
NaN or Inf; a resume continues from the last good step; `skip` skips and counts in metrics.jsonl."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import run_cli, train_here

SMALL = ["recipe=debug_moe", "training.seq_len=64", "model.n_layers=1"]


def _metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _all_finite(step_dir, tmp_path) -> int:
    """Every floating tensor of a DCP checkpoint (model and optimizer) is finite; returns the count."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    n = 0

    def walk(x):
        nonlocal n
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            n += 1
            assert torch.isfinite(x).all(), f"non-finite tensor in {step_dir}"
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(torch.load(out, weights_only=False))
    return n


def test_diverging_run_stops_before_the_update_and_saves_no_poison(workdir, tmp_path, capsys):
    p = train_here(["train", *SMALL, "optimizer.lr=1e6", "training.steps=6", "checkpoint.interval=1",
                    "output_dir=run"], workdir, capsys)
    assert p.returncode == 76, p.stdout[-2000:] + p.stderr[-3000:]
    err = p.stderr
    assert "Traceback" not in err, err[-3000:]
    ck = workdir / "run" / "checkpoint"
    steps = sorted(int(d.name.split("-")[1]) for d in ck.glob("step-*"))
    stop = max(steps) + 1  # the step that went non-finite saved nothing
    assert f"apiary: step {stop}: " in err and "is not finite" in err
    # step-{stop - 1} holds the weights the non-finite step was computed from: not called good (pass 11, #13)
    assert "no update was applied" in err and f"the newest, step-{stop - 1} in run/checkpoint" in err
    assert "may be damaged" in err and "Last good checkpoint" not in err
    assert "lower optimizer.lr" in err and "training.on_nonfinite=skip" in err and "checkpoint.resume=true" in err
    # rank 0's short summary: the step reached and the checkpoint (framework/report/summary.py)
    assert (f"stopped on a non-finite loss or gradient norm after step {stop - 1} of 6 (exit code 76); "
            f"checkpoint: run/checkpoint/step-{stop - 1}") in p.stdout
    assert json.loads((workdir / "run" / "summary.json").read_text())["status"] == "stopped"
    records = _metrics(workdir / "run")
    assert [r["step"] for r in records] == list(range(1, stop))  # the stopped step is not logged
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["loss"]) for r in records)
    for d in ck.glob("step-*"):  # 73 of 98 tensors were NaN in the step-3 checkpoint before the guard
        assert _all_finite(d, tmp_path) > 10
    assert not list(ck.glob(".partial-*"))


def test_resume_continues_from_the_last_good_checkpoint(workdir, capsys):
    run = ["output_dir=run", "checkpoint.interval=4"]
    p = train_here(["train", *SMALL, *run, "training.steps=4", "training.on_nonfinite=skip"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["skipped_steps"] for r in _metrics(workdir / "run")] == [0, 0, 0, 0]  # healthy: nothing skipped
    # the same run continued with a far too high learning rate diverges before step 8's save (stopping:
    # a resume keeps the last launch's overrides, so on_nonfinite=skip is given back as stop)
    p = train_here(["train", *SMALL, *run, "training.steps=8", "lr.total_steps=8", "optimizer.lr=1e6",
                    "training.on_nonfinite=stop", "checkpoint.resume=true"], workdir, capsys)
    assert p.returncode == 76, p.stderr[-3000:]
    assert "Last good checkpoint: step-4 in run/checkpoint" in p.stderr
    assert sorted(d.name for d in (workdir / "run" / "checkpoint").glob("step-*")) == ["step-4"]
    # the fix the paragraph asks for: a lower learning rate (given again: the last launch's 1e6 is kept otherwise)
    p = train_here(["train", *SMALL, *run, "training.steps=8", "lr.total_steps=8", "optimizer.lr=3e-3",
                    "checkpoint.resume=true"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [r for r in _metrics(workdir / "run")]
    last = [r for r in records if r["step"] >= 5][-4:]  # the resumed attempt's records
    assert [r["step"] for r in last] == [5, 6, 7, 8]
    assert all(math.isfinite(r["loss"]) for r in last) and last[-1]["loss"] < records[0]["loss"]
    assert (workdir / "run" / "checkpoint" / "step-8" / "manifest.json").is_file()


def test_skip_skips_counts_and_stops_after_max_skips(workdir, tmp_path, capsys):
    p = train_here(["train", *SMALL, "optimizer.lr=1e6", "training.steps=8", "checkpoint.interval=1",
                    "training.on_nonfinite=skip", "training.max_skips=2", "output_dir=run"], workdir, capsys)
    assert p.returncode == 76, p.stderr[-3000:]
    records = _metrics(workdir / "run")
    skipped = [r["step"] for r in records if r["nonfinite"]]
    assert len(skipped) == 2 and skipped[1] == skipped[0] + 1, records  # two in a row were skipped ...
    assert [r["skipped_steps"] for r in records] == [0] * (skipped[0] - 1) + [1, 2]
    stop = skipped[-1] + 1  # ... and the third stopped the run
    assert f"apiary: step {stop}: " in p.stderr and "training.max_skips=2" in p.stderr
    assert "2 skipped in all" in p.stderr
    # a skipped step changes nothing: the skipped steps' checkpoints hold the state before them
    ck = workdir / "run" / "checkpoint"
    before, after = (tmp_path / "a.pt"), (tmp_path / "b.pt")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ck / f"step-{skipped[0] - 1}"), str(before))
    dcp_to_torch_save(str(ck / f"step-{skipped[1]}"), str(after))
    a, b = torch.load(before, weights_only=False), torch.load(after, weights_only=False)
    weights = [k for k, v in a.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert weights and all(torch.equal(a[k], b[k]) for k in weights)
    assert a["lr_scheduler"] == b["lr_scheduler"]  # the schedule counts applied updates only
    assert b["train_state"]["step"] == skipped[1]  # while the step (and the data) moved on


def test_bad_setting_exits_2_before_anything_starts(workdir):
    p = run_cli(["train", "training.on_nonfinite=ignore"], cwd=workdir)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "training.on_nonfinite=ignore: must be stop or skip" in p.stderr and "Traceback" not in p.stderr
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("arg, says", [("training.max_skips=-1", "must be >= 0"),
                                       ("checkpoint.load_step=3", "this run does not resume")])
def test_bad_settings_are_refused(workdir, arg, says):
    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve("debug_moe", [arg])
    assert f"{arg}: " in str(e.value) and says in str(e.value)


def test_no_checkpoint_from_a_non_finite_state():
    """The save-time backstop: a NaN in the model or the optimizer state refuses the save (exit 76)."""
    from framework.train.integrity import NonFiniteStop
    from framework.train.trainer import ApiaryTrainer

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    fake = SimpleNamespace(model_parts=[model], optimizers=SimpleNamespace(optimizers=[opt]), device="cpu", step=7,
                           config=SimpleNamespace(dump_folder="nowhere", checkpoint=SimpleNamespace(folder="ck"),
                                                  resume_hint=""), _nonfinite=set())
    fake._agree = lambda flags: ApiaryTrainer._agree(fake, flags)
    ApiaryTrainer._check_state_finite(fake)  # finite: passes
    opt.state[model.weight]["exp_avg"][0, 0] = float("inf")
    with pytest.raises(NonFiniteStop) as e:
        ApiaryTrainer._check_state_finite(fake)
    assert e.value.code == 76 and "step 7" in e.value.message and "not written" in e.value.message
    opt.state[model.weight]["exp_avg"][0, 0] = 0.0
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(NonFiniteStop):
        ApiaryTrainer._check_state_finite(fake)


def test_two_ranks_stop_together_at_the_same_step(workdir, tmp_path):
    """2 gloo ranks: the decision is all-reduced, so both stop before step 3's update (no hang) and
    every shard of every checkpoint left is finite and matches its manifest."""
    from framework.train import integrity

    p = run_cli(["train", *SMALL, "optimizer.lr=1e6", "training.steps=5", "checkpoint.interval=1", "nproc=2",
                 "output_dir=run"], cwd=workdir)
    out = p.stdout + p.stderr
    assert p.returncode == 76, out[-3000:]  # the supervising train parent exits with the ranks' 76
    assert out.count("apiary: step 3: the gradient norm is not finite") == 1  # rank 0 says it once
    ck = workdir / "run" / "checkpoint"
    assert sorted(d.name for d in ck.glob("step-*")) == ["step-1", "step-2"]
    for d in ck.glob("step-*"):
        assert len(list(d.glob("*.distcp"))) == 2 and integrity.verify(d) is None
        assert _all_finite(d, tmp_path) > 10
