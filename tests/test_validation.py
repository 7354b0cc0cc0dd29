"""Validation loss on held-out text (validation.*; framework/train/validation.py, components/data/formats.py):
the loss equals training's forward on the same batch, a pass leaves the model and the training
stream untouched, held-out documents are never trained on, and every bad setting is refused."""

from __future__ import annotations

import json

import pytest

from framework.errors import UserError
from framework.resolve.resolver import resolve
from tests.conftest import read_metrics, train_here

SMALL = ["recipe=debug_moe", "training.local_batch=2", "training.seq_len=128", "checkpoint.enable=false"]


def _docs(path, n, seed=0):
    import random

    rng = random.Random(seed)
    words = ["bee", "hive", "honey", "wax", "comb", "queen", "drone", "nectar", "pollen", "swarm"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(rng.choice(words) for _ in range(60))}) + "\n")
    return path


def test_val_loss_equals_the_training_forward_on_the_same_batch(tmp_path, capsys):
    """lr=0 and the training file as the validation file: every pass sees the first training batch
    with the step-1 weights, so each val_loss is the step-1 training loss. A dense model: an MoE's
    routing bias (moe.load_balance_coeff) moves after each step even at lr=0."""
    data = _docs(tmp_path / "d.jsonl", 40)
    run = tmp_path / "run"
    p = train_here(["train", *SMALL[1:], "recipe=debug_dense", "training.steps=4", "optimizer.lr=0", f"data.path={data}",
                    f"output_dir={run}", "validation.interval=2", f"validation.path={data}", "logging.tensorboard=false"],
                   tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "validation: local text" in p.stdout and "at step 1, every 2 steps and at the last" in p.stdout
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # one record per step, validation merged into it
    vals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    assert sorted(vals) == [1, 2, 4]
    for v in vals.values():
        assert v == pytest.approx(recs[0]["loss"], rel=1e-6)
    assert len({round(r["loss"], 6) for r in recs}) > 1  # the training batches do differ


def test_validation_runs_at_step_1_every_interval_and_at_the_last_step():
    """The schedule the run's first lines announce, with last steps on and off the interval (the
    training above ends on one)."""
    from types import SimpleNamespace

    from framework.train.validation import validator_config

    for interval, last, expected in ((2, 5, [1, 2, 4, 5]), (3, 6, [1, 3, 6]), (10, 4, [1, 4]), (1, 3, [1, 2, 3])):
        cfg = validator_config(None, interval, 1, last)
        validator = SimpleNamespace(config=cfg)
        steps = [s for s in range(1, last + 1) if type(cfg)._owner.should_validate(validator, s)]
        assert steps == expected, (interval, last)


def test_a_validation_pass_changes_neither_the_model_nor_the_training_stream(tmp_path, capsys, one_thread):
    """Paired runs from one seed, validating at every step vs not at all: the same losses and grad
    norms bit for bit (a pass that updated weights, advanced the training data or the generators
    would show here); the held-out loss falls as the model trains; TensorBoard gets it too."""
    a, b = tmp_path / "with", tmp_path / "without"
    # both runs in this process, one thread each (the same arithmetic)
    p = train_here(["train", *SMALL, "training.steps=5", f"output_dir={a}", "validation.interval=1",
                    "validation.fraction=0.05", "validation.steps=2"], tmp_path, capsys)
    pb = train_here(["train", *SMALL, "training.steps=5", f"output_dir={b}", "logging.tensorboard=false"], tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "validation: the last 24 of 470 documents" in p.stdout
    assert pb.returncode == 0, pb.stderr[-3000:]
    ra, rb = read_metrics(a), read_metrics(b)
    assert [(r["loss"], r["grad_norm"]) for r in ra] == [(r["loss"], r["grad_norm"]) for r in rb]
    vals = [r["val_loss"] for r in ra]
    assert len(vals) == 5 and vals[-1] < vals[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [EventAccumulator(str(f.parent)).Reload() for f in (a / "tb").rglob("events.*")]
    tb = [ev.Scalars("validation_metrics/loss") for ev in events if "validation_metrics/loss" in ev.Tags()["scalars"]]
    assert tb and [s.value for s in tb[0]] == pytest.approx(vals, rel=1e-6)


def test_the_held_out_documents_are_the_last_and_never_trained_on(tmp_path):
    from components.data import text

    data = _docs(tmp_path / "d.jsonl", 21)
    train = text._load_part(str(data), "train", 0.1)
    held = text._load_part(str(data), "validation", 0.1)
    assert len(held) == 3 and len(train) == 18  # ceil(21 * 0.1)
    assert [r["text"] for r in train] + [r["text"] for r in held] == [
        json.loads(x)["text"] for x in data.read_text().splitlines()]


@pytest.mark.parametrize("extra,message", [
    (["validation.interval=5"], "needs held-out text"),
    (["validation.fraction=0.1"], "validation.interval is 0, so no validation would run"),
    (["validation.interval=5", "validation.fraction=0.6"], "must be in (0, 0.5]"),
    (["validation.interval=5", "validation.steps=0"], "validation.steps >= 1"),
    (["validation.interval=-1"], "validation.interval must be >= 0"),
    (["validation.interval=5", "validation.fraction=0.1", "validation.path=x.jsonl"], "both name the held-out text"),
    (["validation.interval=5", "validation.path=missing.jsonl"], "validation.path=missing.jsonl"),
    (["validation.interval=5", "validation.fraction=0.5", "data.path={tiny}"], "leaving none to train on"),
    (["validation.interval=5", "validation.fraction=0.1", "data.name=allenai/c4"], "streamed from the hub"),
    (["recipe=debug_grpo", "validation.interval=5", "validation.fraction=0.1"], "trains a policy on rollouts"),
])
def test_bad_validation_settings_are_refused_before_launch(tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "only one document"}) + "\n")
    extra = [e.replace("{tiny}", str(tiny)) for e in extra]
    recipe = next((e.split("=", 1)[1] for e in extra if e.startswith("recipe=")), "debug_moe")
    with pytest.raises(UserError) as e:
        resolve(recipe, [x for x in extra if not x.startswith("recipe=")] + [f"output_dir={tmp_path}/r"])
    assert message in " ".join(str(e.value).split())
