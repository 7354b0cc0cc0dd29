"""Bad input, second pass: data files (a byte-order mark, whitespace, too little text), HF folders
(impossible sizes in config.json, integer or NaN weights), checkpoint steps without a manifest
(resume, load_path, apiary export, apiary logprobs) and host memory for CPU runs. Each refusal: exit
2, one paragraph naming the file or key, no traceback, nothing written (docs/reliability.md, "Bad
input, second pass")."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from framework import devices

devices.install()  # before torchtitan is imported (CPU shims), as the trainer does

from framework.errors import UserError  # noqa: E402

TINY = ["training.seq_len=32", "training.local_batch=1", "checkpoint.enable=false", "logging.tensorboard=false"]
BOM = b"\xef\xbb\xbf"
DOC = "bees make honey from nectar and wax from their own bodies; "


def _train(argv, capsys):
    """The `train` console entry in this process: (exit code, stdout, stderr as one line)."""
    from framework.cli import train_main

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    threads = torch.get_num_threads()
    try:
        code = train_main(argv)
    finally:
        torch.set_num_threads(threads)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())


def _refused(code, out, err, *needles, run="run"):
    assert code == 2, out[-2000:] + err[-2000:]
    for n in needles:
        assert n in err, f"{n!r} not in: {err}"
    assert err.count("error apiary:") == 1 and "Traceback" not in out + err
    assert not Path(run).exists() and not Path("runs").exists()


# ---------------------------------------------------------------- 1. a UTF-8 byte-order mark


def test_a_byte_order_mark_trains_and_is_not_part_of_the_text(workdir, one_thread, capsys):
    """jsonl and txt files that start with a BOM: the pre-launch check and the loader read them alike
    (was: checked, then a loader ValueError traceback in the worker); the first window's bytes are the
    first record's text, without the mark."""
    from components.data.local_text import inspect_local
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    docs = [f"{i}: {DOC * 3}" for i in range(12)]
    jl = workdir / "bom.jsonl"
    jl.write_bytes(BOM + "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    txt = workdir / "bom.txt"
    txt.write_bytes(BOM + "\n".join(docs).encode())
    for f in (jl, txt):
        s = inspect_local(str(f))
        assert (s.documents, s.text_bytes) == (12, sum(len(d.encode()) for d in docs)), f  # the mark is no text
        r = resolve(None, [f"data.path={f}", "training.seq_len=64", "training.local_batch=2"])
        tc = trainer_config(r)
        tok = tc.tokenizer.build(tokenizer_path=tc.hf_assets_path)
        dl = tc.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=64, local_batch_size=2)
        ids = next(iter(dl))[0]["input"][0].tolist()
        assert bytes(ids[1:64]) == docs[0].encode()[:63], f  # BOS, then the text's first bytes
    code, out, err = _train([f"data.path={jl}", "training.steps=1", "output_dir=run", *TINY], capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    assert [json.loads(x)["step"] for x in (workdir / "run" / "metrics.jsonl").read_text().splitlines()] == [1]
    # a JSON array file with a mark: the loader cannot read one, so it is refused naming the file
    arr = workdir / "arr.json"
    arr.write_bytes(BOM + json.dumps([{"text": d} for d in docs]).encode())
    code, out, err = _train([f"data.path={arr}", "output_dir=arr_run", *TINY], capsys)
    _refused(code, out, err, f"data.path={arr}", "byte-order mark", "as .jsonl", run="arr_run")


# ---------------------------------------------------------------- 2. nothing, or too little, to train on


@pytest.mark.parametrize("name,content,needles", [
    ("blank.txt", b"   \n\n \t \n", ["all 3 documents are empty or whitespace only", "nothing to train on"]),
    ("empty_texts.jsonl", b'{"text": ""}\n{"text": "  "}\n{"text": "\\n"}\n',
     ["all 3 documents are empty or whitespace only"]),
    ("five.txt", b"abcd\n", ["holds 6 tokens", "fewer than one optimizer step trains on",
                             "training.local_batch=1 x 1 data-parallel rank(s) = 1 sequences x training.seq_len=32 = "
                             "32 tokens", "Add text (at least 32 tokens)"]),
])
def test_too_little_text_is_refused_before_launch(workdir, capsys, name, content, needles):
    """Whitespace-only or all-empty documents, or fewer tokens than one step trains on (was: trained,
    the loader re-looping the file hundreds of times per step with a warning each time)."""
    (workdir / name).write_bytes(content)
    code, out, err = _train([f"data.path={name}", "output_dir=run", *TINY], capsys)
    _refused(code, out, err, f"data.path={name}", *needles)


def test_the_minimum_is_one_step_of_tokens_and_the_packaged_corpus_is_exempt(workdir):
    from framework.resolve.resolver import resolve

    (workdir / "d.txt").write_text("x" * 30 + "\n")  # 30 bytes + BOS + EOS = 32 tokens
    resolve(None, ["data.path=d.txt", *TINY])  # exactly one step (1 x 32): accepted
    with pytest.raises(UserError, match=r"holds 32 tokens .* training.global_batch=2 x training.seq_len=32 = 64 tok"):
        resolve(None, ["data.path=d.txt", *TINY, "training.global_batch=2"])
    # benchmarks re-loop the packaged corpus (251K tokens) on purpose: a 512K-token step is not refused
    resolve(None, ["training.seq_len=256", "training.local_batch=2048", "preflight.memory=off"])


# ---------------------------------------------------------------- 3-5. HF folders


def _hf_folder(d: Path, change=None) -> Path:
    """A tiny qwen3 (dense) HF folder written by hand: config.json and model.safetensors."""
    from safetensors.torch import save_file

    V, D, H, KV, hd, F = 260, 32, 2, 1, 16, 64
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g) * 0.05

    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": torch.ones(D), "lm_head.weight": r(V, D)}
    p = "model.layers.0."
    t.update({p + "input_layernorm.weight": torch.ones(D), p + "post_attention_layernorm.weight": torch.ones(D),
              p + "self_attn.q_proj.weight": r(H * hd, D), p + "self_attn.k_proj.weight": r(KV * hd, D),
              p + "self_attn.v_proj.weight": r(KV * hd, D), p + "self_attn.o_proj.weight": r(D, H * hd),
              p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
              p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D), p + "mlp.down_proj.weight": r(D, F)})
    c = dict(model_type="qwen3", vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
             num_key_value_heads=KV, head_dim=hd, intermediate_size=F, max_position_embeddings=512, rope_theta=1e4,
             tie_word_embeddings=False, rms_norm_eps=1e-6)
    if change:
        change(c, t)
    d.mkdir(parents=True)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize("change,needles", [
    (dict(vocab_size=-5), ["vocab_size=-5 (must be an integer >= 1)"]),
    (dict(hidden_size=0, num_hidden_layers=-1), ["hidden_size=0 (must be an integer >= 1)",
                                                 "num_hidden_layers=-1 (must be an integer >= 1)"]),
    (dict(model_type="qwen3_moe", num_experts=0, num_experts_per_tok=2, moe_intermediate_size=16),
     ["num_experts=0 (must be an integer >= 1 in an MoE model, model_type=qwen3_moe)"]),
    (dict(num_key_value_heads=3, head_dim="16"), ["head_dim=\"16\" (must be an integer >= 1)",
                                                  "num_attention_heads=2 with num_key_value_heads=3"]),
])
def test_impossible_sizes_in_config_json_are_refused(workdir, capsys, change, needles):
    """A config.json with a negative or zero size (was: a traceback from deep inside torch): exit 2
    naming the file and every bad field, before launch."""
    d = _hf_folder(workdir / "m", lambda c, t: c.update(change))
    code, out, err = _train([f"model.hf_checkpoint={d}", "output_dir=run", *TINY], capsys)
    _refused(code, out, err, f"model.hf_checkpoint={d}", f"{d}/config.json has", *needles)


