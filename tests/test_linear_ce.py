"""linear_ce: fused LM head + cross-entropy against an fp64 reference (torch path on CPU,
Triton through its interpreter, Triton on CUDA when present), vocabulary sharding over gloo,
and the trainer end to end against `ce` (same loss trajectory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from components.losses.linear_ce import LinearCrossEntropy, linear_cross_entropy
from components.losses.lm_head import engine

from conftest import (
    IGN,
    ROOT,
    TRAJ_LOSS_REL,
    TRAJ_NORM_REL,
    assert_rel,
    assert_same_trajectory,
    free_port,
    lm_head_data,
    read_metrics,
    rel_err,
    run_in_triton_interpreter,
    run_ranks,
    spawn_ranks,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(h, w, labels, *, z_loss=0.0, label_smoothing=0.0, reduction="sum"):
    """Materialised fp64 logits and torch's cross-entropy (+ z-loss): the formula, spelled out."""
    logits = h.double() @ w.double().T
    per = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGN, label_smoothing=label_smoothing)
    valid = labels != IGN
    per = per + z_loss * torch.logsumexp(logits, dim=1) ** 2 * valid
    if reduction == "none":
        return per
    return per.sum() if reduction == "sum" else per.sum() / valid.sum()


def _grads(fn, h, w, labels, upstream=None, **kw):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    out = fn(h, w, labels, **kw)
    (out if upstream is None else (out * upstream.to(out.dtype)).sum()).backward()
    return out.detach(), h.grad, w.grad


CASES = [
    # n, H, V, dtype, z_loss, smoothing, reduction, loss_rel, grad_rel
    (37, 16, 248_321, torch.float32, 0.0, 0.0, "sum", 1e-6, 1e-5),
    (37, 16, 248_321, torch.bfloat16, 1e-3, 0.0, "mean", 1e-6, 1e-2),
    (130, 24, 1_003, torch.float32, 1e-2, 0.1, "mean", 1e-6, 1e-5),
    (67, 40, 517, torch.float32, 0.0, 0.2, "none", 1e-6, 1e-5),
]


@pytest.mark.parametrize("n,hd,v,dtype,z,eps,red,loss_rel,grad_rel", CASES)
def test_torch_path_matches_fp64_reference(n, hd, v, dtype, z, eps, red, loss_rel, grad_rel):
    h, w, labels = lm_head_data(n, hd, v, dtype)
    up = torch.randn(n, generator=torch.Generator().manual_seed(1)) if red == "none" else None
    # chunks that divide neither the tokens nor the vocabulary
    got = _grads(linear_cross_entropy, h, w, labels, up, z_loss=z, label_smoothing=eps, reduction=red,
                 backend="torch", chunk_tokens=17, chunk_vocab=4099 if v > 10_000 else 97)
    ref = _grads(lambda a, b, c: reference(a, b, c, z_loss=z, label_smoothing=eps, reduction=red),
                 h.double(), w.double(), labels, up)
    assert_rel(got[0], ref[0], loss_rel)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    assert_rel(got[1], ref[1], grad_rel)
    assert_rel(got[2], ref[2], grad_rel)


def test_ignored_tokens_have_no_loss_and_no_gradient():
    h, w, labels = lm_head_data(20, 8, 50, torch.float32, n_ignored=7)
    per, dh, dw = _grads(linear_cross_entropy, h, w, labels, torch.ones(20), reduction="none", backend="torch")
    ign = labels == IGN
    assert ign.sum() == 7
    assert torch.all(per[ign] == 0) and torch.all(per[~ign] > 0)
    assert torch.all(dh[ign] == 0) and torch.all(dh[~ign].abs().sum(1) > 0)
    # all ignored: sum is 0, mean is NaN (torch's convention)
    none = torch.full_like(labels, IGN)
    assert linear_cross_entropy(h, w, none, backend="torch").item() == 0.0
    assert torch.isnan(linear_cross_entropy(h, w, none, reduction="mean", backend="torch"))
    assert torch.isnan(F.cross_entropy(h @ w.T, none, reduction="mean"))


