"""Bad input, third pass (docs/reliability.md, "Bad input, third pass"): recipes and user registries
that used to end in a traceback or a silence, Hydra's `+` idioms, paths, values accepted silently.
Each refusal exits 2 with one paragraph naming the key or the file, before any worker starts, and
writes nothing. In process, through ``train_main`` (the console entry's function).
"""

import textwrap

import pytest

from framework.cli import train_main


@pytest.fixture(autouse=True)
def package_registry_after():
    """User registry files merged in-process are forgotten after each test."""
    from framework.compose import registry

    yield
    registry.entries.cache_clear()
    registry._USED.clear()


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


USER_MODULES = {
    "my_boom.py": '''
        from dataclasses import dataclass


        class Boom:
            @dataclass(kw_only=True)
            class Options:
                name: str = "boom"

            @staticmethod
            def check(options, ctx):
                raise KeyError("vocab")

            @staticmethod
            def apply(options, tc, ctx):
                pass
        ''',
    "my_exiting.py": "import sys\nsys.exit(3)\n",
}


@pytest.fixture
def files(workdir, monkeypatch):
    for name, text in USER_MODULES.items():
        (workdir / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(workdir))
    (workdir / "boom.yaml").write_text("loss:\n  boom:\n    target: my_boom:Boom\n")
    (workdir / "quits.yaml").write_text("loss:\n  quits:\n    target: my_exiting:X\n")
    (workdir / "listed.yaml").write_text("loss:\n  - a\n  - b\n")
    (workdir / "self.yaml").write_text("defaults:\n  - self\n  - _self_\n")
    (workdir / "ping.yaml").write_text("defaults:\n  - pong\n  - _self_\n")
    (workdir / "pong.yaml").write_text("defaults:\n  - ping\n  - _self_\n")
    (workdir / "mine.yml").write_text("defaults:\n  - debug_moe\n  - _self_\n")
    (workdir / "far.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\nloss:\n  num_chunks: 4\n")
    (workdir / "chunked.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\n"
                                          "loss:\n  name: chunked\n  num_chunks: 4\n")
    (workdir / "child.yaml").write_text("defaults:\n  - chunked\n  - _self_\ntraining:\n  steps: 3\n")
    return workdir


@pytest.mark.parametrize("argv,needles", [
    # recipes and user registries (were: RecursionError, AttributeError, a KeyError traceback, exit 3 silent)
    (["recipe=self.yaml"], ["self.yaml: its `defaults:` list extends itself (self -> self)"]),
    (["recipe=ping.yaml"], ["extends itself (ping -> pong -> ping)"]),
    (["registry=listed.yaml"], ["listed.yaml, loss must map each name to {target: module:attr", "not a list"]),
    (["registry=boom.yaml", "loss=boom"], ["loss=boom: loss 'boom' (bound by", "boom.yaml) raised KeyError: 'vocab'",
                                           "my_boom.py:12, in check"]),
    (["registry=quits.yaml", "loss=quits"], ["importing my_exiting:X", "called sys.exit(3)",
                                             "if __name__ == \"__main__\":"]),
    (["recipe=./mine.yml"], ["recipe=./mine.yml", "only files named *.yaml", "mv mine.yml mine.yaml"]),
    (["recipe=./mine.yaml"], ["no recipe file at mine.yaml", "There is mine.yml"]),
    # a packaged recipe's name written as a file away from the checkout (was: "no recipe file", nothing more)
    (["recipe=debug_moe.yaml"], ["no recipe file at debug_moe.yaml", "debug_moe is a packaged recipe",
                                 "Write recipe=debug_moe, or copy it here"]),
    (["recipe=recipes/debug_moe.yaml"], ["no recipe file at recipes/debug_moe.yaml", "debug_moe is a packaged recipe",
                                         "Write recipe=debug_moe,", "apiary cp debug_moe debug_moe.yaml"]),
    # Hydra's '+': a group every recipe has, a key only another option of the group declares, a typo
    (["+loss=chunked"], ["override +loss=chunked", "every recipe already chooses a loss",
                         "Choose the option without '+': loss=chunked."]),
    (["++loss=chunked"], ["Choose the option without '+': loss=chunked."]),
    (["+loss.num_chunks=4"], ["loss.num_chunks is an option of loss=chunked: write loss=chunked loss.num_chunks=4."]),
    (["+training.stpes=4"], ["Did you mean 'training.steps'? Write training.steps=4."]),
    # a recipe that sets another option's key without choosing it: name the two forms, not the same key
    (["recipe=far.yaml"], ["sets 'loss.num_chunks', an option of loss=chunked", "`loss: {name: chunked, ...}`",
                           "`override /loss: chunked` in the `defaults:` list"]),
    (["recipe=chunked.yaml", "loss=ce"], ["sets 'loss.num_chunks', an option of loss=chunked"]),
    # values accepted silently
    (["training.steps=99999999999999999999"], ["training.steps=99999999999999999999", "at most 2**63-1"]),
    (["lr.total_steps=99999999999999999999"], ["lr.total_steps=99999999999999999999", "at most 2**63-1"]),
    (["-m", "training.steps=range(1,0)"], ["the sweep expands to no jobs"]),
    (["hydra.run.dir=out"], ["override hydra.run.dir=out", "Set output_dir=out instead"]),
    # paths the OS refuses (was: OSError traceback)
    ([f"output_dir=out/{'a' * 300}"], ["names a file or folder of 300 bytes", "at most 255 bytes per name"]),
    ([f"data.path={'b' * 256}.jsonl"], ["data.path=", "names a file or folder of 262 bytes"]),
    # values that trained into exit 76
    (["adapter=lora", "moe.load_balance_coeff=null", "adapter.alpha=inf"], ["adapter.alpha=inf with adapter.rank=16",
                                                                            "at most 10000"]),
    (["adapter=lora", "moe.load_balance_coeff=null", "adapter.alpha=1e30"], ["adapter.alpha=1e+30", "6.25e+28"]),
])
def test_bad_input_is_refused_before_launch(files, capsys, argv, needles):
    code = train_main(argv)
    _refused(code, capsys.readouterr().err, files, *needles)


