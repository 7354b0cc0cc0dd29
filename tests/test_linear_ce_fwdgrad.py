"""linear_ce backend "fwdgrad" (gradient in the forward, three GEMM passes) and the fused RL
objectives: against an fp64 materialised reference (torch version of the schedule on CPU, the
Triton row kernels through Triton's interpreter), z-loss, label smoothing, ignore_index,
temperature, 3 micro-steps of gradient accumulation, a vocabulary group of 2 gloo ranks; each
fused RL objective equals the unfused token_logprobs + rl.py path; refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from components.losses import policy, rl
from components.losses.fused_rl import fused_policy_loss
from components.losses.linear_ce import LinearCrossEntropy, linear_cross_entropy
from components.losses.lm_head import fwdgrad
from components.losses.logprob import token_logprobs
from tests.test_linear_ce import _grads, reference

from conftest import assert_rel as _close
from conftest import free_port as _free_port
from conftest import lm_head_data as _data

ROOT = Path(__file__).resolve().parents[1]
IGN = -100

pytestmark = pytest.mark.usefixtures("one_thread")


def ref_ce(z=0.0, eps=0.0, temp=1.0, reduction="sum"):
    return lambda a, b, c: reference(a / temp, b, c, z_loss=z, label_smoothing=eps, reduction=reduction)


CASES = [
    # n, H, V, dtype, z_loss, smoothing, temperature, reduction, logits, dw, grad_rel
    (37, 16, 1003, torch.float32, 0.0, 0.0, 1.0, "sum", "float32", "float32", 1e-5),
    (37, 16, 1003, torch.float32, 1e-2, 0.1, 0.7, "mean", "bfloat16", "weight", 1e-5),  # fp32 inputs: fp32 z
    (50, 24, 517, torch.bfloat16, 1e-3, 0.2, 1.3, "mean", "bfloat16", "float32", 1e-2),
    (50, 24, 517, torch.bfloat16, 0.0, 0.05, 1.0, "sum", "float32", "weight", 1e-2),
]


@pytest.mark.parametrize("n,hd,v,dtype,z,eps,temp,red,logits,dw,grad_rel", CASES)
def test_fwdgrad_torch_schedule_matches_fp64(n, hd, v, dtype, z, eps, temp, red, logits, dw, grad_rel):
    h, w, labels = _data(n, hd, v, dtype, seed=4)
    got = _grads(linear_cross_entropy, h, w, labels, z_loss=z, label_smoothing=eps, temperature=temp, reduction=red,
                 backend="fwdgrad", logits_dtype=logits, dw_accum=dw, chunk_tokens=12)
    ref = _grads(ref_ce(z, eps, temp, red), h.double(), w.double(), labels)
    _close(got[0], ref[0], 1e-6 if dtype == torch.float32 or logits == "float32" else 1e-4)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    _close(got[1], ref[1], grad_rel)
    _close(got[2], ref[2], grad_rel)


def test_recompute_path_takes_temperature_too():
    h, w, labels = _data(30, 8, 97, torch.float32)
    got = _grads(linear_cross_entropy, h, w, labels, temperature=0.6, z_loss=1e-3, backend="torch")
    ref = _grads(ref_ce(1e-3, 0.0, 0.6), h.double(), w.double(), labels)
    for g, r in zip(got, ref):
        _close(g, r, 1e-5)


def test_upstream_gradient_and_three_micro_steps_accumulate_exactly():
    """Each micro-step's stored dH, dW is scaled by its own upstream gradient (loss scale / 3)
    in the backward; dW accumulates in .grad over the 3 micro-steps like the reference's."""
    h0, w0, labels = _data(3 * 20, 12, 211, torch.float32, seed=9, n_ignored=6)
    w = w0.clone().requires_grad_(True)
    wr = w0.double().clone().requires_grad_(True)
    for i in range(3):
        sl = slice(20 * i, 20 * (i + 1))
        h = h0[sl].clone().requires_grad_(True)
        loss = linear_cross_entropy(h, w, labels[sl], z_loss=1e-2, label_smoothing=0.1, reduction="mean",
                                    backend="fwdgrad", chunk_tokens=7)
        (loss * (0.25 + i) / 3).backward()
        hr = h0[sl].double().clone().requires_grad_(True)
        (ref_ce(1e-2, 0.1, 1.0, "mean")(hr, wr, labels[sl]) * (0.25 + i) / 3).backward()
        _close(h.grad, hr.grad, 1e-5)
    _close(w.grad, wr.grad, 1e-5)