def test_frozen_weight_skips_weight_gradient_pass(monkeypatch):
    seen = []
    orig = engine._torch_grads

    def spy(*a):
        seen.append((a[-4], a[-3]))  # need_dh, need_dw
        return orig(*a)

    monkeypatch.setattr(engine, "_torch_grads", spy)
    h, w, labels = lm_head_data(9, 8, 30, torch.float32)
    hh = h.clone().requires_grad_(True)
    linear_cross_entropy(hh, w, labels, backend="torch").backward()
    assert seen == [(True, False)] and hh.grad is not None
    ww = w.clone().requires_grad_(True)
    linear_cross_entropy(h, ww, labels, backend="torch").backward()
    assert seen[-1] == (False, True) and ww.grad is not None
    with torch.no_grad():
        linear_cross_entropy(hh, ww, labels, backend="torch")
    assert len(seen) == 2  # no backward work without a backward


def test_sequence_sharding_sums_local_tokens_then_divides_by_global_count():
    """CP/DP: each shard sums its own tokens; dividing by the global valid count gives the mean."""
    h, w, labels = lm_head_data(40, 8, 64, torch.float32, n_ignored=9)
    parts = [linear_cross_entropy(h[i::3], w, labels[i::3], backend="torch") for i in range(3)]
    total = sum(parts) / (labels != IGN).sum()
    assert_rel(total, reference(h, w, labels, reduction="mean"), 1e-6)


def test_auto_backend_on_cpu_is_torch():
    assert engine.auto_backend(torch.zeros(1)) == "torch"
    assert engine.check_backend("auto", torch.zeros(1)) == "torch"


def test_options_are_validated():
    with pytest.raises(ValueError, match="label_smoothing"):
        LinearCrossEntropy.Options(label_smoothing=1.0)
    with pytest.raises(ValueError, match="backend"):
        LinearCrossEntropy.Options(backend="cuda")
    # each rule once, in __post_init__ (check() does not rerun it): building the options refuses the value
    for key, bad, refusal in (("z_loss", -1.0, "z_loss"), ("chunk_tokens", 0, "chunk_tokens"),
                              ("dw_accum", "fp8", "dw_accum")):
        with pytest.raises(ValueError, match=refusal):
            LinearCrossEntropy.Options(**{key: bad})
    LinearCrossEntropy.check(LinearCrossEntropy.Options(), None)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), reduction="avg")


# --- vocabulary sharding over gloo (2 processes) --------------------------------------------


