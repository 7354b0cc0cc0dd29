"""moe.lean_combine: the MoE combine's score multiply without fp32 copies (components/moe/lean_combine.py),
paired with torchtitan's expression (``score_rows_reference``) bit for bit."""

import json
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import read_metrics, run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.moe.lean_combine import score_rows, score_rows_reference  # noqa: E402


def _grads(fn, out, scores, g):
    out = out.detach().clone().requires_grad_(True)
    scores = scores.detach().clone().requires_grad_(True)
    y = fn(out, scores)
    y.backward(g)
    return y, out.grad, scores.grad


@pytest.mark.parametrize("rows,dim,block,dtype", [(50, 64, 7, torch.bfloat16), (64, 128, 64, torch.bfloat16),
                                                  (33, 96, 1000, torch.float16), (40, 32, 16, torch.float32)])
def test_forward_and_both_gradients_equal_torchtitans_expression_bitwise(rows, dim, block, dtype):
    gen = torch.Generator().manual_seed(rows * dim)
    out = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    scores = torch.rand(rows, generator=gen)  # fp32, as the router returns them
    g = torch.randn(rows, dim, generator=gen).to(dtype)
    got = _grads(lambda o, s: score_rows(o, s, block=block), out, scores, g)
    ref = _grads(score_rows_reference, out, scores, g)
    for a, b, what in zip(got, ref, ("output", "grad of the expert outputs", "grad of the scores")):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max()}"


def _saved(fn, out, scores):
    saved = []

    def pack(t):
        saved.append((str(t.dtype), tuple(t.shape)))
        return t

    out = out.clone().requires_grad_(True)
    scores = scores.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(out, scores)
    return saved


def test_it_saves_the_bf16_outputs_not_an_fp32_copy():
    out, scores = torch.randn(48, 32).bfloat16(), torch.rand(48)
    lean = _saved(lambda o, s: score_rows(o, s, block=16), out, scores)
    ref = _saved(score_rows_reference, out, scores)
    assert ("torch.float32", (48, 32)) in ref  # torchtitan's expression keeps the fp32 copy for the score grad
    assert sorted(lean) == sorted([("torch.bfloat16", (48, 32)), ("torch.float32", (48,))])


def test_other_layouts_fall_back_to_the_expression():
    out, scores = torch.randn(4, 6, 8).bfloat16(), torch.rand(24)
    assert torch.equal(score_rows(out.reshape(24, 8), scores), score_rows_reference(out.reshape(24, 8), scores))
    half_scores = torch.rand(24).half()
    assert torch.equal(score_rows(out.reshape(24, 8), half_scores),
                       score_rows_reference(out.reshape(24, 8), half_scores))


def test_explicit_true_is_refused_where_it_cannot_run():
    from omegaconf import OmegaConf

    from components.moe.chunk import AutoChunk, NoChunk
    from framework.compose.schema import MoEConfig
    from framework.contracts import make_options
    from framework.errors import UserError

    def ctx(backend, ep):
        return SimpleNamespace(components={"moe_comm": SimpleNamespace(torchtitan_backend=backend)},
                               layout=SimpleNamespace(ep=ep))

    def opts(policy, **kw):
        return make_options(policy, OmegaConf.structured(MoEConfig(load_balance_coeff=None, **kw)))

    with pytest.raises(UserError, match="standard all-to-all"):
        NoChunk.check(opts(NoChunk, comm="deepep", chunk="none", lean_combine=True), ctx("deepep", 2))
    for ep in (1, 4):  # torchtitan's standard combine at any EP size
        NoChunk.check(opts(NoChunk, comm="alltoall", chunk="none", lean_combine=True), ctx("standard", ep))
    AutoChunk.check(opts(AutoChunk, comm="alltoall", chunk="auto", lean_combine=True), ctx("standard", 4))
    for value in (None, False):  # unset: where it runs; false: torchtitan's expression everywhere
        NoChunk.check(opts(NoChunk, comm="deepep", chunk="none", lean_combine=value), ctx("deepep", 4))


RUNNER = textwrap.dedent("""
    import json, os, sys
    from components.moe import lean_combine
    from framework.train import run
    from framework.resolve.resolver import resolve
    calls = [0]
    original = lean_combine.score_rows
    def counted(*a, **k):
        calls[0] += 1
        return original(*a, **k)
    lean_combine.score_rows = counted
    base, name, value, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    r = resolve("debug_moe", [f"moe.lean_combine={value}", "training.steps=2", f"output_dir={base}/{name}",
                              "checkpoint.enable=false", "model.n_layers=2", "training.seq_len=64",
                              "training.local_batch=2", "logging.tensorboard=false", "recompute=full", *extra])
    assert r.layout.ep == (2 if extra else 1), r.layout.ep
    run.train(r, report=False)
    rank = os.environ.get("RANK", "0")
    open(f"{base}/{name}/calls{rank}.json", "w").write(json.dumps(calls[0]))
""")


@pytest.mark.parametrize("nproc,extra", [(1, []), (2, ["parallel.ep=2"])], ids=["ep1", "ep2"])
def test_training_with_it_equals_training_without_bitwise(tmp_path, nproc, extra):
    """The CPU trainer (torchtitan's MoE, full recompute; one rank, and two ranks with FSDP2 and EP 2,
    where torchtitan's standard EP combine runs under its default spmd_types backend): the lean combine
    runs in every MoE layer's forward and recompute, and the losses equal moe.lean_combine=false's bit
    for bit."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    pair = (("lean", "null"), ("plain", "false"))
    with ThreadPoolExecutor(2) as pool:  # side by side (mostly start-up time), one thread each
        procs = list(pool.map(lambda nv: run_ranks(script, [tmp_path, *nv, *extra], nproc, cwd=tmp_path,
                                                   env={"APIARY_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}), pair))
    for (name, _), proc in zip(pair, procs):
        assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr[-4000:])
        for rank in range(nproc):
            calls = json.loads((tmp_path / name / f"calls{rank}.json").read_text())
            assert calls == (2 * 2 * 2 if name == "lean" else 0), (name, rank, calls)  # 2 steps x 2 layers x 2
    lean, plain = read_metrics(tmp_path / "lean"), read_metrics(tmp_path / "plain")
    assert [r["loss"] for r in lean] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in lean] == [r["grad_norm"] for r in plain]
