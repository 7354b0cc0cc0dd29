"""Any HuggingFace text checkpoint of a supported family (qwen3 dense and MoE, llama3, qwen3_5)
loads without editing apiary: random tiny configs built with transformers give transformers'
fp32 logits through build_model and through `train`; export then re-import is exact; bad
folders and tokenizers are refused before launch with exit 2; a self-trained BPE tokenizer
trains and resumes bit for bit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework import devices

devices.install()  # before torchtitan is imported (CPU shims), as the trainer does

from components.models import hf_export, llama3, qwen3, qwen3_5, qwen3_5_hf  # noqa: E402
from framework.api import build_model  # noqa: E402
from framework.errors import UserError  # noqa: E402

from conftest import run_cli  # noqa: E402

_Q35_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4)
# Tiny random configs: every family, varied vocab / hidden / layers / heads / KV heads / head_dim /
# experts / top-k / rope theta / tied embeddings. "load" is the recipe or family:flavor given to
# build_model: its flavor is deliberately not the checkpoint's (the flavor supplies defaults only).
SPECS = {
    "qwen3_dense_tied": dict(cls="qwen3", load="qwen3:tiny_moe", config=dict(
        vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, rope_theta=1e4, tie_word_embeddings=True, max_position_embeddings=512)),
    "qwen3_dense_bf16": dict(cls="qwen3", load="qwen3:tiny_dense", bf16=True, config=dict(
        vocab_size=411, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=24, intermediate_size=80, rope_theta=5e5, max_position_embeddings=512)),
    "qwen3_moe": dict(cls="qwen3_moe", load="debug_moe", config=dict(
        vocab_size=333, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
        rope_theta=1e6, max_position_embeddings=512)),
    "qwen3_moe_tied": dict(cls="qwen3_moe", load="qwen3:tiny_dense", config=dict(
        vocab_size=290, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=10, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True,
        rope_theta=2e4, tie_word_embeddings=True, max_position_embeddings=512)),
    "qwen3_moe_yarn": dict(cls="qwen3_moe", load="qwen3:30B-A3B-yarn", config=dict(
        vocab_size=310, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64))),
    "llama_tied_scaled": dict(cls="llama", load="llama3:debugmodel", config=dict(
        vocab_size=350, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, intermediate_size=100, tie_word_embeddings=True, max_position_embeddings=512,
        rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama": dict(cls="llama", load="llama3:8B", config=dict(
        vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, rope_theta=1e4, max_position_embeddings=512)),
    "qwen35_moe": dict(cls="qwen3_5_moe", load="qwen35_debug_moe", config=dict(
        vocab_size=503, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, max_position_embeddings=1024, **_Q35_LINEAR,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0]))),
    "qwen35_dense_tied": dict(cls="qwen3_5", load="qwen3_5:debug_moe", config=dict(
        vocab_size=280, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, tie_word_embeddings=True, max_position_embeddings=1024, **_Q35_LINEAR,
        rope_parameters=dict(rope_type="default", rope_theta=1e5, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0]))),
}
FAMILY = {"qwen3": qwen3, "qwen3_moe": qwen3, "llama": llama3, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Every spec saved by transformers (one interpreter, fla blocked) with its reference logits."""
    out = tmp_path_factory.mktemp("hf")
    specs = [dict(name=k, **v) for k, v in SPECS.items()]
    (out / "specs.json").write_text(json.dumps(specs))
    script = Path(__file__).with_name("hf_reference.py")
    p = subprocess.run([sys.executable, str(script), str(out), str(out / "specs.json")], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _sd(path):
    from safetensors.torch import load_file

    return load_file(Path(path) / "model.safetensors")


# ---------------------------------------------------------------- build_model parity

@pytest.mark.parametrize("name", list(SPECS))
def test_build_model_gives_transformers_logits(hf_dirs, name):
    spec, d = SPECS[name], hf_dirs / name
    ref = torch.load(d / "reference.pt")
    model = build_model(spec["load"], hf_checkpoint=str(d))
    assert model.config.vocab_size == spec["config"]["vocab_size"]  # config.json, not the flavor
    assert len(model.layers) == spec["config"]["num_hidden_layers"]
    with torch.no_grad():
        logits = model(ref["tokens"])
    assert logits.dtype == torch.float32 and logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max().item() <= 1e-4
    if spec.get("bf16"):  # bf16 weights in an fp32 model
        assert {v.dtype for v in _sd(d).values()} == {torch.bfloat16}



@pytest.mark.parametrize("name", ["debug_moe", "debug_dense", "llama3:debugmodel"])
def test_build_model_of_a_recipe_maps_ids_to_causal_logits(name):
    """README's Python API: build_model(RECIPE)(ids) with no masks gives logits, attending causally
    (debug_moe and debug_dense stopped in the CPU dense-mask attention for want of masks)."""
    torch.manual_seed(0)
    model = build_model(name, n_layers=1) if ":" in name else build_model(name)
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        logits = model(ids)
        later = ids.clone()
        later[:, -1] = (later[:, -1] + 1) % 100
        changed = model(later)
    assert logits.shape == (2, 12, model.config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(logits[:, :-1], changed[:, :-1]) and not torch.equal(logits[:, -1], changed[:, -1])

def _export(model, family, out):
    if family is qwen3_5:
        return qwen3_5_hf.save_hf(model.state_dict(), qwen3_5_hf.arch_from_hf_config(model.config.hf_checkpoint),
                                  str(out), model.config)
    arch = family.arch_from_config(model.config)
    return hf_export.save(model.state_dict(), model.config, family.STATE_DICT_ADAPTER, family.hf_config(arch), out)


@pytest.mark.parametrize("name", ["qwen3_dense_tied", "qwen3_moe", "qwen3_moe_yarn", "llama_tied_scaled",
                                  "qwen35_dense_tied"])
def test_export_then_reimport_is_exact(hf_dirs, name, tmp_path):
    spec, d = SPECS[name], hf_dirs / name
    family = FAMILY[spec["cls"]]
    model = build_model(spec["load"], hf_checkpoint=str(d))
    out = _export(model, family, tmp_path / "out")
    exported, original = _sd(out), _sd(d)
    assert exported.keys() == original.keys()  # the hub's layout (no lm_head when tied)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert family.arch_of("x", hf_checkpoint=str(out)) == family.arch_of("x", hf_checkpoint=str(d))
    again = build_model(spec["load"], hf_checkpoint=str(out)).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())


def test_fewer_layers_load_the_first_ones_and_say_so(hf_dirs):
    d = hf_dirs / "llama"
    full = build_model("llama3:8B", hf_checkpoint=str(d)).state_dict()
    two = build_model("llama3:8B", hf_checkpoint=str(d), n_layers=2)
    assert len(two.layers) == 2 and all(torch.equal(v, full[k]) for k, v in two.state_dict().items())
    f = llama3.facts("8B", hf_checkpoint=str(d), n_layers=2)
    assert f.n_layers == 2 and "first 2 of its 3 layers" in f.source and str(d) in f.source
    with pytest.raises(UserError, match=r"model.n_layers=4: is more than the 3 layers"):
        build_model("llama3:8B", hf_checkpoint=str(d), n_layers=4)
    with pytest.raises(UserError, match=r"model.vocab_size=320: contradicts .* vocabulary is 260"):
        build_model("llama3:8B", hf_checkpoint=str(d), vocab_size=320)


# ---------------------------------------------------------------- through `train`

def _train(argv, workdir, monkeypatch, capsys):
    """The `train` console entry in this process (no second interpreter start)."""
    import os

    from framework.cli import train_main

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    try:
        code = train_main(argv)
    finally:
        torch.set_num_threads(threads)
        for k in keys:
            os.environ.pop(k, None)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name,recipe", [("qwen3_moe", "recipe=debug_moe"),
                                         ("llama_tied_scaled", "recipe=debug_dense"),
                                         ("qwen35_moe", "recipe=qwen35_debug_moe")])
