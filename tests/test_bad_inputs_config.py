"""Bad input, second pass (docs/reliability.md, "Bad input, second pass"): recipe files that are not
recipes, values outside their range or set, interpolations that do not resolve, a comma list without
-m, characters outside ASCII, and the wording of a few refusals. Each exits 2 with one paragraph
naming the key or the file, before any worker starts, and writes nothing.

The refusals run in process through ``train_main`` (the console entry's function); `apiary ls` and
`apiary show` run through the real console entry (a fresh interpreter, no torch: about a second).
"""

import json
import time

import pytest

from conftest import run_cli

ROOT_RECIPE = "defaults:\n  - debug_moe\n  - _self_\n"


def _refused(code, err, workdir, *needles):
    err = " ".join(err.split())
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err, err
    assert "error apiary:" in err, err
    err = err[err.index("error apiary:"):]
    assert err.count("error apiary:") == 1, err  # one paragraph
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()  # nothing started, nothing written
    assert not (workdir / "out").exists()


@pytest.fixture
def files(workdir):
    (workdir / "binary.yaml").write_bytes(bytes([0x89, 0xCB, 0x00, 0xFF, 0x10]) * 40)
    (workdir / "dup.yaml").write_text(ROOT_RECIPE + "training:\n  steps: 3\n  steps: 4\n")
    (workdir / "empty.yaml").write_text("")
    (workdir / "nodefaults.yaml").write_text("model:\n  family: qwen3\n  flavor: tiny_moe\ntraining:\n  steps: 3\n")
    (workdir / "selfonly.yaml").write_text("defaults:\n  - _self_\nmodel:\n  family: qwen3\n")
    (workdir / "typo.yaml").write_text(ROOT_RECIPE + "training:\n  stpes: 3\n")
    (workdir / "données.jsonl").write_text("".join(json.dumps({"text": "zebra quartz " * 30}) + "\n" for _ in range(4)))
    return workdir