def test_no_gradient_work_without_a_backward(monkeypatch):
    seen = []
    orig = fwdgrad.run

    def spy(*a, **k):
        seen.append((k["need_dh"], k["need_dw"]))
        return orig(*a, **k)

    monkeypatch.setattr(fwdgrad, "run", spy)
    h, w, labels = _data(9, 8, 30, torch.float32)
    ref = reference(h.double(), w.double(), labels).item()
    with torch.no_grad():
        got = linear_cross_entropy(h.requires_grad_(True), w.requires_grad_(True), labels, backend="fwdgrad")
    assert seen == [(False, False)] and got.item() == pytest.approx(ref, rel=1e-6)
    hh = h.detach().clone().requires_grad_(True)
    linear_cross_entropy(hh, w.detach(), labels, backend="fwdgrad").backward()  # frozen head: no dW
    assert seen[-1] == (True, False) and hh.grad is not None


def test_refusals_name_the_option():
    h, w, labels = _data(6, 4, 10, torch.float32)
    with pytest.raises(ValueError, match="reduction='none'"):
        linear_cross_entropy(h, w, labels, reduction="none", backend="fwdgrad")
    with pytest.raises(ValueError, match="logits_dtype"):
        linear_cross_entropy(h, w, labels, backend="fwdgrad", logits_dtype="float16")
    with pytest.raises(ValueError, match="dw_accum"):
        LinearCrossEntropy.Options(dw_accum="fp8")  # refused as built (__post_init__)
    with pytest.raises(ValueError, match="temperature"):
        linear_cross_entropy(h, w, labels, temperature=0.0)
    with pytest.raises(ValueError, match="fwdgrad"):
        token_logprobs(h, w, labels, backend="fwdgrad")
    with pytest.raises(ValueError, match="gspo cannot use backend=fwdgrad"):
        fused_policy_loss(h, w, labels, "gspo", None, torch.zeros(6), labels != IGN)
    with pytest.raises(ValueError, match="loss=gspo cannot use loss.backend=fwdgrad"):
        policy.GSPO.check(policy.GSPO.Options(backend="fwdgrad"), None)
    with pytest.raises(ValueError, match="loss.logits_dtype"):
        policy.GRPO.Options(logits_dtype="int8")  # refused as built (__post_init__)


def test_auto_on_cpu_keeps_the_recompute_path():
    from components.losses.linear_ce import auto_backend

    h, w, _ = _data(6, 4, 10, torch.float32)
    assert auto_backend(h.requires_grad_(True), w, "sum", "bfloat16", "float32", 256.0) == "torch"


# --- fused RL objectives == the unfused token_logprobs + rl.py path ------------------------------


def _rl_case(seed=0, b=3, t=11, hd=16, v=300, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, hd, generator=g).to(dtype)
    w = (torch.randn(v, hd, generator=g) / 2).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    labels[~mask] = IGN
    with torch.no_grad():
        lp, _ = token_logprobs(hidden, w, labels, temperature=0.9, backend="torch")
    old = (lp + 0.3 * torch.randn(b, t, generator=g)) * mask  # ratios beyond the clips
    ref = old + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    return hidden, w, labels, mask, old, ref, adv


def _unfused(name, hp, hidden, w, labels, mask, old, ref, adv, ec, kw, den=None):
    lp, ent = token_logprobs(hidden, w, labels, temperature=0.9, with_entropy=ec > 0, backend="torch")
    loss, metrics = rl.objective(name)(lp, old, adv, mask, ref, **hp, **kw)
    if ec:
        d = mask.sum() if den is None else den
        loss = loss - ec * (ent * mask).sum() / d
    return loss, metrics


RL_CASES = [
    ("grpo", dict(eps=0.2, kl_coef=0.05, norm="sequence")),
    ("grpo", dict(eps=0.2, norm="token")),
    ("dapo", dict(eps_low=0.2, eps_high=0.28)),
    ("cispo", dict(eps_high=0.28)),
    ("cispo", dict(eps_low=0.5, eps_high=0.2, norm="sequence")),
    ("ppo", dict(eps=0.1, eps_high=0.3, kl_coef=0.02)),
    ("sft", dict()),
]


