"""logprob + RL objectives: fused token log-probabilities / entropy against an fp64 reference
(torch path, Triton interpreter, CUDA when present); each RL objective against a direct
implementation of its published formula; the rollout reader."""

from __future__ import annotations

import json

import pytest
import torch

from components.data.rollouts import read_rollouts
from components.losses import rl
from components.losses.lm_head import engine
from components.losses.logprob import token_logprobs

from conftest import IGN, lm_head_data, rel_err, run_in_triton_interpreter

pytestmark = pytest.mark.usefixtures("one_thread")


def ref_logprobs(h, w, labels, temperature):
    ls = torch.log_softmax((h.double() @ w.double().T) / temperature, dim=-1)
    lp = ls.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels != IGN)
    ent = -(ls.exp() * ls).sum(-1)
    return lp, ent


def _fwd_bwd(fn, h, w, labels, g_lp, g_ent, w_grad=True):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(w_grad)
    lp, ent = fn(h, w, labels)
    loss = (lp * g_lp.to(lp.dtype)).sum() + ((ent * g_ent.to(ent.dtype)).sum() if ent is not None else 0)
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


@pytest.mark.parametrize("n,hd,v,dtype,temp,with_ent,tol", [
    (37, 16, 248_321, torch.float32, 0.7, True, 1e-5),
    (37, 16, 248_321, torch.bfloat16, 1.3, True, 1e-2),
    (50, 24, 999, torch.float32, 1.0, False, 1e-5),
])
def test_token_logprobs_torch_path_matches_fp64(n, hd, v, dtype, temp, with_ent, tol):
    h, w, labels = lm_head_data(n, hd, v, dtype)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def fused(a, b, c):
        return token_logprobs(a, b, c, temperature=temp, with_entropy=with_ent, backend="torch",
                              chunk_tokens=13, chunk_vocab=5003 if v > 10_000 else 101)

    def ref(a, b, c):
        lp, ent = ref_logprobs(a, b, c, temp)
        return lp, (ent if with_ent else None)

    got = _fwd_bwd(fused, h, w, labels, g_lp, g_ent)
    want = _fwd_bwd(ref, h.double(), w.double(), labels, g_lp, g_ent)
    assert rel_err(got[0], want[0]) < 1e-6
    assert torch.all(got[0][labels == IGN] == 0)
    if with_ent:
        assert rel_err(got[1], want[1]) < 1e-6
    else:
        assert got[1] is None
    assert rel_err(got[2], want[2]) < tol and rel_err(got[3], want[3]) < tol


def test_frozen_head_skips_weight_gradient(monkeypatch):
    seen = []
    orig = engine._torch_grads

    def spy(*a):
        seen.append((a[-4], a[-3]))
        return orig(*a)

    monkeypatch.setattr(engine, "_torch_grads", spy)
    h, w, labels = lm_head_data(11, 8, 40, torch.float32)
    g_lp, g_ent = torch.randn(11), torch.randn(11)
    fn = lambda a, b, c: token_logprobs(a, b, c, temperature=0.5, with_entropy=True, backend="torch")  # noqa: E731
    got = _fwd_bwd(fn, h, w, labels, g_lp, g_ent, w_grad=False)
    want = _fwd_bwd(lambda a, b, c: ref_logprobs(a, b, c, 0.5), h.double(), w.double(), labels, g_lp, g_ent,
                w_grad=False)
    assert seen == [(True, False)] and got[3] is None
    assert rel_err(got[2], want[2]) < 1e-5


# --- RL objectives against their formulas, written out directly --------------------------------