def test_plus_on_a_key_the_recipe_has_sets_it(workdir, capsys):
    """`+key=v` on a key the recipe has: set, as `key=v` (was refused: Hydra's '+' only adds)."""
    assert train_main(["+training.steps=5", "+model.n_layers=1", "--cfg", "job"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "steps: 5" in out and "n_layers: 1" in out


def test_a_recipe_section_that_names_its_component_chooses_it(files, capsys):
    """`loss: {name: chunked, num_chunks: 4}` in a recipe (or one it extends) chooses loss=chunked, as
    `override /loss: chunked` would; a group on the command line still wins."""
    for recipe in ("chunked.yaml", "child.yaml"):
        assert train_main([f"recipe={recipe}", "--cfg", "job"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "name: chunked" in out and "num_chunks: 4" in out, out
    assert train_main(["recipe=chunked.yaml", "loss.num_chunks=2", "--cfg", "job"]) == 0
    assert "num_chunks: 2" in capsys.readouterr().out


def _moe_folder(d, **change):
    """A tiny qwen3_moe HF folder written by hand (config.json and model.safetensors)."""
    import json

    import torch
    from safetensors.torch import save_file

    V, D, H, KV, hd, E, MF = 260, 32, 2, 1, 16, 4, 16
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g) * 0.05

    p = "model.layers.0."
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": torch.ones(D), "lm_head.weight": r(V, D),
         p + "input_layernorm.weight": torch.ones(D), p + "post_attention_layernorm.weight": torch.ones(D),
         p + "self_attn.q_proj.weight": r(H * hd, D), p + "self_attn.k_proj.weight": r(KV * hd, D),
         p + "self_attn.v_proj.weight": r(KV * hd, D), p + "self_attn.o_proj.weight": r(D, H * hd),
         p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
         p + "mlp.gate.weight": r(E, D)}
    for e in range(E):
        t.update({f"{p}mlp.experts.{e}.{w}_proj.weight": r(MF, D) for w in ("gate", "up")})
        t[f"{p}mlp.experts.{e}.down_proj.weight"] = r(D, MF)
    c = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
             num_key_value_heads=KV, head_dim=hd, intermediate_size=64, max_position_embeddings=512, rope_theta=1e4,
             tie_word_embeddings=False, rms_norm_eps=1e-6, num_experts=E, num_experts_per_tok=2,
             moe_intermediate_size=MF, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    c.update(change)
    d.mkdir(parents=True)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize("change,needles", [
    (dict(rms_norm_eps=-1), ["rms_norm_eps=-1 (must be a finite number > 0)"]),
    (dict(rope_theta=0), ["rope_theta=0 (must be a finite number > 0)"]),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), ["rope_theta=0"]),
])
def test_config_json_values_that_make_the_loss_non_finite_are_refused(workdir, capsys, change, needles):
    """An epsilon of -1 or a RoPE base of 0 in config.json (was: exit 76 at step 1, blamed on the learning
    rate): exit 2 naming the file and the field."""
    d = _moe_folder(workdir / "m", **change)
    code = train_main([f"model.hf_checkpoint={d}", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, f"{d}/config.json has", *needles)


def test_a_dense_flavor_with_an_moe_checkpoint_is_refused(workdir, capsys):
    """`model.flavor=tiny_dense` with an MoE hf_checkpoint (was: loaded the MoE, printed tiny_dense)."""
    d = _moe_folder(workdir / "m")
    code = train_main([f"model.hf_checkpoint={d}", "model.flavor=tiny_dense", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, "model.flavor=tiny_dense with model.hf_checkpoint=",
             "the flavor is a dense model, and the checkpoint's config.json describes an MoE one")
    assert train_main([f"model.hf_checkpoint={d}", "model.flavor=tiny_moe", "--cfg", "job"]) == 0


def test_an_unreadable_config_json_is_refused(workdir, capsys, monkeypatch):
    """config.json that cannot be read (was: PermissionError traceback). Tests run as root, who reads any
    file: a folder in its place, and a read that fails as it would for another user."""
    import pathlib

    d = _moe_folder(workdir / "m")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    code = train_main([f"model.hf_checkpoint={d}", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, f"{d}/config.json is a folder, not a file")
    (d / "config.json").rmdir()
    (d / "config.json").write_text("{}")
    real = pathlib.Path.read_text

    def denied(self, *a, **k):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    code = train_main([f"model.hf_checkpoint={d}", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, f"{d}/config.json cannot be read: Permission denied")


def test_apiary_output_folders_that_cannot_be_made_are_refused(workdir, capsys):
    """`apiary logprobs --out` and `apiary export --hf` that is a file, under a file or cannot be created
    (was: FileExistsError / NotADirectoryError / OSError tracebacks, after the model loaded): exit 2
    before anything loads."""
    import json

    from toolkit.cli import apiary_main

    (workdir / "r.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    (workdir / "notes.txt").write_text("x")
    (workdir / "run").mkdir()
    (workdir / "run" / "config.yaml").write_text("model:\n  family: qwen3\n")
    cases = [("notes.txt", "notes.txt is an existing file, not a folder"),
             ("notes.txt/sub", "notes.txt is an existing file, not a folder"),
             ("/proc/x/y", "/proc is not writable by this user"),
             (f"o/{'c' * 300}", "names a file or folder of 300 bytes")]
    for out, needle in cases:
        code = apiary_main(["logprobs", "no_model_needed", "r.jsonl", "--out", out])
        _refused(code, capsys.readouterr().err, workdir, f"apiary logprobs --out {out}"[:40], needle)
        code = apiary_main(["export", "run", "--hf", out])
        _refused(code, capsys.readouterr().err, workdir, "apiary export run --hf", needle)


@pytest.fixture
def texts(workdir):
    import json

    def write(name, n, words):
        (workdir / name).write_text("".join(json.dumps({"text": words * 100}) + "\n" for _ in range(n)))

    write("train.jsonl", 20, "zebra quartz ")
    write("val.jsonl", 3, "other words ")  # 3,606 byte tokens: 3 batches of 4 x 256
    (workdir / "tiny.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    return workdir


@pytest.mark.parametrize("argv,needles", [
    (["validation.path=tiny.jsonl"], ["validation.path=tiny.jsonl: holds 3 tokens", "a pass would validate nothing"]),
    (["validation.path=val.jsonl", "validation.steps=1000"], ["validation.steps=1000", "stop after 3 batch(es)",
                                                             "Set validation.steps=3"]),
])
def test_held_out_text_that_cannot_validate_is_refused(texts, capsys, argv, needles):
    """validation.path of a few bytes, or validation.steps beyond the file (was: accepted; a pass
    validated nothing, or fewer batches than asked)."""
    code = train_main(["data.path=train.jsonl", "validation.interval=5", "training.steps=1", "output_dir=out", *argv])
    _refused(code, capsys.readouterr().err, texts, *needles)


def test_held_out_text_that_is_the_training_text_is_said(texts):
    """validation.path naming data.path's own file (was: silent): the run's first lines say val_loss
    measures trained-on text (kept: an lr=0 control run compares the two on purpose)."""
    from framework.resolve.resolver import resolve

    r = resolve(None, ["data.path=train.jsonl", "validation.interval=5", "validation.path=./train.jsonl",
                       "output_dir=out"])
    assert "validation: NOT held out: validation.path=./train.jsonl holds train.jsonl" in r.data_summary, r.data_summary


def test_an_unknown_wandb_mode_is_refused_with_wandb_on(workdir, capsys, monkeypatch):
    """WANDB_MODE=garbage with logging.wandb=true (was: "Failed to create WandB logger", then trained
    unlogged with exit 0); ignored with wandb off, as wandb is."""
    monkeypatch.setenv("WANDB_MODE", "garbage")
    code = train_main(["logging.wandb=true", "training.steps=1", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, "WANDB_MODE=garbage", "not a mode wandb knows")
    monkeypatch.setenv("WANDB_MODE", "offline")
    from framework.resolve.resolver import resolve

    resolve(None, ["logging.wandb=true", "output_dir=out"], for_training=False)


@pytest.mark.parametrize("codes,expected", [([76, -15], 76), ([2, 2], 2), ([75, 75], 75), ([77, -15], 77),
                                            ([1, -15], None), ([76, 1], None)])
def test_torchrun_adds_no_traceback_after_a_ranks_own_paragraph(monkeypatch, capsys, codes, expected):
    """nproc>1: a rank that stopped with one of apiary's codes (exit 76 on a non-finite loss, 75, 77, 2)
    printed its paragraph; torchrun's ChildFailedError traceback no longer follows it (was: for all but
    exit 2). Any other failure keeps torchrun's report."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from framework.launch import lifecycle

    def failing(argv):
        failures = {}
        for rank, code in enumerate(codes):
            failures[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")
            failures[rank].timestamp = rank  # rank 0 failed first
        raise ChildFailedError("train", failures)

    monkeypatch.setattr(torch.distributed.run, "main", failing)
    if expected is None:
        with pytest.raises(ChildFailedError):
            lifecycle.torchrun_main([])
    else:
        assert lifecycle.torchrun_main([]) == expected


def test_a_hub_dataset_without_network_is_refused_before_launch(workdir, capsys, monkeypatch):
    """data.name=<hub id> with no network (was: each rank's loader retried for 30 s, then a `[rank0]
    ConnectionError` traceback): HF_HUB_OFFLINE set, or the hub's host unreachable within a few seconds,
    exits 2 before launch."""
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = train_main(["data.name=allenai/c4", "training.steps=1", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, "data.name=allenai/c4: is a HuggingFace hub dataset",
             "HF_HUB_OFFLINE=1 forbids reaching it", "data.name=local data.path=PATH")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_ENDPOINT"):
        monkeypatch.delenv(v, raising=False)
    asked = []

    def unreachable(address, timeout=None, *a, **k):
        asked.append((address, timeout))
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    code = train_main(["data.name=allenai/c4", "training.steps=1", "output_dir=out"])
    _refused(code, capsys.readouterr().err, workdir, "which this machine cannot reach (huggingface.co:443: timed out)")
    assert asked == [(("huggingface.co", 443), 5.0)]


def test_a_sweep_logs_each_jobs_output_and_ends_with_a_table(workdir):
    """`train -m`: each job's train.log holds what the job printed, its subprocesses' output too (was:
    empty), and the sweep ends with one table across the jobs (was: none). The jobs here print and
    write a summary.json instead of training (a fresh interpreter: Hydra configures logging)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    script = textwrap.dedent("""
        import json, subprocess, sys
        from pathlib import Path
        from framework import cli

        def job(recipe, job, output_dir, verbose):
            steps = int(next(o for o in job if o.startswith("training.steps=")).split("=")[1])
            print(f"job says steps={steps}", flush=True)
            subprocess.run([sys.executable, "-c", f"import sys; sys.stderr.write('rank says {steps}')"])
            (Path(output_dir) / "summary.json").write_text(json.dumps(
                {"step": steps, "total_steps": steps, "loss_first": 5.0, "loss_last": 5.0 - steps,
                 "val_loss_last": None, "tokens_per_s_mean": 1234.0}))
            return 0

        cli._run_job = job
        sys.exit(cli.train_main(["-m", "training.steps=1,3", "hydra.sweep.dir=sw"]))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=workdir, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"))
    assert p.returncode == 0, p.stderr[-3000:]
    for n, steps in ((0, 1), (1, 3)):
        log = (workdir / "sw" / str(n) / "train.log").read_text()
        assert f"job says steps={steps}" in log and f"rank says {steps}" in log, log
    assert "job says steps=1" in p.stdout and "rank says 3" in p.stderr  # still shown
    table = p.stdout[p.stdout.index(f"sweep {workdir / 'sw'}: 2 job(s), one folder each"):]
    assert "training.steps" in table and "loss first -> last" in table, table
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    assert rows == [["0", "1", "0", "1/1", "5.0000 -> 4.0000", "-", "1,234"],
                    ["1", "3", "0", "3/3", "5.0000 -> 2.0000", "-", "1,234"]], table
