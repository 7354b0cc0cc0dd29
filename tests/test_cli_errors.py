"""Every user error of the foundation stops before a worker starts: exit code 2, one paragraph."""

import pytest

from framework.cli import train_main
from toolkit.cli import apiary_main

from conftest import run_cli


def _err(capsys, argv):
    code = train_main(argv)
    err = capsys.readouterr().err
    return code, " ".join(err.split())


@pytest.mark.parametrize("argv,needles", [
    (["recipe=debug_mo"], ["unknown recipe 'debug_mo'", "Did you mean 'debug_moe'"]),
    (["training.stpes=5"], ["unknown key 'training.stpes'", "training.steps"]),
    (["loss.num_chunks=4"], ["unknown key 'loss.num_chunks'", "an option of loss=chunked: write loss=chunked "
                                                             "loss.num_chunks=4"]),
    (["loss=linear_cee"], ["unknown loss 'linear_cee'", "registry.yaml lists"]),
    (["training.steps=abc"], ["training.steps: takes an integer, not 'abc' (for example training.steps=20)."]),
    (["parallel.ep=3"], ["EP 3 must divide dp_shard x cp x tp"]),
    (["parallel.dp_shard=2"], ["not the world size 1"]),
    (["nproc=2", "parallel.cp=2", "training.seq_len=254"], ["not divisible by 2 x cp = 4"]),
    (["nproc=4", "parallel.ep=3"], ["EP 3 must divide"]),
    (["data.path=/nonexistent/corpus.jsonl"], ["data.path=/nonexistent/corpus.jsonl", "no jsonl"]),
    (["model.flavor=tiny_moee"], ["unknown flavor", "tiny_moe"]),
    (["moe.comm=deepep"], ["moe.comm=deepep: the deep_ep package is not installed"]),
    (["moe.comm=alltoal"], ["unknown moe_comm 'alltoal'", "alltoall"]),
    (["state.offload=bogus"], ["state=fsdp2", "state.offload must be none|optimizer|all", "'bogus'"]),
    (["state=zero1", "state.offload=all"], ["state=zero1", "state.offload must be none|optimizer for zero1"]),
    (["state=zero1", "state.offload_threads=-1"], ["state.offload_threads must be >= 0"]),
    (["checkpoint.resume=true", "output_dir=nowhere"], ["holds no checkpoint"]),
    (["data.num_workers=2"], ["data.num_workers=2", "train on repeats", "data.num_workers=1"]),
    (["recipe=qwen35_35b_128k", "nproc=8"], ["data.tokenizer=./assets/hf/Qwen3.5-35B-A3B", "no tokenizer folder"]),
    (["moe.load_balance_coeff=-1"], ["moe.load_balance_coeff=-1", "must be > 0", "moe.load_balance_coeff=null"]),
    (["lr.total_steps=0"], ["lr.total_steps=0", "must be >= 1"]),
])
def test_user_errors(capsys, workdir, argv, needles):
    code, err = _err(capsys, argv)
    assert code == 2, err
    assert err.startswith("error apiary:")
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()  # nothing started, nothing written


@pytest.mark.parametrize("override,said", [
    ("training.steps=five", "training.steps: takes an integer, not 'five' (for example training.steps=20)."),
    ("training.steps=1e3", "training.steps: takes an integer, not '1e3' (for example training.steps=20)."),
    ("checkpoint.enable=maybe", "checkpoint.enable: takes true or false, not 'maybe' (for example checkpoint.enable=true)."),
    ("optimizer.lr=abc", "optimizer.lr: takes a number, not 'abc' (for example optimizer.lr=0.003)."),
    ("parallel.gpus=eight", "parallel.gpus: takes an integer, not 'eight'."),
    # newcomer pass 5's #46 (was: "Invalid value assigned: str is not a ListConfig, list or tuple")
    ("adapter=lora adapter.targets=q", "adapter.targets: takes a list, not 'q' (for example adapter.targets=[q,k,v,o])."),
])
def test_a_wrong_type_on_the_command_line_is_one_sentence(capsys, workdir, override, said):
    """`train training.steps=five` said the override twice, then OmegaConf's words and a generic hint
    ("overrides training.steps=five: training.steps=five: Value 'five' of type 'str' could not be converted to
    Integer. Check the value's type ..."): now one sentence naming the key, the value as typed and the type."""
    code, err = _err(capsys, [*override.split(), "--cfg", "job"])
    assert code == 2 and err == f"error apiary: {said}", err


