"""`apiary export RUN --hf OUT [--step N] [--dtype D]` streams (components/models/hf_export.py
``export_streamed``): a layer of the DCP checkpoint at a time, converted by the family's adapter,
written in publication's shards. The streamed folder equals the old whole-model conversion (bit for
bit in float32, that conversion rounded to bf16 in bfloat16, the default), loads in transformers with
apiary's logits, is sharded when the shard limit is lowered, and --step picks that checkpoint (a
missing one refused, naming those that exist). Two tiny runs (debug_moe: qwen3; qwen35_debug_moe:
qwen3_5), 2 steps on CPU, a checkpoint at each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework import devices

devices.install()  # before torchtitan is imported (CPU shims), as the trainer does

from components.models import hf_export, qwen3, qwen3_5  # noqa: E402
from framework.errors import UserError  # noqa: E402
from framework.train import published  # noqa: E402

from conftest import _child_env  # noqa: E402

TINY = ["training.steps=2", "checkpoint.interval=1", "training.local_batch=2", "logging.tensorboard=false",
        "moe.load_balance_coeff=null", "recompute=none"]
RECIPES = {"qwen3": ("debug_moe", "training.seq_len=32"), "qwen3_5": ("qwen35_debug_moe", "training.seq_len=128")}
# transformers' fp32 logits vs apiary's on one exported folder (the same weights, other kernels and summation
# orders): tests/test_publish.py measured max abs diff 0 (qwen3 MoE) and < 2e-6 (qwen3_5) on logits of size ~5
LOGITS_ATOL = 1e-4
TOKENS = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))  # both recipes: byte vocab 320
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> a run folder with checkpoints step-1 and step-2 (`train` in a fresh interpreter)."""
    root = tmp_path_factory.mktemp("export_stream")
    procs = {family: subprocess.Popen([sys.executable, "-m", "framework.cli", f"recipe={recipe}", seq, *TINY,
                                       f"output_dir={family}"], cwd=root, env=_child_env({"OMP_NUM_THREADS": "1"}),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for family, (recipe, seq) in RECIPES.items()}  # side by side (mostly start-up time), one thread each
    out = {}
    for family, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
        out[family] = root / family
    return out


def _export(run, out, *flags) -> int:
    from toolkit.cli import apiary_main

    return apiary_main(["export", str(run), "--hf", str(out), *flags])


def _whole_model(run: Path, family: str, step: int) -> dict:
    """What `apiary export` wrote before streaming: every parameter loaded as fp32 at once, converted
    by the family's adapter in one call (hf_export.export_run / qwen3_5_build.export_hf then)."""
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    if family == "qwen3_5":
        config = qwen3_5.build_config(qwen3_5.arch_of(cfg.model.flavor))
        with torch.device("meta"):
            model = qwen3_5.Qwen35TextModel(config)
        sd = {k: torch.empty(p.shape, dtype=torch.float32) for k, p in model.named_parameters()}
        adapter = qwen3_5.STATE_DICT_ADAPTER
    else:
        config = qwen3.model_config(cfg.model.flavor)
        with torch.device("meta"):
            model = config.build()
        params = {n for n, _ in model.named_parameters()}
        sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()
              if k in params or k.endswith((".wq.weight", ".wk.weight", ".wv.weight"))}
        adapter = qwen3.STATE_DICT_ADAPTER
    dcp.load(sd, checkpoint_id=str(run / "checkpoint" / f"step-{step}"), no_dist=True)
    return hf_export.to_hf_tensors(sd, config, adapter)


def _folder(path: Path) -> dict:
    """Every tensor of an HF folder (one file, or the shards its index names)."""
    idx = path / "model.safetensors.index.json"
    if not idx.is_file():
        return load_file(path / "model.safetensors")
    out = {}
    for f in sorted(set(json.loads(idx.read_text())["weight_map"].values())):
        out.update(load_file(path / f))
    return out


@pytest.mark.parametrize("family", list(RECIPES))
def test_streamed_export_is_the_whole_model_conversion(runs, family, tmp_path, capsys):
    """float32: bit for bit the old whole-model conversion; bfloat16 (the default) and float16: that
    conversion rounded to the dtype, bit for bit (DCP casts each tensor as it loads it; the adapters
    only move data)."""
    old = _whole_model(runs[family], family, 2)
    assert _export(runs[family], tmp_path / "f32", "--dtype", "float32") == 0
    assert "step 2, float32, 1 safetensors file" in capsys.readouterr().out
    assert _export(runs[family], tmp_path / "bf16") == 0
    assert "step 2, bfloat16, 1 safetensors file" in capsys.readouterr().out
    assert _export(runs[family], tmp_path / "f16", "--dtype", "float16") == 0
    f32, bf16, f16 = _folder(tmp_path / "f32"), _folder(tmp_path / "bf16"), _folder(tmp_path / "f16")
    assert f32.keys() == bf16.keys() == f16.keys() == old.keys() and len(old) > 20
    assert all(f32[k].dtype == torch.float32 and torch.equal(f32[k], old[k]) for k in old)
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], old[k].to(torch.bfloat16)) for k in old)
    assert all(f16[k].dtype == torch.float16 and torch.equal(f16[k], old[k].to(torch.float16)) for k in old)
    for d, name in ((tmp_path / "f32", "float32"), (tmp_path / "bf16", "bfloat16"), (tmp_path / "f16", "float16")):
        c = json.loads((d / "config.json").read_text())
        assert c["dtype"] == c["torch_dtype"] == name


