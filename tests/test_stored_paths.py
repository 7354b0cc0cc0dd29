"""A run's stored config keeps its path keys absolute (framework/resolve/paths.py, docs/reliability.md): a
run launched with `model.hf_checkpoint=hf data.path=my.jsonl` (relative, as docs/tutorial.md does)
is exported from another folder (was: config.yaml kept `hf`, and `apiary export` from elsewhere
found no such folder). The console still names them as given; names (`data.tokenizer=byte`) and
URLs are kept; a resume compares a config stored before paths were absolute in the folder it runs in."""

from __future__ import annotations

import json
import os

import torch
from omegaconf import OmegaConf

from framework.resolve import paths
from framework.resolve.resolver import resolve

DOC = "the quick brown fox jumps over the lazy dog. " * 4


def _train(argv, monkeypatch):
    """The `train` console entry in this process (as tests/test_hf_checkpoints.py's)."""
    from framework.cli import train_main

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    try:
        return train_main(argv)
    finally:
        torch.set_num_threads(threads)
        for k in keys:
            os.environ.pop(k, None)


def test_resolve_stores_each_path_key_absolute_and_keeps_names(workdir):
    (workdir / "my.jsonl").write_text("".join(json.dumps({"text": DOC}) + "\n" for _ in range(8)))
    r = resolve("debug_moe", ["data.path=my.jsonl", "training.kernel_cache=./kc/../kc2", "publish.dir=w", "publish.interval=1",
                              "output_dir=runs/x"], world_size=1)
    assert r.cfg.data.path == str(workdir / "my.jsonl")
    assert r.cfg.training.kernel_cache == str(workdir / "kc2")  # normalised
    assert r.cfg.publish.dir == str(workdir / "w")
    assert r.cfg.data.tokenizer == "byte" and r.cfg.output_dir == "runs/x"  # a name; the run folder as given
    assert r.data_summary.startswith("data: local text my.jsonl:"), r.data_summary  # the console: as given
    assert paths.absolute("data.path", "hf://datasets/x") == "hf://datasets/x"
    assert paths.absolute("model.hf_checkpoint", "~/m") == os.path.expanduser("~/m")
    assert paths.shown(str(workdir / "my.jsonl")) == "my.jsonl" and paths.shown("/elsewhere/x") == "/elsewhere/x"
    # a config stored with relative paths (before): compared as resolved in this folder
    assert paths.absolute_leaves({"data.path": "my.jsonl", "loss.name": "ce"}) == {
        "data.path": str(workdir / "my.jsonl"), "loss.name": "ce"}


def test_a_run_with_relative_paths_exports_from_another_folder(tmp_path, monkeypatch, capsys):
    from toolkit.cli import apiary_main

    launch = tmp_path / "launch"
    launch.mkdir()
    monkeypatch.chdir(launch)
    tiny = ["recipe=debug_dense", "training.steps=1", "training.seq_len=32", "checkpoint.interval=1"]
    assert _train([*tiny, "output_dir=seed"], monkeypatch) == 0, capsys.readouterr().err[-2000:]
    assert apiary_main(["export", "seed", "--hf", "hf", "--dtype", "float32"]) == 0  # an HF folder to start from
    (launch / "my.jsonl").write_text("".join(json.dumps({"text": DOC}) + "\n" for _ in range(8)))
    capsys.readouterr()
    assert _train([*tiny, "model.hf_checkpoint=hf", "data.path=my.jsonl", "output_dir=runs/mine"], monkeypatch) == 0
    out, err = capsys.readouterr()
    assert "HF folder hf (" in out + err, (out + err)[-3000:]  # the first line names it as given
    cfg = OmegaConf.load(launch / "runs" / "mine" / "config.yaml")
    assert cfg.model.hf_checkpoint == str(launch / "hf") and cfg.data.path == str(launch / "my.jsonl")
    assert cfg.data.tokenizer == "byte" and cfg.output_dir == "runs/mine"
    resume_line = next(x for x in (out + err).splitlines() if x.strip().startswith("resume "))
    assert "model.hf_checkpoint=hf " in resume_line and "data.path=my.jsonl" in resume_line, resume_line
    monkeypatch.chdir(tmp_path)
    assert apiary_main(["export", "launch/runs/mine", "--hf", "out", "--dtype", "float32"]) == 0, \
        capsys.readouterr().err
    assert (tmp_path / "out" / "config.json").is_file()
