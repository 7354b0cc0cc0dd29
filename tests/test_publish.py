"""Weight publication (framework/train/publish.py, docs/skills/publish.md): a run with publish.interval
writes HF folders step-V atomically with a `latest` pointer; a reader polling `latest` never sees
a partial folder; transformers loads them and gives apiary's logits; the published weights are the
trained ones (equal to `apiary export` of the same step's checkpoint); background writing gives the
same bytes as foreground; bad publish.* input is refused before launch."""

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from framework.train import published

from conftest import _child_env, read_metrics

TINY = ["training.seq_len=64", "training.local_batch=2", "logging.tensorboard=false", "moe.load_balance_coeff=null",
        "lr.warmup_steps=0"]
# transformers' fp32 logits vs apiary's on the same published folder (the same fp32 weights, other kernels and
# summation orders): measured max abs diff 0 (qwen3 MoE) and < 2e-6 (qwen3_5) on logits of size ~5
LOGITS_ATOL = 1e-4

_HF_LOGITS = """
import sys
sys.modules["fla"] = None  # transformers' Qwen3.5 takes its torch path (fla's kernels need a GPU)
import torch, transformers
tokens = torch.load(sys.argv[1])
for folder in sys.argv[2:]:
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save({"logits": m(tokens).logits, "cls": type(m).__name__}, folder + "/hf_logits.pt")
"""
TOKENS = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))  # both recipes: byte vocab 320