@pytest.mark.parametrize("family", list(RECIPES))
def test_lowered_shard_limit_writes_shards_transformers_loads_with_apiarys_logits(runs, family, tmp_path,
                                                                                    monkeypatch, capsys):
    """published.SHARD_BYTES lowered to 64 KiB: several model-0000i-of-0000n files of at most that size (a
    larger tensor alone) with the index publication writes; the same tensors as one file; transformers'
    AutoModelForCausalLM loads the sharded folders (fp32, bf16) and gives the logits apiary's model
    gives on them."""
    from framework.api import build_model

    assert _export(runs[family], tmp_path / "one", "--dtype", "float32") == 0
    limit = 64 * 2**10
    monkeypatch.setattr(published, "SHARD_BYTES", limit)
    folders = {"float32": tmp_path / "f32", "bfloat16": tmp_path / "bf16"}
    for dtype, d in folders.items():
        assert _export(runs[family], d, "--dtype", dtype) == 0
    out = capsys.readouterr().out
    d = folders["float32"]
    files = sorted(d.glob("model-*-of-*.safetensors"))
    n = len(files)
    assert n >= 3 and "safetensors files" in out and not (d / "model.safetensors").exists()
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    one = load_file(tmp_path / "one" / "model.safetensors")
    assert set(index["weight_map"]) == set(one) and set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in one.values())
    for f in files:
        part = load_file(f)
        assert all(index["weight_map"][k] == f.name and torch.equal(v, one[k]) for k, v in part.items())
        assert len(part) == 1 or sum(v.numel() * 4 for v in part.values()) <= limit
    tokens = tmp_path / "tokens.pt"
    torch.save(TOKENS, tokens)
    p = subprocess.run([sys.executable, "-c", _HF_LOGITS, str(tokens), *map(str, folders.values())],
                       capture_output=True, text=True, timeout=600, env=_child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    recipe = RECIPES[family][0]
    for d in folders.values():
        ref = torch.load(d / "hf_logits.pt")
        assert ref["cls"] == ("Qwen3_5MoeForCausalLM" if family == "qwen3_5" else "Qwen3MoeForCausalLM")
        with torch.no_grad():
            ours = build_model(recipe, hf_checkpoint=str(d))(TOKENS)
        diff = (ours - ref["logits"]).abs().max().item()
        print(f"{d.name}: {ref['cls']} logits max abs diff {diff:.2e}")
        assert ours.shape == ref["logits"].shape and diff <= LOGITS_ATOL, diff


def test_step_picks_that_checkpoint_and_a_missing_step_is_refused(runs, tmp_path, capsys):
    import warnings

    run = runs["qwen3"]
    with warnings.catch_warnings(record=True) as caught:  # the one-process DCP read warns no more (newcomer pass 3)
        warnings.simplefilter("always")
        assert _export(run, tmp_path / "s1", "--step", "1", "--dtype", "float32") == 0
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)], [str(w.message) for w in caught]
    assert "step 1, float32" in capsys.readouterr().out
    s1, old1, old2 = _folder(tmp_path / "s1"), _whole_model(run, "qwen3", 1), _whole_model(run, "qwen3", 2)
    assert all(torch.equal(s1[k], old1[k]) for k in old1)
    assert any(not torch.equal(old1[k], old2[k]) for k in old1)  # step 1 is not step 2
    assert _export(run, tmp_path / "s7", "--step", "7") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"apiary export {run} --step 7: no complete checkpoint of that step; complete: 1, 2." in err, err
    assert "Pick one of those steps." in err and "Traceback" not in err and not (tmp_path / "s7").exists()
    with pytest.raises(UserError, match="complete: 1, 2"):  # the family's exporter called directly says the same
        qwen3.export_hf(str(run), str(tmp_path / "direct"), step=3)


def test_an_adapter_run_refuses_dtype_and_another_step(workdir, capsys):
    """An adapter run's exporter (components/adapters/export.py) writes the latest step as it always
    did: --dtype, or --step of another step, is refused before anything is read or written."""
    (workdir / "run" / "checkpoint").mkdir(parents=True)
    (workdir / "run" / "config.yaml").write_text("model:\n  family: qwen3\nadapter:\n  name: lora\n")
    assert _export(workdir / "run", workdir / "out", "--dtype", "float32") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the run trained adapters (adapter=lora)" in err and "Drop --dtype." in err, err
    assert not (workdir / "out").exists()
