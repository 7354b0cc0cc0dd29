"""Resolve once: `train nproc=2` composes and resolves the recipe in the launching process only; its
ranks load output_dir/resolved.yaml (framework.resolve.handoff.load_resolved). The preflight's suggestions and
`apiary plan` do not compose or resolve again (framework.plan.planner.search, resolve.check_candidate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework import contracts
from framework.compose import recipes
from framework.errors import UserError

from conftest import ROOT, _child_env, read_metrics

# A test-only hook: sitecustomize (imported by every interpreter of the run: the parent, torchrun,
# each rank) wraps recipes.load and resolve.resolve to append a line per call to APIARY_TEST_COUNT.
HOOK = '''
import os
path = os.environ.get("APIARY_TEST_COUNT")
if path:
    import framework.compose.recipes as _recipes
    import framework.resolve.resolver as _resolve

    def _wrap(mod, name, tag):
        f = getattr(mod, name)

        def counted(*a, **k):
            with open(path, "a") as fh:
                fh.write(f"{tag} pid={os.getpid()} rank={os.environ.get('RANK', '-')}\\n")
            return f(*a, **k)
        setattr(mod, name, counted)

    _wrap(_recipes, "load", "compose")
    _wrap(_resolve, "resolve", "resolve")
'''

SMALL = ["recipe=debug_moe", "training.steps=2", "checkpoint.enable=false", "logging.tensorboard=false"]


def _counted_run(argv, cwd: Path, tmp_path: Path):
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    count = tmp_path / "count.txt"
    env = _child_env({"APIARY_TEST_COUNT": str(count), "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{ROOT}"
    p = subprocess.run([sys.executable, "-m", "framework.cli", *argv], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    lines = count.read_text().splitlines() if count.is_file() else []
    return p, lines


def test_train_nproc2_composes_and_resolves_once(workdir, tmp_path):
    p, lines = _counted_run([*SMALL, "nproc=2", "output_dir=run"], workdir, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(ln.split()[0] for ln in lines) == ["compose", "resolve"], lines
    assert all("rank=-" in ln for ln in lines), lines  # the launching process, not a rank
    assert len(read_metrics(workdir / "run")) == 2
    assert (workdir / "run" / "resolved.yaml").is_file()


def test_own_torchrun_still_resolves_in_each_rank(workdir, tmp_path):
    """A rank no apiary process started (the user's own torchrun): no hand-off, it resolves itself."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    count = tmp_path / "count.txt"
    env = _child_env({"APIARY_TEST_COUNT": str(count), "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{ROOT}"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "framework.cli", "train", *SMALL, "output_dir=run"], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = count.read_text().splitlines()
    assert sorted(ln.split()[0] for ln in lines) == ["compose", "compose", "resolve", "resolve"], lines
    assert len(read_metrics(workdir / "run")) == 2


# ----------------------------------------------------------------------------- the hand-off file


def _parent(workdir, extra=()):
    from framework.resolve.handoff import write_resolved
    from framework.resolve.resolver import resolve

    argv = [*SMALL, "launcher.nproc=2", "output_dir=run", *extra]
    r = resolve("debug_moe", argv[1:])
    return r, argv, write_resolved(r, argv)


def test_a_rank_rebuilds_what_the_parent_resolved(workdir, monkeypatch):
    from omegaconf import OmegaConf

    from framework.resolve import handoff as res
    from framework.resolve.handoff import write_resolved
    from framework.resolve.resolver import resolve

    argv = [*SMALL, "launcher.nproc=2", "output_dir=run"]
    r = resolve("debug_moe", argv[1:])
    # what resolve chose for a budget-planned component, and what a check leaves for an apply
    r.ctx.derived["recompute"] = {"blocks": {"moe": {"full": 2}}, "reason": "a test's"}
    r.ctx.shared.adapter_base, r.ctx.shared.text_source = {"kind": "dcp", "sha256": "ab"}, object()
    env = write_resolved(r, argv)
    calls = []
    monkeypatch.setattr(recipes, "load", lambda *a, **k: calls.append(a))
    w = res.load_resolved(argv, env=env)
    assert calls == []  # nothing composed
    assert OmegaConf.to_container(w.cfg) == OmegaConf.to_container(r.cfg)
    assert w.layout == r.layout and w.grad_accum == r.grad_accum and w.facts == r.facts
    assert w.data_summary == r.data_summary and w.resume_lines == r.resume_lines
    assert w.ctx.derived == r.ctx.derived
    # plain data; objects serve checks only
    assert w.ctx.shared.plain() == {**contracts.Shared().plain(), "adapter_base": {"kind": "dcp", "sha256": "ab"}}
    assert w.ctx.options == r.ctx.options and w.ctx.layout == r.layout


@pytest.mark.parametrize("case", ["tampered", "missing", "other_argv"])
def test_a_tampered_or_missing_resolved_file_is_refused(workdir, case):
    from framework.resolve.handoff import load_resolved

    r, argv, env = _parent(workdir)
    path = Path(env["APIARY_RESOLVED"])
    if case == "tampered":
        path.write_text(path.read_text().replace("steps: 2", "steps: 3", 1))
        want = "was changed after the launching process wrote it"
    elif case == "missing":
        path.unlink()
        want = "cannot be read"
    else:
        argv = [*argv, "training.seed=3"]
        want = "was written for `train recipe=debug_moe"
    with pytest.raises(UserError) as e:
        load_resolved(argv, env=env)
    msg = str(e.value)
    assert e.value.exit_code == 2 and want in msg and "\n" not in msg.strip(), msg
    assert "Launch the run again" in msg


def test_a_rank_with_a_changed_file_exits_2_in_one_paragraph(workdir):
    """End to end: a rank (as torchrun starts it) whose hand-off file was edited exits 2, no traceback."""
    r, argv, env = _parent(workdir)
    path = Path(env["APIARY_RESOLVED"])
    path.write_text(path.read_text() + "\n# edited\n")
    rank = {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}
    p = subprocess.run([sys.executable, "-m", "framework.cli", "train", *argv], cwd=workdir,
                       env={**_child_env(), **rank}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    err = " ".join(p.stderr.split())
    assert "error apiary: APIARY_RESOLVED=" in err and "was changed after" in err and "Traceback" not in err, err
    assert not (workdir / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- preflight and plan

QWEN = ["model.n_layers=4", "training.seq_len=32768", "parallel.cp=1", "parallel.ep=1", "parallel.dp_shard=1",
        "loss=ce", "recompute=full", "launcher.nproc=1", "data.name=packaged", "data.tokenizer=byte"]
B = ["model.n_layers=4", "loss=ce", "data.name=packaged", "data.tokenizer=byte", "recompute=none"]
GiB = 2**30


def _count_compose(monkeypatch) -> list:
    calls, load = [], recipes.load
    monkeypatch.setattr(recipes, "load", lambda *a, **k: calls.append(a) or load(*a, **k))
    return calls


# What the preflight suggested when it checked each candidate with a full resolve (before this change):
# the same strings, computed now from the planner with the candidate's values. Recomputed on purpose
# (2026-11-27) when the suggestions' band became what the preflight passes silently (7% under the GPU's
# memory, was: the estimate plus 10%) and a kept attention block's saves the measured ones
# (saved_activation_factor 1.85, was 0.2); again when kept blocks went last in the stage and count what
# they add to its peak (recompute none and auto plan less), auto gained FFN-only reruns, and selective
# was planned at full recompute's time (selective_recompute_fraction 1.0, measured); again (2026-11-28)
# when the reserve followed expandable segments (fragmentation 0, framework/alloc_conf.py) and the MoE
# combine without fp32 copies (components/moe/lean_combine.py) got its own fitted constants; again
# (2026-11-29) when the activation terms at cp > 1 gained cp_activation_overhead (the two CP rows' GiB)
# and the step time was refit (tok/s; attention over the packaged corpus's documents).
@pytest.mark.parametrize("overrides,gpus,gpu,mem,expected", [
    (QWEN, None, "H200", 140, ["loss=linear_ce (89.5 GiB, 49,563 tok/s/GPU est.)",
                               "loss=chunked (94.9 GiB, 44,004 tok/s/GPU est.)",
                               "loss=linear_ce recompute=none (112.4 GiB, 58,603 tok/s/GPU est.)"]),
    ([*B, "training.seq_len=65536", "state=zero1"], 4, "H100", 80,
     ["loss=linear_ce (68.2 GiB, 53,409 tok/s/GPU est.)",
      "loss=chunked (73.6 GiB, 47,010 tok/s/GPU est.)",
      "parallel.ep=2 loss=linear_ce (72.7 GiB, 55,929 tok/s/GPU est.)"]),
    ([*B, "training.seq_len=262144", "parallel.cp=8"], 8, "H100", 80,
     ["loss=linear_ce (58.3 GiB, 53,467 tok/s/GPU est.)", "loss=chunked (63.7 GiB, 47,055 tok/s/GPU est.)",
      "parallel.ep=2 loss=linear_ce (58.8 GiB, 57,961 tok/s/GPU est.)"]),
])
def test_preflight_suggestions_are_the_same_without_resolving_again(workdir, monkeypatch, overrides, gpus, gpu, mem,
                                                                    expected):
    from framework.plan import preflight
    from framework.resolve.resolver import check_candidate, resolve

    r = resolve("qwen35_35b_128k", [*overrides, "preflight.memory=off", "output_dir=run"], world_size=gpus)
    calls = _count_compose(monkeypatch)
    checked = []

    def check(*a):
        checked.append(a)
        return check_candidate(*a)

    assert preflight.cheapest_fits(r, overrides, gpu, mem * GiB, check) == expected
    assert calls == [] and len(checked) >= len(expected)  # every suggestion checked, nothing composed


def test_a_local_batch_that_fits_is_the_same_without_resolving_again(workdir, monkeypatch):
    from framework.plan import preflight
    from framework.resolve.resolver import check_candidate, resolve

    r = resolve(None, ["training.local_batch=100000"], for_training=False)
    calls = _count_compose(monkeypatch)
    got = [preflight._batch_that_fits(r, check_candidate, avail * GiB) for avail in (8, 3, 1)]
    assert got == ["training.local_batch=1562 (5.6 GiB)", "training.local_batch=390 (2.1 GiB)",
                   "training.local_batch=1 (0.9 GiB)"]
    assert calls == []


def test_a_candidate_a_component_refuses_is_not_suggested(workdir):
    """check_candidate runs the components' checks: ce_zloss refuses TP, so no row with tp=2 and ce_zloss."""
    from framework.resolve.resolver import check_candidate, resolve

    r = resolve(None, ["loss=ce_zloss", "launcher.nproc=2"], for_training=False)
    check_candidate(r, {"ep": 1, "cp": 1, "pp": 1, "tp": 1}, {"loss": "ce_zloss"}, 2)
    with pytest.raises(UserError, match="loss=ce_zloss"):
        check_candidate(r, {"ep": 1, "cp": 1, "pp": 1, "tp": 2}, {"loss": "ce_zloss"}, 2)


@pytest.mark.parametrize("args", [["gpus=32"], ["--search", "--top", "5"]])
def test_apiary_plan_composes_once(workdir, monkeypatch, capsys, args):
    from toolkit.plan import plan_main

    calls = _count_compose(monkeypatch)
    assert plan_main(["recipe=qwen35_35b_128k", *args]) == 0, capsys.readouterr().err
    assert len(calls) == 1, calls
    assert "32" in capsys.readouterr().out  # the recipe's parallel.gpus, read from the one composition


def test_apiary_launch_composes_once(workdir, monkeypatch, capsys):
    """`apiary launch ... launcher=slurm --dry-run`: the launcher's options are checked and its ranks
    counted on the one composition resolve makes."""
    from toolkit.launch import launch_main

    calls = _count_compose(monkeypatch)
    code = launch_main(["recipe=debug_moe", "launcher=slurm", "nodes=2", "gpus_per_node=4",
                        f"output_dir={workdir / 'launch'}", "--dry-run"])
    assert code == 0, capsys.readouterr().err
    assert len(calls) == 1, calls
    cap = capsys.readouterr()
    assert "8 ranks" in cap.out + cap.err


def test_apiary_launch_still_refuses_bad_launcher_options(workdir, monkeypatch, capsys):
    from toolkit.launch import launch_main

    code = launch_main(["recipe=debug_moe", "launcher=slurm", "nodes=0", "--dry-run"])
    assert code == 2
    assert "launcher.nodes" in capsys.readouterr().err