@pytest.mark.parametrize("name,hp", RL_CASES)
@pytest.mark.parametrize("ec", [0.0, 0.02])
def test_fused_rl_equals_unfused(name, hp, ec):
    hidden, w, labels, mask, old, ref, adv = _rl_case()
    res = []
    for fused in (False, True):
        hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fused:
            loss, metrics = fused_policy_loss(hh, ww, labels, name, old, adv, mask, ref, hparams=hp, temperature=0.9,
                                              entropy_coef=ec, chunk_tokens=5)
        else:
            loss, metrics = _unfused(name, hp, hh, ww, labels, mask, old, ref, adv, ec, {})
        (loss * 1.7).backward()
        res.append((loss.detach(), metrics, hh.grad, ww.grad))
    (l0, m0, dh0, dw0), (l1, m1, dh1, dw1) = res
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6, abs=1e-7)
    for k in m0:
        assert m1[k].item() == pytest.approx(m0[k].item(), rel=1e-6, abs=1e-7), k
    _close(dh1, dh0, 1e-5)
    _close(dw1, dw0, 1e-5)


def test_fused_rl_packed_sequences_and_global_counts():
    """Sequence-level means with sequence_ids (packed rows), seq_tokens + a global normaliser
    (the trainer's split over ranks), and a global entropy denominator."""
    hidden, w, labels, mask, old, ref, adv = _rl_case(seed=3, b=2, t=12)
    sid = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 3 + [-1]])
    mask[1, -1] = False
    labels[1, -1] = IGN
    adv_tok = torch.randn(2, 12)
    seq_tokens = torch.tensor([[4] * 5 + [6] * 7, [7] * 8 + [3] * 3 + [1]])
    for kw in ({"sequence_ids": sid}, {"seq_tokens": seq_tokens, "normalizer": torch.tensor(7.0)}):
        hp = dict(eps=0.2, norm="sequence")
        hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        l0, _ = _unfused("grpo", hp, hh, ww, labels, mask, old, ref, adv_tok, 0.01, kw, den=torch.tensor(40.0))
        g0 = torch.autograd.grad(l0, (hh, ww))
        hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        l1, _ = fused_policy_loss(hh, ww, labels, "grpo", old, adv_tok, mask, ref, hparams=hp, temperature=0.9,
                                  entropy_coef=0.01, entropy_den=torch.tensor(40.0), chunk_tokens=4, **kw)
        g1 = torch.autograd.grad(l1, (hh, ww))
        assert l1.item() == pytest.approx(l0.item(), rel=1e-6)
        for a, b in zip(g1, g0):
            _close(a, b, 1e-5)


def test_policy_loss_routes_fwdgrad_to_the_fused_objective():
    """The trainer's PolicyLoss body: backend=fwdgrad gives the loss, metrics and gradients of
    backend=torch (unfused)."""
    hidden, w, labels, mask, old, ref, adv = _rl_case(seed=5)
    batch = {"rl_old_logprobs": old, "rl_advantages": adv, "rl_ref_logprobs": ref,
             "rl_num_seqs": torch.tensor([3.0]), "rl_seq_tokens": mask.sum(1, keepdim=True).expand_as(mask)}
    out = []
    for backend in ("torch", "fwdgrad"):
        opts = policy.GRPO.Options(kl_coef=0.03, temperature=0.9, entropy_coef=0.01, backend=backend,
                                   chunk_tokens=6)
        hp = {k: getattr(opts, k) for k in ("eps", "kl_coef", "norm")}
        cfg = SimpleNamespace(objective="grpo", hparams=hp, temperature=0.9, entropy_coef=0.01, backend=backend,
                              chunk_tokens=opts.chunk_tokens, chunk_vocab=16384, workspace_mb=256.0,
                              logits_dtype="bfloat16", dw_accum="float32")
        me = SimpleNamespace(config=cfg, batch=batch, seq_group=None)
        h2 = hidden.reshape(-1, 16).clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        loss = policy.policy_loss(me, h2, ww, labels, torch.tensor(25.0))
        loss.backward()
        out.append((loss.item(), me.metrics, h2.grad, ww.grad))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6)
    assert set(out[1][1]) == set(out[0][1])
    _close(out[1][2], out[0][2], 1e-5)
    _close(out[1][3], out[0][3], 1e-5)


# --- the Triton row kernels through the interpreter ------------------------------------------------