def _sharded_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from components.losses.logprob import token_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    h, w, labels = lm_head_data(29, 12, 1001, torch.float32, seed=3)
    cut = [0, 480, 1001]  # uneven, contiguous in rank order
    wl = w[cut[rank]:cut[rank + 1]]
    res = {}
    for name, fn in {
        "ce": lambda a, b, c, **k: linear_cross_entropy(a, b, c, z_loss=1e-2, label_smoothing=0.1, **k),
        "lp": lambda a, b, c, **k: (lambda lp, ent: lp * 0.7 + ent * 0.3)(
            *token_logprobs(a, b, c, temperature=0.8, with_entropy=True, **k)).sum(),
    }.items():
        out, dh, dw = _grads(fn, h, wl, labels, vocab_group=dist.group.WORLD, backend="torch")
        res[name] = {"loss": out.item(), "dh": dh.tolist(), "dw": dw.tolist()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_sharded_over_two_gloo_ranks_matches_unsharded(tmp_path):
    spawn_ranks(_sharded_worker, 2, 2, free_port(), str(tmp_path))
    h, w, labels = lm_head_data(29, 12, 1001, torch.float32, seed=3)
    ref_ce = _grads(lambda a, b, c: reference(a, b, c, z_loss=1e-2, label_smoothing=0.1), h.double(), w.double(),
                    labels)

    def lp_ref(a, b, c):
        ls = torch.log_softmax(a @ b.T / 0.8, dim=1)
        lp = ls.gather(1, c.clamp_min(0)[:, None]).squeeze(1) * (c != IGN)
        ent = -(ls.exp() * ls).sum(1)
        return (lp * 0.7 + ent * 0.3).sum()

    ref_lp = _grads(lp_ref, h.double(), w.double(), labels)
    cut = [0, 480, 1001]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, ref in (("ce", ref_ce), ("lp", ref_lp)):
            # fp32 against fp64: a logsumexp over <= 521 columns per rank, merged over 2, summed
            # over 29 tokens -- a few hundred u (6e-8) at worst; the sharding adds one more merge
            assert got[name]["loss"] == pytest.approx(ref[0].item(), rel=1e-5)
            assert_rel(torch.tensor(got[name]["dh"]), ref[1], 1e-5)  # full hidden gradient on every rank
            assert_rel(torch.tensor(got[name]["dw"]), ref[2][cut[rank]:cut[rank + 1]], 1e-5)


# --- the torchtitan loss under FSDP2 on 2 gloo ranks (the trainer's lm_head protocol) ---------


class _TinyDecoder(torch.nn.Module):
    """Decoder stand-in: a block, the final norm, and an lm_head the loss applies itself."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 12)
        self.norm = torch.nn.RMSNorm(12)
        self.lm_head = torch.nn.Linear(12, 301, bias=False)

    def forward(self, x):
        return self.norm(self.proj(x))


def _fsdp_worker(rank, world, port, out_dir):
    from framework import devices

    devices.install()
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from components.losses.linear_ce import fused_loss_class

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _TinyDecoder()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard([model.norm, model.lm_head])  # torchtitan groups norm with lm_head
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            m.set_gradient_divide_factor(1.0)  # as torchtitan: the loss is already / global tokens
    x, _, labels = lm_head_data(2 * 16, 12, 301, torch.float32, seed=11, n_ignored=5)
    x, labels = x.reshape(2, 1, 16, 12), labels.reshape(2, 1, 16)
    gvt = (labels != IGN).sum()
    loss_fn = fused_loss_class().Config(z_loss=1e-3, backend="torch").build()
    loss_fn.set_lm_head(model.lm_head)

    def forward():
        return loss_fn(model(x[rank]), labels[rank], gvt)[0]

    for _ in range(2):  # twice: FSDP state must be clean after the first step
        model.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
    dist.all_reduce(loss.detach())
    grads = {k: p.grad.full_tensor().tolist() for k, p in model.named_parameters()}
    Path(out_dir, f"fsdp{rank}.json").write_text(json.dumps({"loss": loss.item(), "grads": grads, "full": {
        k: v.tolist() for k, v in full.items()}}))
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_two_gloo_ranks_loss_and_gradients(tmp_path):
    spawn_ranks(_fsdp_worker, 2, 2, free_port(), str(tmp_path))
    got = [json.loads((tmp_path / f"fsdp{r}.json").read_text()) for r in range(2)]
    model = _TinyDecoder()
    model.load_state_dict({k: torch.tensor(v) for k, v in got[0]["full"].items()})
    x, _, labels = lm_head_data(2 * 16, 12, 301, torch.float32, seed=11, n_ignored=5)
    logits = model.lm_head(model(x))
    per = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGN) + 1e-3 * (
        torch.logsumexp(logits, 1) ** 2 * (labels != IGN)).sum()
    loss = per / (labels != IGN).sum()
    loss.backward()
    for g in got:
        assert g["loss"] == pytest.approx(loss.item(), rel=1e-5)  # sum of the two ranks' parts
        for name, p in model.named_parameters():
            assert_rel(torch.tensor(g["grads"][name]), p.grad, 1e-5)


# --- Triton kernels through the CPU interpreter ------------------------------------------------

def _interp_linear_ce_case(backend, dt):
    """Norm-wise relative errors of (loss, dh, dw) against fp64 (run by the interpreter test)."""
    h, w, labels = lm_head_data(37, 24, 203, dt, seed=5)
    got = _grads(linear_cross_entropy, h, w, labels, z_loss=1e-2, label_smoothing=0.1, reduction="mean",
                 backend=backend, workspace_mb=37 * 64 * 6 / 2**20)  # several vocabulary slices
    ref = _grads(lambda a, b, c: reference(a, b, c, z_loss=1e-2, label_smoothing=0.1, reduction="mean"),
                 h.double(), w.double(), labels)
    return [rel_err(g, r) for g, r in zip(got, ref)]


def test_triton_kernels_in_interpreter():
    res = run_in_triton_interpreter("test_linear_ce:_interp_linear_ce_case")
    for backend in ("triton", "cublas"):
        loss32, dh32, dw32 = res[backend + "torch.float32"]
        assert loss32 < 1e-6 and dh32 < 1e-5 and dw32 < 1e-5, res
        lossb, dhb, dwb = res[backend + "torch.bfloat16"]
        assert lossb < 1e-6 and dhb < 2e-2 and dwb < 2e-2, res  # bf16 dz and bf16 gradients


# --- Triton on CUDA ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("backend", ["triton", "cublas", "mixed"])
@pytest.mark.parametrize("n,hd,v,dtype", [(1000, 256, 248_321, torch.bfloat16), (333, 64, 50_000, torch.float32),
                                          (4096, 2048, 32_000, torch.bfloat16)])
def test_cuda_kernels_match_fp64_reference(n, hd, v, dtype, backend):
    h, w, labels = lm_head_data(n, hd, v, dtype, seed=7, n_ignored=n // 10, device="cuda")
    got = _grads(linear_cross_entropy, h, w, labels, z_loss=1e-4, label_smoothing=0.05, backend=backend,
                 workspace_mb=8)
    ref = _grads(lambda a, b, c: reference(a, b, c, z_loss=1e-4, label_smoothing=0.05), h.double(), w.double(),
                 labels)
    grad_rel = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel(got[0], ref[0], 1e-6 if dtype == torch.float32 else 1e-5)
    assert_rel(got[1], ref[1], grad_rel)
    assert_rel(got[2], ref[2], grad_rel)


# --- end to end: the trainer with loss=linear_ce vs loss=ce ----------------------------------

RUNNER = textwrap.dedent("""
    import sys
    from framework.train import run
    from framework.resolve.resolver import resolve
    base, steps, local_batch, losses = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    for loss in losses:  # one process trains each loss in turn: start-up is the slow part
        r = resolve("debug_moe", [f"loss={loss}", f"training.steps={steps}", f"output_dir={base}/{loss}",
                                  "checkpoint.enable=false", "model.n_layers=1", "training.seq_len=64",
                                  f"training.local_batch={local_batch}", "logging.tensorboard=false",
                                  "training.dtype=float32"])
        run.train(r)
""")

STEPS, GLOBAL_BATCH = 5, 4


def _train(out, losses, nproc):
    """Train each loss for STEPS steps on the same global batches (data.sharding=blocks)."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / "runner.py"
    script.write_text(RUNNER)
    proc = run_ranks(script, [out, STEPS, GLOBAL_BATCH // nproc, *losses], nproc, cwd=out,
                     env={"APIARY_DEVICE": "cpu"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return [read_metrics(out / loss) for loss in losses]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one_rank"), ["ce", "linear_ce"], 1)


def _same_trajectory(ref, got):
    """linear_ce and ce compute the same loss in another order (vocabulary slices, logsumexp merged
    per slice): rounding-level differences from step 1 on, so conftest's fp32 trajectory bound."""
    assert len(ref) == len(got) == STEPS
    assert_same_trajectory(ref, got, TRAJ_LOSS_REL, TRAJ_NORM_REL)
    assert got[-1]["loss"] < got[0]["loss"]  # it trains


def test_trainer_linear_ce_matches_ce(one_rank):
    """FSDP2 degree 1, float32: the fused loss follows ce's loss and grad-norm trajectory."""
    ce, lce = one_rank
    _same_trajectory(ce, lce)


@pytest.mark.slow  # two 2-rank trainings (~3 min on 2 cores); the FSDP2 2-rank path is covered by
#                   test_fsdp2_two_gloo_ranks_loss_and_gradients in the default run
def test_trainer_linear_ce_two_gloo_ranks(tmp_path):
    """FSDP2 over 2 gloo ranks (dp_shard 2, EP 2): the lm_head weight is sharded and its gradient
    reduce-scattered by FSDP's own hooks; the trajectory matches 2-rank ce. (One process group
    cannot train twice: FSDP keeps the first run's mesh, so each loss gets its own launch.)"""
    (ce2,) = _train(tmp_path / "ce", ["ce"], 2)
    (lce2,) = _train(tmp_path / "lce", ["linear_ce"], 2)
    _same_trajectory(ce2, lce2)


def test_loss_bench_cpu_smoke(tmp_path):
    out = tmp_path / "lb.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_bench.py"), "--device", "cpu",
                           "--tokens", "256", "--vocab", "4096", "--hidden", "64", "--iters", "1", "--warmup", "0",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    rows = {r["row"]: r for r in rep["results"]}
    assert set(rows) == {"gemms", "ce", "chunked", "linear_ce", "linear_ce_fused", "logprob", "logprob_entropy",
                         "liger", "cce", "quack"}
    if rows["quack"]["status"] != "ok":  # quack-kernels needs CUDA and its CuTe DSL: skipped with the reason
        assert rows["quack"]["status"] == "skipped" and "not installed" in rows["quack"]["note"], rows["quack"]
    for name in ("gemms", "ce", "chunked", "linear_ce", "logprob", "logprob_entropy"):
        assert rows[name]["status"] == "ok" and rows[name]["time_ms"] > 0, rows[name]
        assert rows[name]["ratio_to_gemms"] > 0
    for name in ("liger", "cce"):  # guarded imports: a note, not a crash
        assert rows[name]["status"] in ("ok", "skipped"), rows[name]
    assert "linear_ce" in proc.stdout  # the rich table
    for name in ("ce", "chunked", "linear_ce", "linear_ce_fused"):  # checked against the fp32 reference
        assert rows[name]["grad_rel_err"] < 1e-5, rows[name]
    assert rows["gemms"]["grad_rel_err"] is None and rows["logprob"]["grad_rel_err"] is None  # other objectives


def _load_loss_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("loss_bench_under_test", ROOT / "benchmarks" / "loss_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loss_bench_reference_gradients_and_a_wrong_row(tmp_path, monkeypatch):
    """The bench's fp32 reference equals autograd's gradients of the summed cross-entropy, and a row whose
    gradients are off (here: 3% too large) is reported as wrong instead of timed."""
    lb = _load_loss_bench()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    F.cross_entropy(h @ w.T, y, reduction="sum").backward()
    dh, dw = lb.reference_grads(h, w, y, chunk=8)  # uneven last chunk
    torch.testing.assert_close(dh.double(), h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw.double(), w.grad, rtol=1e-5, atol=1e-6)

    def make_off(h, w, labels):
        def run():
            (1.03 * F.cross_entropy((h @ w.T).float(), labels, reduction="sum")).backward()
        return run

    monkeypatch.setitem(lb.MAKERS, "ce", make_off)
    out = tmp_path / "lb.json"
    assert lb.main(["--device", "cpu", "--tokens", "64", "--vocab", "256", "--hidden", "32", "--iters", "1",
                    "--warmup", "0", "--rows", "gemms", "ce", "linear_ce", "--out", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["ce"]["status"] == "wrong" and "off the fp32 reference by 3.00e-02" in rows["ce"]["note"], rows["ce"]
    assert rows["linear_ce"]["status"] == "ok" and rows["linear_ce"]["grad_rel_err"] < 1e-5
