"""Newcomer pass 11 and what pass 10 left: `train --cfg job` refuses the data source a launch would refuse."""

import pytest

from conftest import train_here


@pytest.mark.parametrize("argv, said", [
    (["data.name=local"], "data.name=local: needs data.path"),
    (["data.path=corpus.jsonl", "data.name=org/set"], "both name a source of text"),
    (["recipe=debug_grpo", "data.name=org/set"], "data.format=rollouts: needs data.path (data.name=org/set"),
])
def test_cfg_job_refuses_a_data_source_a_launch_refuses(workdir, capsys, argv, said):
    """Was: `train data.name=local --cfg job` printed the config and exited 0, and the launch then refused it."""
    r = train_here(["train", *argv, "--cfg", "job"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and said in err, r.stdout[-500:] + err
    assert "data:" not in r.stdout  # no config printed


@pytest.mark.parametrize("section, key", [("validation:\n  steps: 3\n", "validation.steps=3"),
                                          ("data:\n  path: rollouts.jsonl\n  name: org/set\n", "data.name=org/set")])
def test_a_recipe_files_key_the_rollout_format_does_not_read_is_refused(workdir, capsys, section, key):
    """Pass 10 left: the rollouts format's ignored keys were refused on the command line only; set in a recipe file of
    the user's they were composed and ignored (exit 0)."""
    (workdir / "rollouts.jsonl").write_text("")
    (workdir / "mine.yaml").write_text(f"defaults:\n  - debug_grpo\n  - _self_\n{section}")
    r = train_here(["train", "recipe=mine.yaml", "--cfg", "job"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout[-800:] + err
    assert f"{key} (set in recipe file" in err and "mine.yaml" in err and "does not read" in err, err


def test_cfg_job_refuses_autotune_configs_on_a_cpu_run(workdir, capsys, monkeypatch):
    """Pass 10 left: `train training.autotune_configs=all --cfg job` printed the config (exit 0); its launch on this
    CPU machine refuses it (Triton does not autotune there)."""
    from framework.plan import preflight

    monkeypatch.setattr(preflight, "_local_gpu", lambda: (None, None))  # this machine: no GPU
    r = train_here(["train", "training.autotune_configs=all", "--cfg", "job"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "training.autotune_configs=all: chooses the configs Triton autotunes" in err, err
    ok = train_here(["train", "training.autotune_configs=all", "preflight.gpu=H100", "--cfg", "job"], workdir, capsys)
    assert ok.returncode == 0, ok.stderr[-800:]  # a GPU named: the run is not this CPU's


@pytest.mark.parametrize("extra, said", [(["moe.load_balance_coeff=0.001"], True), ([], False),
                                         (["moe.load_balance_coeff=0.001", "publish.transport=hf_folder"], False)])
def test_an_in_memory_transport_says_the_routing_bias_stays_behind(extra, said):
    """Pass 7 left: a folder's writer warns that the trained routing bias is not in the HF format; an in-memory
    transport hands the engine the same weights without it and said nothing. Now the run's first lines say so."""
    from framework.resolve.resolver import resolve

    r = resolve("debug_grpo_vllm", extra, for_training=False)
    lines = [line for line in r.data_summary.splitlines() if "routing bias" in line]
    assert bool(lines) is said, r.data_summary
    if said:
        assert "vllm_ipc hands the engine the weights without it" in lines[0] and "moe.load_balance_coeff=null" in lines[0]