def test_a_wrong_type_in_a_recipe_file_names_its_key(capsys, workdir):
    (workdir / "wtype.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\ntraining:\n  steps: five\n")
    code, err = _err(capsys, ["recipe=wtype.yaml", "--cfg", "job"])
    assert code == 2 and "does not compose: training.steps:" in err and "'five'" in err, err
    assert f"Check training.steps in {workdir / 'wtype.yaml'}" in err


def test_a_misspelt_group_choice_in_a_recipe_file_lists_every_name(capsys, workdir):
    """`override /loss: chunkd` in a recipe file (was: "Available options in 'loss': ce.", the list cut
    after its first name): every registered name and a did-you-mean, as `loss=chunkd` gets."""
    (workdir / "typo.yaml").write_text("defaults:\n  - _defaults\n  - override /loss: chunkd\n  - _self_\n")
    code, err = _err(capsys, ["recipe=typo.yaml", "--cfg", "job"])
    err = " ".join(err.split())
    assert code == 2 and "override /loss: chunkd" in err and str(workdir / "typo.yaml") in err, err
    assert "ce, chunked, linear_ce" in err and "Did you mean 'chunked'?" in err, err


def test_a_hydra_options_list_is_kept_whole():
    from hydra.errors import MissingConfigException

    from framework.compose.recipes import _first_line

    e = MissingConfigException("Could not find 'x/y'\n\nAvailable options in 'x':\n\ta\n\tb\n\tc\n\td")
    assert _first_line(e) == "Could not find 'x/y' Available options in 'x': a b c d"


def test_corrupt_checkpoint_is_refused_and_kept(capsys, workdir):
    step = workdir / "old" / "checkpoint" / "step-10"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"partial")
    code, err = _err(capsys, ["checkpoint.resume=true", "output_dir=old"])
    assert code == 2 and "incomplete or corrupt" in err
    code, err = _err(capsys, ["output_dir=old"])  # a fresh run must not overwrite it either
    assert code == 2 and "already holds checkpoints" in err
    assert (step / "__0_0.distcp").read_bytes() == b"partial"


def test_real_console_entry_exit_code(workdir):
    p = run_cli(["train", "training.stpes=5"], cwd=workdir, timeout=300)
    assert p.returncode == 2
    assert "unknown key 'training.stpes'" in p.stderr and "Traceback" not in p.stderr


def test_cfg_job_prints_derived_dims_for_large_recipes(capsys, workdir):
    assert train_main(["recipe=qwen35_35b_128k", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert "family: qwen3_5" in out and "ep: 8" in out and "cp: 4" in out and "dp_shard: 8" in out
    assert "derived layout for 32 GPUs" in out
    assert train_main(["recipe=qwen3_30b_a3b_64k", "--cfg", "job", "parallel.cp=4"]) == 0
    out = capsys.readouterr().out
    assert "cp: 4" in out and "ep: 8" in out and "dp_shard: 4" in out


def test_apiary_ls_show_cp(capsys, workdir):
    assert apiary_main(["ls"]) == 0
    out = capsys.readouterr().out
    for name in ("debug_moe", "qwen35_35b_128k", "chunked", "fsdp2", "alltoall"):
        assert name in out
    assert apiary_main(["show", "debug_moe"]) == 0
    assert "tiny_moe" in capsys.readouterr().out
    assert apiary_main(["cp", "debug_moe", "mine.yaml"]) == 0
    capsys.readouterr()
    assert apiary_main(["cp", "debug_moe", "mine.yaml"]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
    assert train_main(["recipe=mine.yaml", "--cfg", "job", "training.steps=7"]) == 0
    assert "steps: 7" in capsys.readouterr().out
    assert apiary_main(["show", "nonsense"]) == 2