def test_train_loads_the_checkpoint_exports_and_reimports(hf_dirs, name, recipe, workdir, monkeypatch, capsys,
                                                          caplog):
    import torch.distributed.checkpoint as dcp

    from toolkit.cli import apiary_main

    spec, d = SPECS[name], hf_dirs / name
    family = "llama3" if spec["cls"] == "llama" else None
    base = [recipe, f"model.hf_checkpoint={d}", "training.seq_len=32", "training.local_batch=2", "recompute=none"]
    base += [f"model.family={family}", "model.flavor=debugmodel"] if family else []
    # a seed checkpoint holds exactly what the trainer loaded: transformers' logits
    code, out, err = _train(base + ["checkpoint.create_seed=true", "output_dir=seed"], workdir, monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    assert f"model: HF checkpoint {d}:" in out and f"vocab_size={spec['config']['vocab_size']}" in out
    model = build_model(spec["load"], hf_checkpoint=str(d))
    params = dict(model.named_parameters())
    sd = {k: torch.empty_like(v) for k, v in params.items()}
    dcp.load(sd, checkpoint_id=str(workdir / "seed" / "checkpoint" / "step-0"), no_dist=True)
    assert all(torch.equal(params[k], v) for k, v in sd.items())
    # two steps, then `apiary export RUN --hf OUT`: the exported folder is the step-2 checkpoint
    code, out, err = _train(base + ["training.steps=2", "checkpoint.interval=2", "output_dir=run"], workdir,
                            monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    m = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in m)
    with caplog.at_level("WARNING", logger="apiary"):
        assert apiary_main(["export", str(workdir / "run"), "--hf", str(workdir / "exported"), "--dtype", "float32"]) == 0
    said = caplog.text + "".join(capsys.readouterr())
    assert ("routing bias" in said) == ("num_experts" in spec["config"])  # not in HF's format: said so
    assert set(_sd(workdir / "exported")) == set(_sd(d))
    again = build_model(spec["load"], hf_checkpoint=str(workdir / "exported"))
    params = dict(again.named_parameters())
    sd = {k: torch.empty_like(v) for k, v in params.items()}
    dcp.load(sd, checkpoint_id=str(workdir / "run" / "checkpoint" / "step-2"), no_dist=True)
    assert all(torch.equal(params[k], v) for k, v in sd.items())
    assert any(not torch.equal(params[k], v) for k, v in model.named_parameters())  # it trained


def test_export_of_a_flavor_run_reimports_exactly(workdir, monkeypatch, capsys):
    """A run of a torchtitan flavor (fused QKV) exports to an HF folder that loads back exactly."""
    import torch.distributed.checkpoint as dcp

    from toolkit.cli import apiary_main

    code, out, err = _train(["recipe=debug_dense", "training.steps=1", "training.seq_len=32", "checkpoint.interval=1",
                             "output_dir=run"], workdir, monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    assert apiary_main(["export", "run", "--hf", "exported", "--dtype", "float32"]) == 0
    assert json.loads((workdir / "exported" / "config.json").read_text())["model_type"] == "qwen3"
    model = build_model("debug_dense", hf_checkpoint="exported")
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=str(workdir / "run" / "checkpoint" / "step-1"), no_dist=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())


def test_export_writes_a_loadable_readable_folder_and_never_into_a_full_one(workdir, monkeypatch, capsys):
    """`apiary export`: files readable as the umask allows (safetensors alone writes 0600), a
    generation_config.json, the tokenizer said; a second export into the same folder exits 2 and
    leaves the first untouched."""
    import os

    from framework.train import published
    from toolkit.cli import apiary_main

    code, out, err = _train(["recipe=debug_dense", "training.steps=1", "training.seq_len=32", "checkpoint.interval=1",
                             "output_dir=run"], workdir, monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    assert apiary_main(["export", "run", "--hf", "exported"]) == 0
    assert "no tokenizer files: the run used the byte-level tokenizer" in capsys.readouterr().out
    mask = os.umask(0)
    os.umask(mask)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (workdir / "exported" / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    before = (workdir / "exported" / "config.json").read_text()
    assert apiary_main(["export", "run", "--hf", "exported"]) == 2
    assert "is not an empty folder" in " ".join(capsys.readouterr().err.split())
    assert (workdir / "exported" / "config.json").read_text() == before
    tok = workdir / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    dest = workdir / "with_tok"
    dest.mkdir()
    assert published.add_hf_extras(dest, {"eos_token_id": 3}, str(tok)) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((dest / "generation_config.json").read_text())["eos_token_id"] == 3


# ---------------------------------------------------------------- bad folders: exit 2, nothing written

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _resave(folder, change):
    from safetensors.torch import save_file

    sd = _sd(folder)
    change(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _bad_folder(kind, hf_dirs, tmp):
    src = hf_dirs / "qwen3_moe"
    d = tmp / kind
    if kind == "corrupt_file":
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
        return d / "model.safetensors", "is a file"
    _copy(src, d)
    if kind == "truncated":
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])
        return d, "model.safetensors is truncated"
    if kind == "corrupt_header":
        (d / "model.safetensors").write_bytes(b"not a safetensors file at all" * 40)
        return d, "is not a safetensors file"
    if kind == "no_weights":
        (d / "model.safetensors").unlink()
        return d, "no *.safetensors weights there"
    if kind == "config_not_json":
        (d / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 32,,}')
        return d, "config.json is not JSON"
    if kind == "missing":
        _resave(d, lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
        return d, "1 tensors missing: model.layers.1.mlp.experts.3.up_proj.weight"
    if kind == "extra":
        _resave(d, lambda sd: sd.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
        return d, "1 tensors the architecture has no place for: model.layers.0.self_attn.extra.weight"
    if kind == "shape":
        _resave(d, lambda sd: sd.update({"model.norm.weight": torch.ones(7)}))
        return d, "1 with the wrong shape: model.norm.weight [7] (the architecture needs [32])"
    if kind == "other_family":
        return hf_dirs / "llama", "model_type=llama, which model.family=qwen3 does not read"
    raise AssertionError(kind)


BAD = ["corrupt_file", "truncated", "corrupt_header", "no_weights", "config_not_json", "missing", "extra", "shape",
       "other_family"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_hf_folders_exit_2_before_launch(hf_dirs, kind, workdir, monkeypatch, capsys):
    path, needle = _bad_folder(kind, hf_dirs, workdir)
    code, out, err = _train(["recipe=debug_moe", f"model.hf_checkpoint={path}", "training.steps=1"], workdir,
                            monkeypatch, capsys)
    assert code == 2, out + err
    msg = " ".join(err.split())
    assert "model.hf_checkpoint=" in msg and needle in msg, msg
    assert "Traceback" not in out + err and not (workdir / "runs").exists()


def test_bad_folder_through_the_console_entry(hf_dirs, workdir):
    path, needle = _bad_folder("truncated", hf_dirs, workdir)
    p = run_cli(["train", f"model.hf_checkpoint={path}"], cwd=workdir)
    assert p.returncode == 2 and needle in " ".join(p.stderr.split()) and "Traceback" not in p.stderr
    assert not (workdir / "runs").exists()


def test_apiary_show_on_an_hf_folder(hf_dirs, capsys):
    from toolkit.cli import apiary_main

    assert apiary_main(["show", str(hf_dirs / "qwen3_moe")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    f = qwen3.facts("tiny_moe", hf_checkpoint=str(hf_dirs / "qwen3_moe"))
    assert "model.family=qwen3" in out and "num_experts=6, top_k=2" in out and "vocab_size=333" in out
    assert f"{f.n_params:,} total" in out and f"{f.n_active_params:,} active" in out
    assert f.n_active_params < f.n_params and "GiB per GPU" in out and "apiary plan recipe=" in out


# ---------------------------------------------------------------- a real (self-trained) tokenizer

def _bpe(folder: Path, vocab: int) -> Path:
    """A byte-level BPE trained on the packaged corpus with `tokenizers` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from components.data.text import PACKAGED_CORPUS

    texts = [json.loads(line)["text"] for line in PACKAGED_CORPUS.read_text().splitlines()[:400]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return folder


def test_hf_tokenizer_packs_trains_and_resumes_bit_for_bit(workdir, monkeypatch, capsys):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from components.data import text

    d = _bpe(workdir / "tok", 300)
    tok = HuggingFaceTokenizer(tokenizer_path=str(d))
    assert tok.get_vocab_size() == 300 and tok.bos_id is not None and tok.eos_id is not None
    # packing: the first window is the BPE encoding of the first documents
    ds = HuggingFaceTextDataset(dataset_name=text.register("packaged", None), dataset_path=None, tokenizer=tok,
                                seq_len=64, infinite=False)
    (first, _), = [next(iter(ds))]
    stream = []
    for line in text.PACKAGED_CORPUS.read_text().splitlines()[:20]:
        stream += tok.encode(json.loads(line)["text"], add_bos=True, add_eos=True)[:-1]
    assert first["input"].tolist() == stream[:64] and max(stream[:64]) >= 258  # BPE merges, not bytes
    # 6 steps with a checkpoint at 3; resuming at 3 reproduces steps 4-6 exactly
    argv = ["recipe=debug_moe", f"data.tokenizer={d}", "training.seq_len=64", "training.local_batch=2",
            "training.steps=6", "checkpoint.interval=3", "recompute=none"]
    code, out, err = _train(argv + ["output_dir=full"], workdir, monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    full = [json.loads(x) for x in (workdir / "full" / "metrics.jsonl").read_text().splitlines()]
    shutil.copytree(workdir / "full", workdir / "resumed")
    shutil.rmtree(workdir / "resumed" / "checkpoint" / "step-6")
    (workdir / "resumed" / "metrics.jsonl").unlink()
    code, out, err = _train(argv + ["output_dir=resumed", "checkpoint.resume=true"], workdir, monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    resumed = [json.loads(x) for x in (workdir / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]


@pytest.mark.parametrize("kind", ["too_big", "no_files", "corrupt"])
def test_bad_tokenizer_folders_exit_2_before_launch(kind, workdir, monkeypatch, capsys):
    if kind == "too_big":
        d, needle = _bpe(workdir / "tok", 400), "the tokenizer has 400 ids (0..399), the model's vocabulary is 320"
    elif kind == "no_files":
        d, needle = workdir / "tok", "the folder holds no tokenizer files"
        d.mkdir()
        (d / "README.md").write_text("tokenizer goes here")
    else:
        d, needle = workdir / "tok", "the tokenizer does not load"
        d.mkdir()
        (d / "tokenizer.json").write_text("{ not json")
    code, out, err = _train(["recipe=debug_moe", f"data.tokenizer={d}"], workdir, monkeypatch, capsys)
    msg = " ".join(err.split())
    assert code == 2 and f"data.tokenizer={d}" in msg and needle in msg, out + err
    assert "Traceback" not in out + err and not (workdir / "runs").exists()


def test_seq_len_beyond_the_checkpoints_rope_length_exits_2(hf_dirs, workdir, monkeypatch, capsys):
    code, out, err = _train(["recipe=debug_moe", f"model.hf_checkpoint={hf_dirs / 'qwen3_moe'}",
                             "training.seq_len=1024"], workdir, monkeypatch, capsys)
    msg = " ".join(err.split())
    assert code == 2 and "training.seq_len=1024: exceeds the model's RoPE length 512" in msg, out + err
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("family,change,needle", [
    (qwen3, dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e6, factor=4.0)), "rope type 'dynamic'"),
    (qwen3, dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, mscale=1.0, mscale_all_dim=1.0)),
     "yarn RoPE with mscale"),
    (qwen3, dict(attention_bias=True), "attention_bias=true"),
    (qwen3, dict(use_sliding_window=True), "use_sliding_window=true"),
    (qwen3, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0]),
     "dense layers between MoE layers"),
    (llama3, dict(model_type="llama", rope_parameters=dict(rope_type="dynamic", rope_theta=1e4)), "rope type 'dynamic'"),
    (llama3, dict(model_type="llama", mlp_bias=True), "mlp_bias=true"),
    (llama3, dict(model_type="llama", hidden_act="gelu"), "hidden_act=gelu"),
])
def test_architecture_features_apiary_cannot_build_are_refused(family, change, needle):
    c = dict(model_type="qwen3", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, intermediate_size=64)
    c.update(change)
    with pytest.raises(UserError, match="apiary cannot build this architecture") as e:
        family.arch_from_hf(c)
    assert needle in str(e.value)


def test_packaged_recipes_leave_n_layers_and_vocab_size_to_the_user():
    """With hf_checkpoint, a non-None model.n_layers / model.vocab_size is taken as the user's explicit
    setting (checked against the checkpoint), so no packaged recipe may set them."""
    import yaml

    from framework.compose import recipes

    # a recipe that ships a truncated model on purpose (a measurement's width x a few layers; with an
    # hf_checkpoint added it loads the checkpoint's first layers, as model.n_layers says)
    truncated = {"qwen35_35b_4l_grpo_vllm"}
    for name in recipes.recipe_names():
        model = (yaml.safe_load(recipes.recipe_path(name).read_text()) or {}).get("model") or {}
        assert "vocab_size" not in model and ("n_layers" not in model or name in truncated), name