def _rl_batch(seed=0, b=4, t=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    lp = (old + torch.randn(b, t, generator=g) * 0.3).requires_grad_(True)  # ratios well past the clips
    ref = old + torch.randn(b, t, generator=g) * 0.2
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    adv_seq = torch.randn(b, generator=g)
    return lp, old, ref, mask, adv_seq


def _direct(name, lp, old, ref, mask, adv, **hp):
    """The published formulas with explicit loops over sequences and tokens."""
    b, t = lp.shape
    terms, per_seq = [], []
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j]]
        if name == "gspo":
            s = torch.exp(sum(lp[i, j] - old[i, j] for j in toks) / len(toks))
            lo, hi = 1 - hp["eps_low"], 1 + hp["eps_high"]
            per_seq.append(-torch.minimum(s * adv[i], torch.clamp(s, lo, hi) * adv[i]))
            continue
        seq = []
        for j in toks:
            r = torch.exp(lp[i, j] - old[i, j])
            if name in ("ppo", "grpo", "dapo"):
                lo = 1 - hp.get("eps", hp.get("eps_low", 0.2))
                hi = 1 + hp.get("eps_high", hp.get("eps", 0.2))
                x = -torch.minimum(r * adv[i], torch.clamp(r, lo, hi) * adv[i])
                if hp.get("kl_coef", 0):
                    d = ref[i, j] - lp[i, j]
                    x = x + hp["kl_coef"] * (torch.exp(d) - d - 1)
            elif name == "cispo":
                wgt = torch.clamp(r.detach(), max=1 + hp["eps_high"])
                x = -wgt * adv[i] * lp[i, j]
            elif name == "sft":
                x = -lp[i, j]
            seq.append(x)
        terms += seq
        per_seq.append(sum(seq) / len(seq))
    if name == "gspo" or hp.get("norm") == "sequence":
        return sum(per_seq) / b
    return sum(terms) / len(terms)


OBJ_CASES = [
    ("ppo", dict(eps=0.2)),
    ("ppo", dict(eps=0.1, kl_coef=0.05, norm="sequence")),
    ("grpo", dict(eps=0.2, kl_coef=0.04, norm="sequence")),
    ("dapo", dict(eps_low=0.2, eps_high=0.28)),
    ("gspo", dict(eps_low=0.03, eps_high=0.04)),
    ("cispo", dict(eps_high=0.28)),
    ("sft", dict()),
]