@pytest.mark.parametrize("argv,needles", [
    # 1. recipe files
    (["recipe=binary.yaml"], ["binary.yaml: is not a text file", "byte 0x89 at offset 0", "apiary cp debug_moe"]),
    (["recipe=dup.yaml"], ["dup.yaml:6:3: sets 'steps' a second time", "first at line 5", "Keep one of them"]),
    (["recipe=empty.yaml"], ["empty.yaml: is empty", "defaults: [_defaults, _self_]"]),
    (["recipe=nodefaults.yaml"], ["nodefaults.yaml: has no `defaults:` list", "does not set 'loss' itself",
                                  "defaults: [_defaults, _self_]"]),
    (["recipe=nodefaults.yaml", "training.seq_len=64"], ["nodefaults.yaml: has no `defaults:` list"]),  # not the override
    (["recipe=nodefaults.yaml", "loss=chunked"], ["nodefaults.yaml: has no `defaults:` list",
                                                  "no component groups for loss=chunked"]),
    (["recipe=selfonly.yaml"], ["selfonly.yaml: has a `defaults:` list that reaches neither _defaults nor a recipe"]),
    (["recipe=typo.yaml"], ["typo.yaml: sets 'training.stpes', a key apiary does not have",
                            "Did you mean 'training.steps'"]),
    # 2. attention backend
    (["model.attn_backend=flash"], ["model.attn_backend=flash is not an attention backend", "flex (", "flex_flash (",
                                    "varlen ("]),
    (["recipe=qwen35_debug_moe", "model.attn_backend=sdpa"], ["model.family=qwen3_5", "model.attn_backend=sdpa"]),
    # 3. parallel degrees
    (["parallel.dp_replicate=0"], ["parallel.dp_replicate=0: must be >= 1"]),
    (["parallel.dp_replicate=-1"], ["parallel.dp_replicate=-1: must be >= 1"]),
    (["parallel.pp=0"], ["parallel.pp=0: must be >= 1", "or null to derive it"]),
    (["parallel.cp=-2"], ["parallel.cp=-2: must be >= 1"]),
    (["parallel.tp=-1"], ["parallel.tp=-1: must be >= 1"]),
    (["parallel.pp_microbatch_size=0"], ["parallel.pp_microbatch_size=0: must be >= 1"]),
    # 4. seeds torch.manual_seed refuses, and non-integers
    (["training.seed=100000000000000000000"], ["training.seed=100000000000000000000", "-2**63 to 2**64-1"]),
    (["training.seed=-9223372036854775809"], ["training.seed=-9223372036854775809", "-2**63 to 2**64-1"]),
    (["training.seed=1e20"], ["training.seed: takes an integer, not '1e20'"]),
    (["training.seed=1.5"], ["training.seed: takes an integer, not '1.5'"]),
    # 5. an interpolation that does not resolve
    (["training.steps=${nope}"], ["training.steps=${nope}: the interpolation does not resolve",
                                  "Interpolation key 'nope' not found"]),
    (["training.steps=${training.seq_lne}"], ["Did you mean 'training.seq_len'"]),
    # 6. CP load balancer and PP schedule: unknown values refused whatever cp / pp
    (["parallel.cp_load_balancer=foo"], ["parallel.cp_load_balancer=foo: unknown; valid: headtail, ptrr, none"]),
    (["parallel.cp_load_balancer=foo", "parallel.cp=2"], ["parallel.cp_load_balancer=foo"]),
    (["parallel.pp_schedule=foo"], ["parallel.pp_schedule=foo: unknown pipeline schedule", "1F1B, Interleaved1F1B"]),
    (["parallel.pp_schedule=foo", "parallel.pp=2"], ["parallel.pp_schedule=foo", "DualPipeV"]),
    # 7. a warm-up as long as the schedule
    (["lr.warmup_steps=1000", "training.steps=3"], ["lr.warmup_steps=1000: is not shorter than the learning-rate "
                                                    "schedule (training.steps=3)", "lr.total_steps=N"]),
    (["lr.warmup_steps=5", "lr.total_steps=5", "training.steps=3"], ["(lr.total_steps=5)"]),
    # 8. output_dir= (empty)
    (["output_dir="], ["output_dir=: is empty, which names the current folder"]),
    # 9. characters outside ASCII: the hint to quote
    (["data.path=données.jsonl"], ["cannot parse the override data.path=données.jsonl", "outside ASCII",
                                   "'data.path=\"données.jsonl\"'"]),
    (["-m", "data.path=données.jsonl"], ["train -m: cannot parse the override", "'data.path=\"données.jsonl\"'"]),
    # 12. wording
    (["data.num_workers=-1"], ["data.num_workers=-1: must be >= 0"]),
    (["output_dir=/dev/null"], ["output_dir=/dev/null: is a character device, not a folder"]),
    (["output_dir=/dev/null", "checkpoint.resume=true"], ["output_dir=/dev/null: is a character device, not a folder",
                                                          "holds no run to resume"]),
    (["output_dir=/dev/null/run"], ["/dev/null is a character device, not a folder"]),
    (["training.steps=1,2"], ["override training.steps=1,2: gives training.steps several values",
                              "Sweep with -m (train -m training.steps=1,2)", "quote it"]),
    (["loss=ce,chunked"], ["override loss=ce,chunked: gives loss several values", "train -m loss=ce,chunked"]),
])
def test_bad_input_is_refused_before_launch(files, capsys, argv, needles):
    from framework.cli import train_main

    code = train_main(argv)
    _refused(code, capsys.readouterr().err, files, *needles)


def test_flex_flash_and_varlen_need_a_gpu_before_launch(workdir, capsys):
    """torchtitan refuses flex_flash without a Hopper GPU in the worker, after the run folder is written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the machine has a CUDA GPU")
    from framework.cli import train_main

    for backend in ("flex_flash", "varlen"):
        code = train_main([f"model.attn_backend={backend}", "output_dir=out"])
        _refused(code, capsys.readouterr().err, workdir, f"model.attn_backend={backend}: needs a",
                 "no CUDA GPU", "model.attn_backend=flex")
    assert train_main(["model.attn_backend=varlen", "--cfg", "job"]) == 0  # print-only: no device needed


def test_valid_values_that_do_not_take_effect_are_kept(workdir, capsys):
    """A valid schedule with pp=1, a valid balancer with cp=1: accepted (a later pp/cp run reads them);
    torch's case-insensitive schedule names too."""
    from framework.cli import train_main

    argv = ["parallel.pp_schedule=gpipe", "parallel.cp_load_balancer=ptrr", "training.seed=-1", "--cfg", "job"]
    assert train_main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "pp_schedule: gpipe" in out and "cp_load_balancer: ptrr" in out