def test_integer_weights_are_refused_from_the_header(workdir, capsys):
    """An int32 lm_head.weight (was: loaded as zeros; step-1 loss ln(vocab)): refused before launch
    from the safetensors header, naming the tensor, its dtype and the file."""
    d = _hf_folder(workdir / "m", lambda c, t: t.update({"lm_head.weight": torch.zeros(260, 32, dtype=torch.int32)}))
    code, out, err = _train([f"model.hf_checkpoint={d}", "output_dir=run", *TINY], capsys)
    _refused(code, out, err, f"model.hf_checkpoint={d}", "lm_head.weight (I32 in model.safetensors)",
             "not floating point")


def test_a_nan_weight_is_refused_at_load_not_blamed_on_the_learning_rate(workdir, one_thread, capsys):
    """A NaN in a checkpoint tensor (was: exit 76 at step 1, the message suggesting a lower learning
    rate): refused as the model loads, before step 1, naming the tensor and the file; no checkpoint
    and no metrics are written. An Inf is refused the same way."""
    from components.models.hf import check_finite

    def nan(c, t):
        t["model.layers.0.mlp.up_proj.weight"][3, 4] = float("nan")

    d = _hf_folder(workdir / "m", nan)
    code, out, err = _train([f"model.hf_checkpoint={d}", "training.steps=1", "output_dir=run", *TINY], capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    assert (f"model.hf_checkpoint={d}: tensor model.layers.0.mlp.up_proj.weight in model.safetensors holds 1 NaN "
            "or Inf value(s)" in err) and "not the learning rate's" in err, err
    assert "Traceback" not in out + err and "step     1" not in out
    assert not (workdir / "run" / "metrics.jsonl").exists() and not (workdir / "run" / "checkpoint").exists()
    with pytest.raises(UserError, match=r"tensor w in f.safetensors holds 2 NaN or Inf value\(s\) \(of 6\)"):
        check_finite(torch.tensor([1.0, float("inf"), 0.0, float("-inf"), 2.0, 3.0], dtype=torch.bfloat16), "w",
                     "f.safetensors", "x")
    check_finite(torch.zeros(3, dtype=torch.float16), "w", "f.safetensors", "x")


# ---------------------------------------------------------------- 6. a checkpoint step without its manifest


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    """A debug_moe seed run (step-0 with its manifest), written once in this process."""
    from framework.cli import train_main

    base = tmp_path_factory.mktemp("seed")
    here = os.getcwd()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        os.chdir(base)
        assert train_main(["checkpoint.create_seed=true", "output_dir=seed", "training.steps=4",
                           "training.seq_len=32", "training.local_batch=1", "logging.tensorboard=false"]) == 0
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
    assert (base / "seed" / "checkpoint" / "step-0" / "manifest.json").is_file()
    return base / "seed"


def _files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


RESUME = ["checkpoint.resume=true", "training.steps=4", "training.seq_len=32", "training.local_batch=1",
          "logging.tensorboard=false"]


@pytest.fixture
def unverified_env(monkeypatch):
    """A resume that verified a step records it in the environment for its workers: undone after."""
    from framework.train import integrity

    monkeypatch.setenv(integrity.VERIFIED_ENV, "")


def test_a_step_without_its_manifest_is_refused_on_resume(seed_run, workdir, capsys, unverified_env):
    """manifest.json deleted and 64 KiB of the .distcp zeroed (was: resumed unverified, exit 0): exit 2
    naming the step, the missing manifest and both ways out; nothing on disk changes. With an earlier
    step that has its manifest, the way out is checkpoint.load_step=N, which then resolves."""
    from framework.resolve.resolver import resolve

    run = workdir / "r"
    shutil.copytree(seed_run, run)
    step0 = run / "checkpoint" / "step-0"
    (step0 / "manifest.json").unlink()
    distcp = next(step0.glob("*.distcp"))
    with open(distcp, "r+b") as f:
        f.write(b"\0" * 65536)
    before = _files(run)
    code, out, err = _train([f"output_dir={run}", *RESUME], capsys)
    assert code == 2 and f"checkpoint {step0} has no manifest.json, so it cannot be verified" in err, out + err
    assert "No earlier step has a manifest either" in err and "checkpoint.verify=false" in err
    assert "Traceback" not in out + err and _files(run) == before
    # the explicit opt-in: loads it, and the run's first lines say it is not verified
    r = resolve(None, [f"output_dir={run}", *RESUME, "checkpoint.verify=false"])
    assert r.resume_lines[0].startswith(f"resume: {step0} has no manifest.json (checkpoint.verify=false: NOT verified)")
    assert "checkpoint.verify True -> False" in r.resume_lines[1]
    # a later step without its manifest, an earlier one with: the way out names it
    run2 = workdir / "r2"
    shutil.copytree(seed_run, run2)
    shutil.copytree(run2 / "checkpoint" / "step-0", run2 / "checkpoint" / "step-2")
    (run2 / "checkpoint" / "step-2" / "manifest.json").unlink()
    code, out, err = _train([f"output_dir={run2}", *RESUME], capsys)
    assert code == 2 and "step-2 has no manifest.json" in err and "checkpoint.load_step=0" in err, err
    assert resolve(None, [f"output_dir={run2}", *RESUME, "checkpoint.load_step=0"]).resume_lines[0].startswith(
        f"resume: {run2 / 'checkpoint' / 'step-0'} verified against its manifest")


def test_load_path_export_and_logprobs_refuse_a_step_without_its_manifest(seed_run, workdir, capsys, unverified_env):
    """checkpoint.load_path, `apiary export` and `apiary logprobs` read a step too (was: unverified,
    silently; export and logprobs did not verify even a step with a manifest): exit 2 naming the
    step and the opt-in (checkpoint.verify=false, --unverified); nothing written. A step whose bytes
    changed is refused by export as by resume."""
    from framework.resolve.resolver import resolve
    from toolkit.cli import apiary_main

    run = workdir / "r"
    shutil.copytree(seed_run, run)
    step0 = run / "checkpoint" / "step-0"
    (step0 / "manifest.json").unlink()
    small = ["training.seq_len=32", "training.local_batch=1", "logging.tensorboard=false"]
    code, out, err = _train([f"checkpoint.load_path={step0}", "output_dir=fresh", *small], capsys)
    _refused(code, out, err, f"checkpoint.load_path={step0}: has no manifest.json", "checkpoint.verify=false",
             run="fresh")
    resolve(None, [f"checkpoint.load_path={step0}", "output_dir=fresh", *small, "checkpoint.verify=false"])

    rollouts = workdir / "ro.jsonl"
    rollouts.write_text(json.dumps({"input_ids": [256, 104, 105, 257], "loss_mask": [0, 1, 1, 1],
                                    "old_logprobs": [0.0] * 4, "advantage": 1.0}) + "\n")
    for argv, opt_in in ((["export", str(run), "--hf", "out"], "--unverified"),
                         (["logprobs", str(run), str(rollouts), "--out", "out"], "--unverified")):
        assert apiary_main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert f"checkpoint {step0} has no manifest.json" in err and opt_in in err, err
        assert "Traceback" not in err and not (workdir / "out").exists()
    assert apiary_main(["export", str(run), "--hf", "out", "--unverified"]) == 0
    assert (workdir / "out" / "model.safetensors").is_file()
    # a changed byte under an intact manifest: export verifies it as a resume would
    run2 = workdir / "r2"
    shutil.copytree(seed_run, run2)
    distcp = next((run2 / "checkpoint" / "step-0").glob("*.distcp"))
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 1
    distcp.write_bytes(bytes(data))
    assert apiary_main(["export", str(run2), "--hf", "out2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "checkpoint step 0 is corrupt" in err and distcp.name in err and not (workdir / "out2").exists()


# ---------------------------------------------------------------- 7. host memory of a CPU run


def test_a_cpu_run_that_cannot_fit_the_hosts_memory_is_refused(workdir, capsys, monkeypatch):
    """training.local_batch=100000 on CPU (was: the worker died in the allocator): the planner's CPU
    estimate for every rank against the host's available memory, refused before launch with the
    largest terms and a local batch that fits; debug_moe's own runs fit a small host."""
    from framework.plan import preflight
    from framework.resolve.resolver import resolve

    GiB = 2**30
    monkeypatch.setattr(preflight, "host_memory_available", lambda: (8 * GiB, "a test's 8 GiB"))
    with monkeypatch.context() as m, pytest.raises(UserError, match="preflight.memory=refuse"):
        m.setattr(preflight, "_batch_that_fits", lambda *a: "")  # a guard first: a regression never trains it
        resolve(None, ["training.local_batch=100000", "output_dir=run"])
    code, out, err = _train(["training.local_batch=100000", "output_dir=run", "training.steps=1"], capsys)
    _refused(code, out, err, "preflight.memory=refuse: the planner estimates", "GiB of host memory for this CPU run",
             "8.0 GiB available (a test's 8 GiB)", "largest terms (GiB): ",
             "A local batch that fits: training.local_batch=")
    fit = int(err.split("training.local_batch=")[-1].split()[0])
    r = resolve(None, [f"training.local_batch={fit}"], for_training=False)
    assert preflight.cpu_estimate(r)[0] * 1.1 <= 8 * GiB
    # the default recipe and the suite's CPU runs: about 1 GiB per rank (0.9 GiB of process + terms)
    r = resolve(None, [], for_training=False)
    total, per_rank, _ = preflight.cpu_estimate(r)
    assert 0.9 * GiB <= per_rank < 1.2 * GiB and total == per_rank
    r2 = resolve(None, ["launcher.nproc=2"], for_training=False)
    assert preflight.cpu_estimate(r2)[0] == 2 * preflight.cpu_estimate(r2)[1]
    monkeypatch.setattr(preflight, "host_memory_available", lambda: (3 * GiB, "a test's 3 GiB"))
    resolve(None, ["launcher.nproc=2", "output_dir=run"])  # 2 ranks of debug_moe fit 3 GiB
    # within the measured error: a warning; above it: refused, unless preflight.memory=warn|off
    monkeypatch.setattr(preflight, "host_memory_available", lambda: (total, "a test's"))
    resolve(None, ["output_dir=run"])
    assert "warning memory:" in " ".join(capsys.readouterr().err.split())
    monkeypatch.setattr(preflight, "host_memory_available", lambda: (1 * GiB, "a test's 1 GiB"))
    # two ranks' processes alone (0.9 GiB each) exceed 1 GiB: no batch or length fits; one rank might
    # (was: "No local batch fits at this training.seq_len"; tests/test_static_memory_fit.py)
    with pytest.raises(UserError, match="preflight.memory=refuse.*at any training.seq_len.*fewer ranks"):
        resolve(None, ["launcher.nproc=2", "output_dir=run"])
    resolve(None, ["launcher.nproc=2", "output_dir=run", "preflight.memory=off"])
    resolve(None, ["launcher.nproc=2", "output_dir=run", "preflight.memory=warn"])
    assert not (workdir / "run").exists()
    monkeypatch.undo()
    real = preflight.host_memory_available()  # this machine's: MemAvailable (or a cgroup's limit)
    assert real is None or (real[0] > 0 and real[1])


@pytest.mark.slow
def test_a_nan_weight_with_two_ranks_is_said_once_without_a_traceback(workdir):
    """nproc=2: every rank finds the NaN as it loads; rank 0 prints the paragraph once, the others
    wait for it, and torchrun's report of the ranks' exit 2 is not printed as a traceback."""
    from conftest import run_cli

    def nan(c, t):
        t["lm_head.weight"][0, 0] = float("nan")

    d = _hf_folder(workdir / "m", nan)
    p = run_cli(["train", f"model.hf_checkpoint={d}", "nproc=2", "training.steps=1", "output_dir=run", *TINY],
                cwd=workdir, timeout=300)
    err = " ".join(p.stderr.split())
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert err.count("tensor lm_head.weight in model.safetensors holds 1 NaN") == 1, err
    assert "Traceback" not in p.stdout + p.stderr and not (workdir / "run" / "metrics.jsonl").exists()
