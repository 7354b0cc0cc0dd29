"""Pre-launch refusals (issue 14, items 1, 7, 8): every bad input exits 2 with one paragraph that
names the key, before any worker starts and without a run directory; data.path is what trains;
the memory preflight refuses a launch the planner says cannot fit the GPU.

The list of inputs runs in process through ``train_main`` (the console entry's function); a few
of them, the compare case and the memory case also run through the real console entry in a
fresh interpreter (several seconds each on a shared 2-core box).
"""

import json
import os
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, run_cli

DOC = "zebra quartz xylophone " * 20  # distinctive: the packaged corpus (stdlib docstrings) has no such run


def _refused(p, workdir, *needles):
    err = " ".join(p.stderr.split())
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr
    assert "error apiary:" in err, err  # (a model family's import may warn first, e.g. fla on CPU)
    err = err[err.index("error apiary:"):]
    assert err.count("error apiary:") == 1, err  # one paragraph
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()  # nothing started, nothing written


@pytest.fixture
def files(workdir):
    (workdir / "good.jsonl").write_text("".join(json.dumps({"text": DOC}) + "\n" for _ in range(3)))
    (workdir / "empty.jsonl").write_text("")
    (workdir / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + '{"text": "unclosed\n')
    (workdir / "notext.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (workdir / "corpus.csv").write_text("text\nhello\n")
    (workdir / "nothing").mkdir()
    (workdir / "nothing" / "notes.md").write_text("# no data here\n")
    (workdir / "taken").write_text("a file, not a folder\n")
    (workdir / "latin1.txt").write_bytes("caf\u00e9\n".encode() + "na\u00efve\n".encode("latin-1"))
    (workdir / "mixed").mkdir()
    (workdir / "mixed" / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (workdir / "mixed" / "b.txt").write_text("b\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x", "y"]}), workdir / "nocol.parquet")
    (workdir / "broken.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\ntraining:\n  steps: [1, 2\n")
    return workdir


@pytest.mark.parametrize("argv,needles", [
    # item 1: local data files
    (["data.path=empty.jsonl"], ["data.path=empty.jsonl", "empty.jsonl: empty file"]),
    (["data.path=bad.jsonl"], ["data.path=bad.jsonl", "bad.jsonl:2: not a JSON line"]),
    (["data.path=notext.jsonl"], ["notext.jsonl:1:", "string 'text' field", "keys: body"]),
    (["data.path=corpus.csv"], ["unsupported suffix '.csv'", ".jsonl"]),
    (["data.path=nothing"], ["data.path=nothing", "no .json, .jsonl, .parquet, .txt file in this folder"]),
    (["data.path=latin1.txt"], ["latin1.txt:2: not UTF-8 text"]),
    (["data.path=mixed"], ["files of several formats (.jsonl, .txt)"]),
    (["data.path=nocol.parquet"], ["nocol.parquet: has no 'text' column (columns: content)"]),
    (["data.sharding=rows"], ["data.sharding=rows", "valid: blocks, documents"]),
    (["data.name=local"], ["data.name=local", "needs data.path"]),
    (["data.path=good.jsonl", "data.name=allenai/c4"], ["both name a source", "data.name=local"]),
    # item 7
    (["recipe=broken.yaml"], ["broken.yaml:6:", "is not valid YAML"]),
    (["recipe="], ["recipe=: is empty", "debug_moe"]),
    (["output_dir=taken"], ["output_dir=taken", "is an existing file"]),
    (["output_dir=/proc/apiary-run"], ["output_dir=/proc/apiary-run", "not writable"]),
    (["loss=chunked", "loss.num_chunks=0"], ["loss=chunked", "loss.num_chunks must be >= 1"]),
    (["checkpoint.interval=0"], ["checkpoint.interval=0", "must be >= 1", "checkpoint.enable=false"]),
    (["optimizer.name=Adamw"], ["optimizer.name=Adamw", "valid: Adam, AdamW", "Did you mean"]),
    (["logging.log_freq=0"], ["logging.log_freq=0", "must be >= 1"]),
    (["optimizer.lr=nan"], ["optimizer.lr=nan", "must be a finite number >= 0"]),
    (["optimizer.lr=inf"], ["optimizer.lr=inf", "must be a finite number >= 0"]),
    (["optimizer.lr=-1e-3"], ["optimizer.lr=-0.001", "must be a finite number >= 0"]),
    (["lr.warmup_steps=-1"], ["lr.warmup_steps=-1", "must be >= 0"]),
    (["training.max_norm=-1"], ["training.max_norm=-1.0", "must be > 0", "training.max_norm=inf"]),
    (["+training.stpes=5"], ["+training.stpes=5", "would be ignored", "Did you mean 'training.steps'"]),
    (["training.seq_len=0"], ["training.seq_len=0", "must be >= 2"]),
    (["training.local_batch=0"], ["training.local_batch=0", "must be >= 1"]),
    (["training.steps=-5"], ["training.steps=-5", "must be >= 1"]),
    (["nproc=0"], ["launcher=local", "nproc (launcher.nproc) must be >= 1", "got 0"]),
    (["preflight.memory=maybe"], ["preflight.memory=maybe", "valid: refuse, warn, off"]),
    (["gpu=H300"], ["preflight.gpu=H300", "unknown GPU kind", "H100, H200"]),
])
def test_bad_input_is_refused_before_launch(files, capsys, argv, needles):
    """In process (the console entry's own function; seconds for the whole list)."""
    from framework.cli import train_main

    code = train_main(argv)
    _refused(SimpleNamespace(returncode=code, stderr=capsys.readouterr().err, stdout=""), files, *needles)