def _start(workdir, name, *args):
    """`train` in a fresh interpreter, started now (the runs of this file go side by side)."""
    cmd = [sys.executable, "-m", "framework.cli", *TINY, f"output_dir={name}", *args]
    return subprocess.Popen(cmd, cwd=workdir, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


class _Reader(threading.Thread):
    """A generator's loop: poll DIR/latest, open the folder it names, check that it is whole."""

    def __init__(self, directory: Path):
        super().__init__(daemon=True)
        self.dir, self.seen, self.partial, self.stop = directory, [], [], False

    def run(self):
        while not self.stop:
            target = published.read_latest(self.dir)
            if target is not None:
                try:
                    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
                        n = len(list(f.keys()))
                    cfg = json.loads((target / "config.json").read_text())
                    version = json.loads((target / published.VERSION_FILE).read_text())["version"]
                    assert n > 0 and cfg["model_type"] and target.name == f"step-{version}"
                    if not self.seen or self.seen[-1] != target.name:
                        self.seen.append(target.name)
                except Exception as e:  # noqa: BLE001 - a missing or torn file is the failure tested for
                    self.partial.append(f"{target.name}: {e!r}")
            time.sleep(0.002)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """debug_moe, 4 steps, publication every 2: foreground keeping 3 (checkpoint at step 4) and
    background keeping 2 with a reader polling `latest` throughout; qwen35_debug_moe, 2 steps."""
    work = tmp_path_factory.mktemp("publish")
    reader = _Reader(work / "bg" / "weights")
    reader.start()
    procs = {
        "fg": _start(work, "fg", "recipe=debug_moe", "training.steps=4", "checkpoint.interval=4",
                     "publish.interval=2", "publish.keep=3", "publish.background=false"),
        "bg": _start(work, "bg", "recipe=debug_moe", "training.steps=4", "checkpoint.enable=false",
                     "publish.interval=2", "publish.keep=2", "publish.background=true"),
        "q35": _start(work, "q35", "recipe=qwen35_debug_moe", "training.steps=2", "checkpoint.enable=false",
                      "publish.interval=2"),
        "bf16": _start(work, "bf16", "recipe=debug_moe", "training.steps=2", "checkpoint.enable=false",
                       "publish.interval=2", "publish.dtype=bfloat16")}
    out = {k: _finish(p) for k, p in procs.items()}
    reader.stop = True
    reader.join()
    # transformers' logits of two published folders, copied aside (a published folder is the trainer's)
    ref = work / "hf"
    for name, src in (("qwen3", work / "fg" / "weights" / "step-4"), ("qwen35", work / "q35" / "weights" / "step-2")):
        shutil.copytree(src, ref / name)
    torch.save(TOKENS, work / "tokens.pt")
    p = subprocess.run([sys.executable, "-c", _HF_LOGITS, str(work / "tokens.pt"), str(ref / "qwen3"),
                        str(ref / "qwen35")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(work=work, fg=work / "fg", bg=work / "bg", q35=work / "q35", bf16=work / "bf16",
                out_fg=out["fg"], out_bg=out["bg"],
                reader=reader)


def test_run_publishes_every_interval_atomically(runs):
    fg, bg = runs["fg"] / "weights", runs["bg"] / "weights"
    assert published.versions(fg) == [0, 2, 4] and published.read_latest(fg) == fg / "step-4"
    assert published.versions(bg) == [2, 4] and published.read_latest(bg) == bg / "step-4"  # keep=2: step-0 pruned
    for line in ("published weights step-0", "published weights step-2", "published weights step-4"):
        assert line in runs["out_fg"] and line in runs["out_bg"]
    assert "in the background" in runs["out_bg"] and "in the background" not in runs["out_fg"]
    for d in (fg, bg):
        assert sorted(p.name for p in d.iterdir()) == sorted(["latest", *(f"step-{v}" for v in published.versions(d))])
        for v in published.versions(d):  # no .tmp / .del / .old left; each folder whole
            files = sorted(p.name for p in (d / f"step-{v}").iterdir())
            assert files == ["apiary_version.json", "config.json", "generation_config.json", "model.safetensors"]
            meta = json.loads((d / f"step-{v}" / published.VERSION_FILE).read_text())
            assert meta == {"version": v, "step": v, "run": str(d.parent)}
    # times in the metrics: the initial publication in step 1's record, step 2's in step 3's
    m = read_metrics(runs["fg"])
    assert [r.get("publish/version") for r in m] == [0, None, 2, None]
    assert all(r["publish/blocked_s"] >= r["publish/write_s"] > 0 for r in m if "publish/version" in r)


def test_reader_polling_latest_never_sees_a_partial_version(runs):
    r = runs["reader"]
    assert r.partial == []
    assert r.seen and r.seen[-1] == "step-4" and set(r.seen) <= {"step-0", "step-2", "step-4"}
    assert r.seen == sorted(r.seen, key=lambda s: int(s.split("-")[1]))  # versions only move forward


def test_background_writes_the_same_bytes_as_foreground(runs):
    fg, bg = runs["fg"] / "weights", runs["bg"] / "weights"
    for v in (2, 4):
        for f in ("model.safetensors", "config.json", "generation_config.json"):
            assert (fg / f"step-{v}" / f).read_bytes() == (bg / f"step-{v}" / f).read_bytes(), (v, f)
    # and the versions differ from each other (the weights move between publications)
    assert (fg / "step-0" / "model.safetensors").read_bytes() != (fg / "step-4" / "model.safetensors").read_bytes()


def test_publish_dtype_casts_the_published_weights(runs):
    """publish.dtype=bfloat16: the same initial weights as the fp32 run's step-0, cast, and config.json says so."""
    from safetensors.torch import load_file

    fp32 = load_file(str(runs["fg"] / "weights" / "step-0" / "model.safetensors"))
    bf16 = load_file(str(runs["bf16"] / "weights" / "step-0" / "model.safetensors"))
    assert fp32.keys() == bf16.keys() and all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert all(torch.equal(fp32[k].to(torch.bfloat16), bf16[k]) for k in fp32)
    cfg = json.loads((runs["bf16"] / "weights" / "step-2" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"


def test_published_weights_are_the_trained_ones(runs, tmp_path):
    """step-4 holds the weights of the run's step-4 checkpoint (`apiary export` of it), bit for bit."""
    from toolkit.cli import apiary_main

    assert apiary_main(["export", str(runs["fg"]), "--hf", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    exported = load_file(tmp_path / "export" / "model.safetensors")
    published = load_file(runs["fg"] / "weights" / "step-4" / "model.safetensors")
    assert exported.keys() == published.keys()
    assert all(torch.equal(exported[k], published[k]) for k in exported)


def _logits_match(folder: Path, recipe: str) -> str:
    from framework.api import build_model

    ref = torch.load(folder.parent.parent.parent / "hf" / ("qwen35" if "qwen35" in recipe else "qwen3") / "hf_logits.pt")
    model = build_model(recipe, hf_checkpoint=str(folder))
    with torch.no_grad():
        ours = model(TOKENS)
    assert ours.shape == ref["logits"].shape
    diff = (ours - ref["logits"]).abs().max().item()
    assert diff <= LOGITS_ATOL, diff
    print(f"{folder}: {ref['cls']} logits max abs diff {diff:.2e}")
    return ref["cls"]


def test_published_qwen3_moe_loads_in_transformers(runs):
    assert _logits_match(runs["fg"] / "weights" / "step-4", "debug_moe") == "Qwen3MoeForCausalLM"


def test_published_qwen35_loads_in_transformers(runs):
    assert published.versions(runs["q35"] / "weights") == [0, 2]
    assert _logits_match(runs["q35"] / "weights" / "step-2", "qwen35_debug_moe") == "Qwen3_5MoeForCausalLM"


def test_sharded_write_and_latest_pointer(tmp_path, monkeypatch):
    """Large models are written as shards with HF's index; `latest` is replaced, never edited."""
    monkeypatch.setattr(published, "SHARD_BYTES", 100)
    t = {f"w{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each: 2 per shard
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "model.safetensors").write_text("not copied")
    out = published.write_version(tmp_path / "w", 7, t, {"model_type": "x"}, run="r", tokenizer_dir=str(tok))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["apiary_version.json", "config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200 and len(index["weight_map"]) == 5
    assert published.read_latest(tmp_path / "w") == out
    for v in (8, 9):
        published.write_version(tmp_path / "w", v, t, {"model_type": "x"})
    assert published.prune(tmp_path / "w", 1) == [7, 8]
    assert published.versions(tmp_path / "w") == [9]
    # a resumed run republishing an older version drops the versions past it, never the latest
    published.write_version(tmp_path / "w", 5, t, {"model_type": "x"})
    assert published.prune(tmp_path / "w", 3, newer_than=5) == [9]
    assert published.versions(tmp_path / "w") == [5] and published.read_latest(tmp_path / "w").name == "step-5"


def test_prune_and_republication_never_touch_a_folder_publication_did_not_write(tmp_path):
    """A checkpoint step-N (or any folder) in the publication folder: not a version, never pruned,
    never replaced, and `latest` never names it (was: publish.keep deleted checkpoints, a resume's
    republication replaced one with an HF folder)."""
    from framework.errors import UserError

    w, t = tmp_path / "w", {"w": torch.ones(3)}

    def foreign(name):
        (w / name).mkdir(parents=True)
        (w / name / ".metadata").write_bytes(b"dcp")
        (w / name / "manifest.json").write_text(json.dumps({"step": int(name[5:])}))

    foreign("step-1")
    foreign("step-9")
    (w / "step-5").mkdir()  # another version's file copied in: not this version's
    (w / "step-5" / published.VERSION_FILE).write_text(json.dumps({"version": 3, "step": 3, "run": "r"}))
    for v in (2, 3, 4):
        published.write_version(w, v, t, {"model_type": "x"})
    assert published.versions(w) == [2, 3, 4]
    assert published.prune(w, 1) == [2, 3]
    assert published.prune(w, 1, newer_than=2) == []  # step-9 and step-5 are not versions past 2
    with pytest.raises(UserError) as e:
        published.write_version(w, 1, t, {"model_type": "x"})
    assert f"{w / 'step-1'} exists and publication did not write it" in str(e.value)
    assert sorted(p.name for p in w.iterdir()) == ["latest", "step-1", "step-4", "step-5", "step-9"]
    for name in ("step-1", "step-9"):
        assert sorted(p.name for p in (w / name).iterdir()) == [".metadata", "manifest.json"]
    assert published.read_latest(w).name == "step-4"


@pytest.mark.parametrize("argv,needle", [
    (["publish.dir=run/checkpoint"], "would hold both the published weights and the run's checkpoints"),
    (["publish.dir=run/checkpoint/weights"], "the published weights would go in"),
    (["publish.dir=run"], "the run's checkpoints would go in"),
    (["publish.dir=corpus/weights", "data.path=corpus"], "among the data"),
    (["data.path=corpus", "output_dir=corpus", "publish.dir=elsewhere"], "checkpoints' files would be read as data"),
])
def test_publication_checkpoints_and_data_in_one_folder_are_refused(capsys, workdir, argv, needle):
    from framework.cli import train_main

    (workdir / "corpus").mkdir()
    (workdir / "corpus" / "a.jsonl").write_text('{"text": "hello world, a short document"}\n' * 50)
    out = [] if any(a.startswith("output_dir=") for a in argv) else ["output_dir=run"]  # each key once
    code = train_main(["recipe=debug_moe", *out, "publish.interval=1", "publish.keep=2",
                       "checkpoint.interval=1", "checkpoint.keep_latest_k=0", "training.steps=4", *argv])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert "Keep them apart" in err and needle in err and "Traceback" not in err, err
    if "publish.dir=run/checkpoint" in argv:  # the issue's: versions and checkpoints share step-N
        assert "pruning versions (publish.keep) would delete checkpoints" in err, err
    assert sorted(p.name for p in workdir.iterdir()) == ["corpus"]  # nothing started, nothing written
    assert [p.name for p in (workdir / "corpus").iterdir()] == ["a.jsonl"]


@pytest.mark.parametrize("argv,needles", [
    (["publish.interval=-1"], ["publish.interval=-1", "must be >= 0"]),
    (["publish.interval=2", "publish.keep=0"], ["publish.keep=0", "must be >= 1"]),
    (["publish.interval=2", "publish.background=sometimes"], ["publish.background=sometimes", "auto, true, false"]),
    (["publish.interval=2", "publish.dir=afile/weights"], ["publish.dir=afile/weights", "not a folder"]),
    (["publish.interval=2", "publish.dtype=fp8"], ["publish.dtype=fp8", "bfloat16, float16, float32"]),
])
def test_bad_publish_input_refused_before_launch(capsys, workdir, argv, needles):
    from framework.cli import train_main

    (workdir / "afile").write_text("x")
    code = train_main(["recipe=debug_moe", "output_dir=run", *argv])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert all(n in err for n in needles), err
    assert "Traceback" not in err
    assert sorted(p.name for p in workdir.iterdir()) == ["afile"]  # nothing started, nothing left


def test_family_without_hf_exporter_refused(capsys, workdir):
    from framework.cli import train_main
    from framework.compose import registry

    (workdir / "nohf.py").write_text(
        "from components.models.qwen3 import (FLAVORS, NUMERICS, Options, apply, check, facts,  # noqa: F401\n"
        "                                     model_kwargs, model_spec)\n")
    (workdir / "reg.yaml").write_text("model:\n  nohf:\n    target: nohf\n    doc: qwen3 without an HF exporter\n")
    try:
        code = train_main(["registry=reg.yaml", "recipe=debug_moe", "model.family=nohf", "publish.interval=2"])
    finally:  # the user registry file is forgotten (as tests/test_cli_hydra.py does)
        registry.entries.cache_clear()
        registry._USED.clear()
        sys.modules.pop("nohf", None)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert "publish.interval=2" in err and "model.family=nohf has no HF exporter" in err, err
    assert not (workdir / "runs").exists()


@pytest.mark.slow
def test_two_ranks_fsdp_and_ep_publish_the_trained_weights(workdir):
    """2 gloo ranks (dp_shard 2, ep 2: DTensor parameters, experts split): every rank gathers, rank 0
    writes, and step-2 equals `apiary export` of the step-2 checkpoint bit for bit (about 30 s)."""
    from toolkit.cli import apiary_main

    out = _finish(_start(workdir, "run", "recipe=debug_moe", "nproc=2", "training.steps=2", "checkpoint.interval=2",
                         "publish.interval=2", "publish.background=true"))
    assert "published weights step-2" in out
    assert json.loads((workdir / "run" / "layout.json").read_text())["dims"]["ep"] == 2
    assert apiary_main(["export", str(workdir / "run"), "--hf", str(workdir / "export"), "--dtype", "float32"]) == 0
    a, b = load_file(workdir / "export" / "model.safetensors"), load_file(workdir / "run" / "weights" / "step-2" /
                                                                         "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