def test_pp_schedules_are_torchs():
    """apiary's list is torch's get_schedule_class names, less its two base classes (CSV schedules)."""
    import re

    from torch.distributed.pipelining.schedules import get_schedule_class

    from framework.resolve.values import PP_SCHEDULES

    for name in PP_SCHEDULES:
        get_schedule_class(name)
    with pytest.raises(ValueError) as e:
        get_schedule_class("nope")
    torch_names = set(re.findall(r"'(\w+)'", str(e.value).split("valid options are", 1)[1]))
    assert torch_names - {"PipelineScheduleSingle", "PipelineScheduleMulti"} == set(PP_SCHEDULES)


def test_a_schedule_cut_short_on_the_command_line_shortens_the_warmup_and_says_so(workdir):
    """training.steps=1 with the default warm-up of 2 (a smoke test), and the resume command a
    finished run prints (lr.total_steps): the warm-up is shortened and the run's first lines say so."""
    from framework.resolve.resolver import resolve

    r = resolve(None, ["training.steps=1", "output_dir=out"])
    assert "lr: warm-up shortened to 0 steps (lr.warmup_steps=2 is not shorter than training.steps=1" \
        in r.data_summary
    r = resolve(None, ["training.steps=2", "lr.total_steps=2", "output_dir=out"])
    assert "warm-up shortened to 1 step (lr.warmup_steps=2 is not shorter than lr.total_steps=2" in r.data_summary
    r = resolve(None, ["training.steps=3", "output_dir=out"])
    assert "warm-up" not in r.data_summary
    assert not (workdir / "out").exists()


def test_quoted_non_ascii_path_and_good_interpolations_resolve(files):
    """The quoting the hint suggests works; an interpolation to an existing key still resolves."""
    from framework.resolve.resolver import resolve

    path = files / "données.jsonl"
    r = resolve(None, [f'data.path="{path}"', "training.steps=${training.local_batch}", "output_dir=out"])
    assert r.cfg.data.path == str(path) and r.cfg.training.steps == r.cfg.training.local_batch
    assert f"data: local text {path}: 4 documents" in r.data_summary


def test_a_complete_config_without_defaults_still_runs_as_a_recipe(workdir, capsys):
    """A file that sets every required key (a run's config.yaml) stands alone without `defaults:`."""
    from omegaconf import OmegaConf

    from framework.cli import train_main
    from framework.compose.recipes import load

    (workdir / "complete.yaml").write_text(OmegaConf.to_yaml(load("debug_moe", ["training.steps=7"])))
    assert train_main(["recipe=complete.yaml", "--cfg", "job"]) == 0, capsys.readouterr().err
    assert "steps: 7" in capsys.readouterr().out


def test_cfg_job_with_a_very_deep_model_is_fast(workdir, capsys):
    """model.n_layers=100000: the model's facts are counted, not built (was: over 120 s, a meta-device
    build of every layer)."""
    from framework.cli import train_main

    start = time.monotonic()
    assert train_main(["model.n_layers=100000", "--cfg", "job"]) == 0, capsys.readouterr().err
    assert time.monotonic() - start < 15
    assert "n_layers: 100000" in capsys.readouterr().out


def test_apiary_ls_with_a_missing_registry_prints_the_error_and_no_table(workdir):
    p = run_cli(["apiary", "ls"], cwd=workdir, timeout=120, env={"APIARY_REGISTRY": "missing.yaml"})
    assert p.returncode == 2, p.stderr
    assert p.stdout == "", p.stdout  # no table before the error
    assert "APIARY_REGISTRY=missing.yaml: no user registry file" in " ".join(p.stderr.split())
    assert "Traceback" not in p.stderr


def test_apiary_show_suggests_each_name_once(workdir):
    p = run_cli(["apiary", "show", "nope"], cwd=workdir, timeout=120)
    err = " ".join(p.stderr.split())
    assert p.returncode == 2 and "Did you mean 'none'?" in err, err