INTERP = textwrap.dedent("""
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from conftest import lm_head_data as _data
    from tests.test_linear_ce import _grads
    from tests.test_linear_ce_fwdgrad import CASES, RL_CASES, ref_ce, _rl_case, _unfused
    from components.losses.linear_ce import linear_cross_entropy
    from components.losses.fused_rl import fused_policy_loss
    rel = lambda g, r: ((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
    out = {"ce": [], "rl": []}
    for n, hd, v, dt, z, eps, temp, red, logits, dw, tol in CASES:
        h, w, labels = _data(n, hd, v, dt, seed=4)
        got = _grads(linear_cross_entropy, h, w, labels, z_loss=z, label_smoothing=eps, temperature=temp,
                     reduction=red, backend="fwdgrad", logits_dtype=logits, dw_accum=dw, chunk_tokens=12)
        ref = _grads(ref_ce(z, eps, temp, red), h.double(), w.double(), labels)
        out["ce"].append([[rel(g, r) for g, r in zip(got, ref)], tol, dt == torch.float32 or logits == "float32"])
    for (name, hp), ec in zip(RL_CASES[:3] + RL_CASES[-2:], (0.0, 0.02, 0.0, 0.02, 0.0)):
        hidden, w, labels, mask, old, refl, adv = _rl_case()
        res = []
        for fused in (False, True):
            hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
            if fused:  # ec = 0: one fused kernel + row scales; ec > 0: stats and gradient kernels
                loss, _ = fused_policy_loss(hh, ww, labels, name, old, adv, mask, refl, hparams=hp, temperature=0.9,
                                            entropy_coef=ec, chunk_tokens=5)
            else:
                loss, _ = _unfused(name, hp, hh, ww, labels, mask, old, refl, adv, ec, {})
            loss.backward()
            res.append((loss.detach(), hh.grad, ww.grad))
        out["rl"].append([rel(a, b) for a, b in zip(res[1], res[0])])
    print("RESULT" + json.dumps(out))
""")


def test_triton_row_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, "-c", INTERP, str(ROOT)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for (loss, dh, dw), tol, exact_logits in res["ce"]:
        assert loss < (1e-6 if exact_logits else 1e-4) and dh < tol and dw < tol, res
    for loss, dh, dw in res["rl"]:
        assert loss < 1e-6 and dh < 1e-5 and dw < 1e-5, res


# --- a vocabulary group of 2 gloo ranks ------------------------------------------------------------


def _group_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    h, w, labels = _data(29, 12, 1001, torch.float32, seed=3)
    cut = [0, 480, 1001]
    wl = w[cut[rank]:cut[rank + 1]]
    hidden, wr, rl_labels, mask, old, ref, adv = _rl_case(seed=6)
    wrl = wr[[0, 140, 300][rank]:[0, 140, 300][rank + 1]]
    res = {}
    for interp in ("0", "1"):  # the torch schedule, then the Triton row kernels (interpreter)
        os.environ["TRITON_INTERPRET"] = interp
        out, dh, dw = _grads(linear_cross_entropy, h, wl, labels, z_loss=1e-2, label_smoothing=0.1, temperature=0.8,
                             vocab_group=dist.group.WORLD, backend="fwdgrad", chunk_tokens=8)
        res["ce" + interp] = {"loss": out.item(), "dh": dh.tolist(), "dw": dw.tolist()}
        hh, ww = hidden.clone().requires_grad_(True), wrl.clone().requires_grad_(True)
        loss, _ = fused_policy_loss(hh, ww, rl_labels, "grpo", old, adv, mask, ref, hparams=dict(kl_coef=0.05),
                                    temperature=0.9, entropy_coef=0.02, vocab_group=dist.group.WORLD,
                                    chunk_tokens=5)
        loss.backward()
        res["rl" + interp] = {"loss": loss.item(), "dh": hh.grad.tolist(), "dw": ww.grad.tolist()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_group_of_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_group_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    h, w, labels = _data(29, 12, 1001, torch.float32, seed=3)
    ref_ce_ = _grads(ref_ce(1e-2, 0.1, 0.8), h.double(), w.double(), labels)
    hidden, wr, rl_labels, mask, old, ref, adv = _rl_case(seed=6)
    hh, ww = hidden.clone().requires_grad_(True), wr.clone().requires_grad_(True)
    l_rl, _ = _unfused("grpo", dict(kl_coef=0.05), hh, ww, rl_labels, mask, old, ref, adv, 0.02, {})
    l_rl.backward()
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        lo, hi = [0, 480, 1001][rank], [0, 480, 1001][rank + 1]
        rlo, rhi = [0, 140, 300][rank], [0, 140, 300][rank + 1]
        for interp in ("0", "1"):
            g = got["ce" + interp]
            assert g["loss"] == pytest.approx(ref_ce_[0].item(), rel=1e-5)
            _close(torch.tensor(g["dh"]), ref_ce_[1], 1e-5)  # the full hidden gradient on every rank
            _close(torch.tensor(g["dw"]), ref_ce_[2][lo:hi], 1e-5)
            g = got["rl" + interp]
            assert g["loss"] == pytest.approx(l_rl.item(), rel=1e-5)
            _close(torch.tensor(g["dh"]), hh.grad, 1e-5)
            _close(torch.tensor(g["dw"]), ww.grad[rlo:rhi], 1e-5)


# --- the trainer's PolicyLoss (torchtitan ChunkedLossWrapper protocol) with backend=fwdgrad ---------


@pytest.mark.parametrize("name,hp,ent", [
    ("grpo", dict(eps=0.2, kl_coef=0.05, norm="sequence"), 0.0), ("dapo", dict(eps_low=0.2, eps_high=0.28,
                                                                                norm="token"), 0.01),
    ("sft", dict(norm="token"), 0.0)])
def test_trainer_policy_loss_fwdgrad_equals_recompute(name, hp, ent):
    from framework import devices

    devices.install()
    from components.losses.policy import policy_loss_class
    from tests.test_rl_training import _packed_batch

    hidden, weight, labels, batch = _packed_batch()
    hidden, weight = hidden.float(), weight.float()
    gvt = (labels != IGN).sum()
    out = []
    for backend in ("torch", "fwdgrad"):
        fn = policy_loss_class().Config(objective=name, hparams=hp, temperature=0.7, backend=backend,
                                        entropy_coef=ent, chunk_tokens=10).build()
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight.data.copy_(weight)
        fn.set_lm_head(head)
        fn.set_batch(batch)
        pred = hidden.clone().requires_grad_(True)
        loss, _ = fn(pred, labels, gvt)
        loss.backward()
        out.append((loss.item(), dict(fn.metrics), pred.grad, head.weight.grad))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6, abs=1e-8)
    for k, v in out[0][1].items():
        assert float(out[1][1][k]) == pytest.approx(float(v), rel=1e-6, abs=1e-8), k
    _close(out[1][2], out[0][2], 1e-5)
    _close(out[1][3], out[0][3], 1e-5)