@pytest.mark.parametrize("name,hp", OBJ_CASES)
def test_objective_matches_formula(name, hp):
    lp, old, ref, mask, adv = _rl_batch()
    loss, metrics = rl.objective(name)(lp, old, adv, mask, ref, **hp)
    (g_got,) = torch.autograd.grad(loss, lp)
    direct_hp = dict(hp)
    if name == "grpo":
        direct_hp.setdefault("norm", "sequence")
    want = _direct(name, lp, old, ref, mask, adv, **direct_hp)
    (g_want,) = torch.autograd.grad(want, lp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(g_got, g_want, rtol=1e-5, atol=1e-7)
    assert torch.all(g_got[~mask] == 0)  # untrained tokens get no gradient
    if name in ("ppo", "grpo", "dapo"):
        assert 0 < metrics["clip_low_frac"] + metrics["clip_high_frac"] < 1  # the clip is exercised


def test_cispo_keeps_gradient_where_ppo_clips():
    lp, old, ref, mask, adv = _rl_batch(seed=4)
    adv = torch.ones_like(adv)
    r = torch.exp(lp - old).detach()
    clipped = mask & (r > 1.2)
    assert clipped.any()
    (g_ppo,) = torch.autograd.grad(rl.ppo(lp, old, adv, mask, eps=0.2)[0], lp)
    (g_cispo,) = torch.autograd.grad(rl.cispo(lp, old, adv, mask, eps_high=0.2)[0], lp)
    assert torch.all(g_ppo[clipped] == 0) and torch.all(g_cispo[clipped] != 0)


def test_packed_sequences_give_the_unpacked_objective():
    lp, old, ref, mask, adv = _rl_batch(seed=1, b=4, t=6)
    # pack rows (0, 1) and (2, 3) into two rows of 12 with sequence ids
    pk = lambda x: x.reshape(2, 12)  # noqa: E731
    sid = torch.tensor([0] * 6 + [1] * 6).repeat(2, 1)
    adv_tok = adv[:, None].expand(4, 6)
    for name, hp in (("grpo", dict(kl_coef=0.1)), ("gspo", {}), ("dapo", {})):
        fn = rl.objective(name)
        a = fn(lp, old, adv, mask, ref, **hp)[0]
        b = fn(pk(lp), pk(old), pk(adv_tok), pk(mask), pk(ref), sequence_ids=sid, **hp)[0]
        assert a.item() == pytest.approx(b.item(), rel=1e-6), name


def test_global_normalizer_splits_over_ranks():
    """Token-level objectives: local sums / global token count add up to the global loss."""
    lp, old, ref, mask, adv = _rl_batch(seed=2)
    whole = rl.dapo(lp, old, adv, mask)[0]
    n = mask.sum()
    parts = [rl.dapo(lp[i::2], old[i::2], adv[i::2], mask[i::2], normalizer=n)[0] for i in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    a = rl.group_advantages(r, gid)
    g0 = r[:4]
    assert torch.allclose(a[:4], (g0 - g0.mean()) / (g0.std() + 1e-6))
    assert torch.all(a[4:] == 0)  # no signal in a group of equal rewards
    assert torch.allclose(rl.group_advantages(r, gid, scale=False)[:4], g0 - 0.5)
    with pytest.raises(ValueError, match="unknown RL objective"):
        rl.objective("reinforce")


def test_fused_logprobs_drive_grpo_like_materialised_logits():
    """An RL step through the fused head gives the gradients of the materialised-logits pipeline."""
    torch.manual_seed(0)
    b, t, hd, v = 3, 10, 16, 300
    hidden = torch.randn(b, t, hd, requires_grad=True)
    w = (torch.randn(v, hd) / 2).requires_grad_(True)
    labels = torch.randint(0, v, (b, t))
    mask = torch.rand(b, t) > 0.2
    labels[~mask] = IGN
    with torch.no_grad():
        old = torch.log_softmax(hidden @ w.T / 0.9, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        old = (old + 0.1 * torch.randn_like(old)) * mask
    adv = torch.randn(b)
    lp, ent = token_logprobs(hidden, w, labels, temperature=0.9, with_entropy=True, backend="torch")
    loss = rl.grpo(lp, old, adv, mask, eps=0.2)[0] - 0.01 * (ent * mask).sum() / mask.sum()
    g_fused = torch.autograd.grad(loss, (hidden, w))
    ls = torch.log_softmax(hidden @ w.T / 0.9, -1)
    lp2 = ls.gather(-1, labels.clamp_min(0)[..., None])[..., 0] * mask
    ent2 = -(ls.exp() * ls).sum(-1)
    loss2 = rl.grpo(lp2, old, adv, mask, eps=0.2)[0] - 0.01 * (ent2 * mask).sum() / mask.sum()
    g_ref = torch.autograd.grad(loss2, (hidden, w))
    assert loss.item() == pytest.approx(loss2.item(), rel=1e-5)
    for a, r in zip(g_fused, g_ref):
        assert rel_err(a, r) < 1e-5


# --- rollout reader --------------------------------------------------------------------------


def _records():
    return [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "old_logprobs": [0, 0, -0.5, -1.5],
         "advantages": 1.0, "ref_logprobs": [0, 0, -0.4, -1.4], "sequence_id": "a", "group_id": 0},
        {"input_ids": [9, 10, 11], "loss_mask": [0, 1, 1], "old_logprobs": [0, -2.0, -0.1],
         "advantages": [0, -1.0, -1.0], "ref_logprobs": [0, -2.1, -0.2], "sequence_id": "b", "group_id": 0},
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 0, 1, 1], "old_logprobs": [0, -1, 0, -3, -4],
         "advantages": 0.5, "ref_logprobs": [0, -1, 0, -3, -4], "sequence_id": "c", "group_id": 1},
    ]


def test_rollouts_jsonl_padded(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _records()) + "\n")
    out = read_rollouts(p, pad_multiple=4)
    assert out["input_ids"].shape == (3, 8)  # longest 5, rounded up to 8
    assert out["input_ids"][0].tolist() == [5, 6, 7, 8, 0, 0, 0, 0]
    # shifted by one: position t predicts token t+1
    assert out["labels"][0].tolist() == [IGN, 7, 8, IGN, IGN, IGN, IGN, IGN]
    assert out["loss_mask"][0].tolist() == [False, True, True] + [False] * 5
    assert out["old_logprobs"][0, :3].tolist() == [0.0, -0.5, -1.5]
    assert out["advantages"][1, :2].tolist() == [-1.0, -1.0]
    assert out["ref_logprobs"][2, :4].tolist() == [-1.0, 0.0, -3.0, -4.0]
    assert out["sequence_ids"][1].tolist() == [0, 0, 0, -1, -1, -1, -1, -1]
    assert [m[0][1] for m in out["meta"]] == ["a", "b", "c"]