@pytest.mark.parametrize("argv,needles", [
    (["recipe=broken.yaml"], ["broken.yaml:6:", "is not valid YAML"]),
    (["data.path=bad.jsonl"], ["bad.jsonl:2: not a JSON line"]),
    (["+training.stpes=5"], ["Did you mean 'training.steps'"]),
    (["nproc=0"], ["nproc (launcher.nproc) must be >= 1"]),
])
def test_console_entry_refuses_without_traceback(files, argv, needles):
    """The same through the real console entry in a fresh interpreter, as a user runs it."""
    _refused(run_cli(["train", *argv], cwd=files, timeout=300), files, *needles)


def test_identical_compare_variants_are_refused(workdir):
    p = run_cli(["apiary", "compare", "loss=ce,ce", "training.steps=2", "output_dir=cmp"], cwd=workdir, timeout=300)
    _refused(p, workdir, "loss=ce,ce", "more than once")
    assert not (workdir / "cmp").exists()


def test_read_only_output_dir_is_refused(workdir, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder; /proc covers the case above")
    from framework.cli import train_main

    ro = workdir / "ro"
    ro.mkdir(mode=0o555)
    assert train_main([f"output_dir={ro}/run"]) == 2
    assert "not writable" in capsys.readouterr().err
    assert not (ro / "run").exists()


def test_local_file_is_what_trains(workdir, one_thread, capsys):
    """data.path takes effect with the default data.name: the first batch is the file's bytes."""
    from components.data.tokenizer import ByteTokenizer
    from framework import devices
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    path = workdir / "zebra.jsonl"
    path.write_text("".join(json.dumps({"text": DOC}) + "\n" for _ in range(4)))
    r = resolve(None, [f"data.path={path}", "training.seq_len=64", "training.local_batch=2"])
    assert r.cfg.data.name == "packaged"  # the default name: data.path wins
    assert r.data_summary.startswith(f"data: local text {path}: 4 documents, {4 * len(DOC):,} bytes")
    assert f"{4 * len(DOC) + 8:,} tokens (byte tokenizer)" in r.data_summary
    devices.install()
    tc = trainer_config(r)  # the Trainer.Config the worker builds from
    tok = tc.tokenizer.build(tokenizer_path=tc.hf_assets_path)
    dl = tc.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=64, local_batch_size=2)
    inputs, labels = next(iter(dl))
    ids = inputs["input"]
    assert tuple(ids.shape) == (2, 64)
    first = ids[0].tolist()
    assert first[0] == ByteTokenizer.BOS
    assert bytes(first[1:64]) == (DOC.encode() * 2)[:63]
    text = ByteTokenizer().decode(ids.flatten().tolist())
    assert set(text) <= set(DOC)  # nothing from the packaged corpus