def test_no_tokens_and_all_ignored():
    h, w, labels = _data(5, 4, 10, torch.float32)
    for hh, ll in ((h[:0], labels[:0]), (h, torch.full_like(labels, IGN))):
        out, dh, dw = _grads(linear_cross_entropy, hh, w, ll, backend="fwdgrad", chunk_tokens=2)
        assert out.item() == 0.0 and torch.all(dh == 0) and torch.all(dw == 0)


# --- the torchtitan loss under FSDP2 on 2 gloo ranks with backend=fwdgrad ----------------------------


def _fsdp_fwdgrad_worker(rank, world, port, out_dir):
    import tests.test_linear_ce as T
    from components.losses import linear_ce

    cls = linear_ce.fused_loss_class()

    class _Cfg:  # test_linear_ce's worker (it imports fused_loss_class when it runs), fwdgrad in small chunks
        @staticmethod
        def Config(**kw):
            return cls.Config(**{**kw, "backend": "fwdgrad", "chunk_tokens": 5})

    linear_ce.fused_loss_class = lambda: _Cfg  # this spawned process only
    T._fsdp_worker(rank, world, port, out_dir)


def test_fsdp2_two_gloo_ranks_with_fwdgrad(tmp_path):
    import torch.multiprocessing as mp

    import tests.test_linear_ce as T

    mp.spawn(_fsdp_fwdgrad_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    # the reference half of test_linear_ce's FSDP test, on these results
    got = [json.loads((tmp_path / f"fsdp{r}.json").read_text()) for r in range(2)]
    model = T._TinyDecoder()
    model.load_state_dict({k: torch.tensor(v) for k, v in got[0]["full"].items()})
    x, _, labels = _data(2 * 16, 12, 301, torch.float32, seed=11, n_ignored=5)
    logits = model.lm_head(model(x))
    per = torch.nn.functional.cross_entropy(logits, labels, reduction="sum", ignore_index=IGN) + 1e-3 * (
        torch.logsumexp(logits, 1) ** 2 * (labels != IGN)).sum()
    (per / (labels != IGN).sum()).backward()
    for g in got:
        for name, p in model.named_parameters():
            _close(torch.tensor(g["grads"][name]), p.grad, 1e-5)