def test_rollouts_parquet_packed_matches_padded(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = _records()
    for r in recs:  # parquet wants one type per column
        r["advantages"] = [float(r["advantages"])] * len(r["input_ids"]) if not isinstance(r["advantages"], list) \
            else [float(x) for x in r["advantages"]]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "r.parquet")
    packed = read_rollouts(tmp_path / "r.parquet", pack_to=8)
    padded = read_rollouts(tmp_path / "r.parquet")
    assert packed["input_ids"].shape == (2, 8)  # [a(4) + b(3)], [c(5)]
    assert packed["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 10, 11, 0]
    assert packed["positions"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert packed["sequence_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    assert packed["labels"][0, 3] == IGN  # the last token of a predicts nothing (not b's first token)
    assert packed["loss_mask"].sum() == padded["loss_mask"].sum() == 7
    # the same objective on both layouts
    g = torch.Generator().manual_seed(0)
    for layout in (packed, padded):
        layout["lp"] = layout["old_logprobs"] + 0.1 * torch.randn(layout["old_logprobs"].shape, generator=g)
    lp_vals = padded["lp"][padded["loss_mask"]]
    packed["lp"][packed["loss_mask"]] = lp_vals  # same per-token values, in the same order
    a = rl.grpo(padded["lp"], padded["old_logprobs"], padded["advantages"], padded["loss_mask"],
                padded["ref_logprobs"], kl_coef=0.1)[0]
    b = rl.grpo(packed["lp"], packed["old_logprobs"], packed["advantages"], packed["loss_mask"],
                packed["ref_logprobs"], kl_coef=0.1, sequence_ids=packed["sequence_ids"])[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_rollouts_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field\(s\) old_logprobs, advantages"):
        read_rollouts(p)
    p.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1], "old_logprobs": [0, 0, 0],
                             "advantages": 1.0}) + "\n")
    with pytest.raises(ValueError, match="loss_mask has 2 entries, input_ids 3"):
        read_rollouts(p)
    p.write_text(json.dumps(_records()[0]) + "\n")
    with pytest.raises(ValueError, match="do not fit pack_to=3"):
        read_rollouts(p, pack_to=3)
    with pytest.raises(FileNotFoundError):
        read_rollouts(tmp_path / "nothing")


# --- Triton kernels: interpreter on CPU, compiled on CUDA -------------------------------------

def _interp_logprob_case(backend, dt):
    """Norm-wise relative errors of (logprobs, entropy, dh, dw) against fp64 (run by the
    interpreter test)."""
    h, w, labels = lm_head_data(37, 24, 203, dt, seed=5)
    g_lp, g_ent = torch.randn(37), torch.randn(37)
    fused = lambda a, b, c: token_logprobs(a, b, c, temperature=0.7, with_entropy=True, backend=backend,  # noqa: E731
                                           workspace_mb=37 * 64 * 6 / 2**20)
    got = _fwd_bwd(fused, h, w, labels, g_lp, g_ent)
    want = _fwd_bwd(lambda a, b, c: ref_logprobs(a, b, c, 0.7), h.double(), w.double(), labels, g_lp, g_ent)
    return [rel_err(g, r) for g, r in zip(got, want)]


def test_triton_logprob_kernels_in_interpreter():
    res = run_in_triton_interpreter("test_logprob_rl:_interp_logprob_case")
    for backend in ("triton", "cublas"):
        assert max(res[backend + "torch.float32"]) < 1e-5, res
        lp, ent, dh, dw = res[backend + "torch.bfloat16"]
        assert lp < 1e-6 and ent < 1e-6 and dh < 2e-2 and dw < 2e-2, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "cublas", "mixed"])
@pytest.mark.parametrize("n,hd,v,dtype", [(1000, 256, 248_321, torch.bfloat16), (257, 64, 50_000, torch.float32)])
def test_cuda_logprobs_match_fp64(n, hd, v, dtype, backend):
    h, w, labels = lm_head_data(n, hd, v, dtype, seed=9, n_ignored=n // 10, device="cuda")
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()
    got = _fwd_bwd(lambda a, b, c: token_logprobs(a, b, c, temperature=0.8, with_entropy=True, backend=backend,
                                              workspace_mb=8), h, w, labels, g_lp, g_ent)
    want = _fwd_bwd(lambda a, b, c: ref_logprobs(a, b, c, 0.8), h.double(), w.double(), labels, g_lp, g_ent)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5
    assert rel_err(got[2], want[2]) < tol and rel_err(got[3], want[3]) < tol