def test_run_names_its_data_first(workdir):
    """The run's first line names the source, the file, documents, bytes and tokens."""
    path = workdir / "zebra.txt"
    path.write_text("\n".join([DOC] * 5) + "\n")
    p = run_cli(["train", f"data.path={path}", "training.steps=1", "training.seq_len=32", "training.local_batch=1",
                 "checkpoint.enable=false", "logging.tensorboard=false", "output_dir=run"], cwd=workdir, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    data = [ln for ln in lines if ln.startswith("data:")]
    assert data and data[0].startswith(f"data: local text {path}: 5 documents"), p.stdout
    assert lines.index(data[0]) <= 1  # after the one-line banner, before anything the trainer prints


QWEN_OOM = ["recipe=qwen35_35b_128k", "model.n_layers=4", "training.seq_len=32768", "parallel.cp=1", "parallel.ep=1",
            "parallel.dp_shard=1", "loss=ce", "recompute=full", "nproc=1", "data.name=packaged", "data.tokenizer=byte"]


def test_memory_preflight_refuses_what_cannot_fit(workdir):
    """The issue's 177.8 GiB on one H200 case (161.2 GiB planned since the reserve follows expandable
    segments and the MoE combine keeps no fp32 copies): refused on a CPU-only host with gpu=H200."""
    p = run_cli(["train", *QWEN_OOM, "gpu=H200"], cwd=workdir, timeout=600)
    _refused(p, workdir, "preflight.memory=refuse", "161.2 GiB per GPU on H200 (140.0 GiB", "optimizer_states",
             "logits_fp32", "Changes that fit", "loss=linear_ce", "preflight.memory=warn")


def test_memory_preflight_off_warn_and_cpu(workdir, capsys):
    from framework.resolve.resolver import resolve

    full = [o.replace("nproc=", "launcher.nproc=") for o in QWEN_OOM[1:]]  # resolve() takes full keys

    r = resolve("qwen35_35b_128k", full + ["preflight.gpu=H200", "preflight.memory=off"])
    assert r.layout.world_size == 1 and r.cfg.preflight.gpu == "H200"
    r = resolve("qwen35_35b_128k", full + ["preflight.gpu=H200", "preflight.memory=warn"])
    err = " ".join(capsys.readouterr().err.split())
    assert "warning memory: the planner estimates 161.2 GiB" in err and "may run out of memory" in err
    # without a GPU kind a CPU run is checked against this host's memory instead (176 GiB for this one:
    # tests/test_bad_inputs_data.py); the debug recipes fit any host
    resolve("debug_moe", [])
    resolve("debug_moe", ["preflight.gpu=H100"])  # and a tiny model fits any GPU
    assert capsys.readouterr().err == ""


def test_memory_preflight_band_is_the_measured_error(monkeypatch, capsys):
    """Against a GPU of M bytes an estimate E passes silently up to M (1 - MEASURED_UNDER), warns up
    to M (1 + MEASURED_ERROR) (in refuse mode too), and above that is refused (refuse) or warned
    about (warn); off says nothing. The GPU's memory is set around the planner's estimate here."""
    from framework.errors import UserError
    from framework.plan import planner, preflight
    from framework.plan.preflight import MEASURED_ERROR, MEASURED_UNDER, check_memory
    from framework.resolve.resolver import resolve

    full = [o.replace("nproc=", "launcher.nproc=") for o in QWEN_OOM[1:]]
    r = resolve("qwen35_35b_128k", full + ["preflight.gpu=H200", "preflight.memory=off"])
    total = planner.plan(r, gpu="H200").total_bytes
    monkeypatch.setattr(preflight, "cheapest_fits", lambda *a, **k: ["parallel.cp=2"])  # the search: tested above

    def verdict(memory_bytes: float, mode: str) -> str:
        monkeypatch.setattr(preflight, "target_gpu", lambda cfg: ("H200", int(memory_bytes), "test"))
        r.cfg.preflight.memory = mode
        capsys.readouterr()
        try:
            check_memory(r, "qwen35_35b_128k", full, resolve)
        except UserError as e:
            assert "parallel.cp=2" in str(e) and f"{MEASURED_ERROR:.0%}" in str(e)
            return "refused"
        return "warned" if "warning memory" in capsys.readouterr().err else "silent"

    e, u = MEASURED_ERROR, MEASURED_UNDER
    assert verdict(total / (1 - u) * 1.001, "refuse") == "silent"
    assert verdict(total / (1 - u) * 0.999, "refuse") == "warned"  # within the error below the estimate
    assert verdict(total * 0.999, "refuse") == "warned"
    assert verdict(total / (1 + e) * 1.001, "refuse") == "warned"  # above the memory, within the error
    assert verdict(total / (1 + e) * 0.999, "refuse") == "refused"
    assert verdict(total / (1 + e) * 0.999, "warn") == "warned"
    assert verdict(total / (1 + e) * 0.999, "off") == "silent"


def test_auto_recompute_margin_is_the_preflight_band():
    """recompute=auto leaves exactly the margin under which the preflight passes a plan silently:
    auto's own choice is never warned about, and the two numbers cannot drift apart."""
    from components.recompute.policies import MARGIN, AutoRecompute
    from framework.plan.planner import Constants
    from framework.plan.preflight import MEASURED_UNDER

    assert MARGIN == MEASURED_UNDER == AutoRecompute.Options().margin == Constants().tight_fraction


def test_chunked_loss_check_is_a_component_hook():
    """resolve calls each group component's check(options): the framework names no loss."""
    from components.losses.chunked import ChunkedCrossEntropy

    src = "".join(p.read_text() for p in sorted((ROOT / "framework" / "resolve").glob("*.py")))
    assert "def resolve(" in src
    assert "num_chunks" not in src and "chunked" not in src
    with pytest.raises(ValueError, match="num_chunks"):
        ChunkedCrossEntropy.Options(num_chunks=0)
    ChunkedCrossEntropy.check(ChunkedCrossEntropy.Options(num_chunks=2))  # the value checks ran as it was built


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_local_sources_are_counted(tmp_path):
    """What the run's first line reports: files, documents, bytes (jsonl folder, txt, parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from components.data.local_text import inspect_local

    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "x", "id": 1}) + "\n")
    (d / "sub" / "b.jsonl").write_text(json.dumps({"text": "yz"}) + "\n")
    s = inspect_local(str(d))
    assert (len(s.files), s.documents, s.text_bytes) == (2, 3, 6 + 1 + 2)
    assert s.describe("local", "byte").endswith("3 documents, 9 bytes, 15 tokens (byte tokenizer)")
    (tmp_path / "t.txt").write_text("one\ntwo\n")
    assert (inspect_local(str(tmp_path / "t.txt")).documents, inspect_local(str(tmp_path / "t.txt")).text_bytes) == (2, 6)
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), tmp_path / "p.parquet")
    s = inspect_local(str(tmp_path / "p.parquet"))
    assert (s.documents, s.text_bytes) == (3, None) and "3 documents" in s.describe("local", "byte")


def test_memory_preflight_under_apiary_launch(workdir, capsys):
    """A Slurm submission from a login node (no GPU) is checked against gpu=H200 before sbatch."""
    from toolkit.cli import apiary_main

    argv = ["launch", "launcher=slurm", "nodes=1", "gpus_per_node=1", "gpu=H200", "--dry-run"]
    assert apiary_main([*argv, *[o for o in QWEN_OOM if not o.startswith("nproc=")]]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "preflight.memory=refuse" in err and "161.2 GiB per GPU on H200" in err
    assert not (workdir / "runs").exists()
