"""Training-inference mismatch metrics (policy/mismatch_*) and truncated importance sampling
(rl.tis_cap): the objectives with TIS against the uncorrected ones and against hand-written fp64
references, the metrics by hand, the trainer's reduction (means weighted by tokens, ``_max`` keys
max-reduced over micro-steps and ranks), the fused path == the unfused one, a short GRPO training
and the refusals (docs/skills/tis.md)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from components.losses import rl
from components.losses.fused_rl import fused_policy_loss

from conftest import policy_head_batch, read_metrics, run_cli, train_here

pytestmark = pytest.mark.usefixtures("one_thread")

IGN = -100
TOKEN_OBJECTIVES = [("ppo", dict(eps=0.2)), ("dapo", dict(eps_low=0.2, eps_high=0.28)),
                    ("grpo", dict(eps=0.2, norm="sequence")), ("cispo", dict(eps_high=0.28))]


def _case(seed=0, b=3, t=7, spread=0.6):
    """fp64 log-probs (a leaf), generator log-probs ``spread`` away, per-row advantages, a mask."""
    g = torch.Generator().manual_seed(seed)
    lp = (-2 + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[:, 0] = True
    return lp, old, adv, mask


def _loss_grad(name, hp, lp, old, adv, mask, **kw):
    x = lp.detach().clone().requires_grad_(True)
    loss, metrics = rl.objective(name)(x, old, adv, mask, None, **hp, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g, metrics


# --- the objectives ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,hp", [*TOKEN_OBJECTIVES, ("gspo", dict(eps_low=3e-4, eps_high=4e-4))])
def test_on_policy_with_an_unreached_cap_is_the_uncorrected_objective(name, hp):
    """logp == old_logprobs and a cap never reached: every weight is exp(0) = 1 and the surrogate's
    ratio is 1 either way, so loss and gradient are the uncorrected ones, bit for bit."""
    lp, _, adv, mask = _case()
    old = lp.detach().clone()
    l0, g0, _ = _loss_grad(name, hp, lp, old, adv, mask)
    l1, g1, m1 = _loss_grad(name, hp, lp, old, adv, mask, tis_cap=1e6)
    assert torch.equal(l1, l0) and torch.equal(g1, g0)
    assert m1["tis_weight_mean"].item() == 1.0 and m1["tis_capped_frac"].item() == 0.0


def _reference(name, hp, lp, old, adv, mask, cap):
    """Hand-written TIS objective, explicit loops, fp64: sum over trained tokens of
    min(exp(lp - old), C) x the surrogate with its ratio against sg(lp) (= 1 in value, gradient of
    lp), normalised as the objective (token mean, or GRPO's sequence mean). Returns (loss, dloss/dlp)."""
    b, t = lp.shape
    loss, grad = 0.0, torch.zeros(b, t, dtype=torch.float64)
    n_tok = int(mask.sum())
    seq = name == "grpo" and hp.get("norm", "sequence") == "sequence"
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j]]
        for j in toks:
            w = min(math.exp(lp[i, j].item() - old[i, j].item()), cap)
            a = adv[i].item()
            scale = 1.0 / (b * len(toks)) if seq else 1.0 / n_tok
            if name == "cispo":  # -w * clip(1) * A * logp: value carries logp, gradient -w A
                loss += -w * a * lp[i, j].item() * scale
            else:  # -w * min(1 * A, clip(1) * A) = -w A; d/dlp of the ratio exp(lp - sg lp) is 1
                loss += -w * a * scale
            grad[i, j] = -w * a * scale
    return loss, grad


@pytest.mark.parametrize("name,hp", TOKEN_OBJECTIVES)
def test_tis_matches_the_hand_written_reference_and_changes_the_objective(name, hp):
    lp, old, adv, mask = _case(spread=0.6)
    cap = 1.3
    ratios = torch.exp(lp.detach() - old)[mask]
    assert (ratios > cap).any() and (ratios < cap).any()  # some weights capped, some not
    loss, g, metrics = _loss_grad(name, hp, lp, old, adv, mask, tis_cap=cap)
    want_loss, want_g = _reference(name, hp, lp, old, adv, mask, cap)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    assert torch.allclose(g, want_g, rtol=1e-12, atol=1e-15)
    assert g[~mask].abs().max() == 0  # untrained tokens: no gradient
    assert metrics["tis_capped_frac"].item() == pytest.approx((ratios > cap).double().mean().item())
    l0, g0, m0 = _loss_grad(name, hp, lp, old, adv, mask)  # uncorrected: other numbers
    assert abs(loss.item() - l0.item()) > 1e-3 and not torch.allclose(g, g0)


@pytest.mark.parametrize("name,hp", TOKEN_OBJECTIVES)
def test_a_capped_token_gradient_scales_by_cap_over_ratio(name, hp):
    """Precisely: against the same objective with an unreached cap, the gradient of a token whose
    ratio rho = exp(logp - old) exceeds C is multiplied by C / rho; every other token's is unchanged."""
    lp, old, adv, mask = _case(seed=1, spread=0.6)
    cap = 1.3
    _, g_cap, _ = _loss_grad(name, hp, lp, old, adv, mask, tis_cap=cap)
    _, g_free, _ = _loss_grad(name, hp, lp, old, adv, mask, tis_cap=1e9)
    rho = torch.exp(lp.detach() - old)
    over = mask & (rho > cap)
    under = mask & (rho <= cap)
    assert over.sum() >= 2 and under.sum() >= 2
    assert torch.allclose(g_cap[over] / g_free[over], cap / rho[over], rtol=1e-12)
    assert torch.equal(g_cap[under], g_free[under])


def test_uncapped_tis_keeps_the_gradient_ppo_clips():
    """Without a cap reached, on-the-fly TIS is the untruncated importance-sampled gradient rho A:
    equal to PPO's where PPO's clip is inactive, and nonzero where PPO's clip zeroes it."""
    lp, old, adv, mask = _case(seed=2, spread=0.6)
    hp = dict(eps=0.2)
    _, g_ppo, m = _loss_grad("ppo", hp, lp, old, adv, mask)
    _, g_tis, _ = _loss_grad("ppo", hp, lp, old, adv, mask, tis_cap=1e9)
    rho = torch.exp(lp.detach() - old)
    a = adv[:, None].expand_as(rho)
    clipped = mask & (((rho > 1.2) & (a > 0)) | ((rho < 0.8) & (a < 0)))
    free = mask & ~clipped
    assert clipped.any() and free.any()
    assert torch.allclose(g_tis[free], g_ppo[free], rtol=1e-12)
    assert g_ppo[clipped].abs().max() == 0 and g_tis[clipped].abs().min() > 0
    assert torch.allclose(g_tis[mask], (-rho * a / mask.sum())[mask], rtol=1e-12)


def test_gspo_sequence_level_tis():
    """GSPO: each sequence term weighted by min(exp(mean_t(logp - old)), C); its ratio is 1."""
    lp, old, adv, mask = _case(seed=3, spread=0.3)
    cap = 1.05
    loss, g, _ = _loss_grad("gspo", {}, lp, old, adv, mask, tis_cap=cap)
    b = lp.shape[0]
    want, want_g = 0.0, torch.zeros_like(g)
    for i in range(b):
        n = int(mask[i].sum())
        w = min(math.exp(((lp.detach()[i] - old[i])[mask[i]]).mean().item()), cap)
        want += -w * adv[i].item() / b
        want_g[i, mask[i]] = -w * adv[i].item() / (b * n)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert torch.allclose(g, want_g, rtol=1e-12, atol=1e-15)


def test_decoupled_form_with_gen_logprobs():
    """With gen_logprobs (trainer-side old policy in old_logprobs): w = min(exp(old - gen), C)
    multiplies the unchanged surrogate (ratio against old_logprobs)."""
    lp, old, adv, mask = _case(seed=4, spread=0.1)
    gen = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    cap = 1.2
    loss, g, _ = _loss_grad("dapo", {}, lp, old, adv, mask, tis_cap=cap, gen_logprobs=gen)
    x = lp.detach().clone().requires_grad_(True)
    r = torch.exp(x - old)
    a = adv[:, None]
    surr = torch.minimum(r * a, torch.clamp(r, 0.8, 1.28) * a)
    w = torch.clamp(torch.exp(old - gen), max=cap)
    want = -(w * surr * mask).sum() / mask.sum()
    (want_g,) = torch.autograd.grad(want, x)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(g, want_g, rtol=1e-12, atol=1e-15)


# --- the mismatch metrics --------------------------------------------------------------------------


def _hand_metrics(lp, gen, mask, thr):
    d = [g - x for x, g, m in zip(lp, gen, mask) if m]
    return {"mismatch_abs_mean": sum(abs(v) for v in d) / len(d), "mismatch_abs_max": max(abs(v) for v in d),
            "mismatch_kl": sum(math.exp(-v) - 1 + v for v in d) / len(d),
            "mismatch_frac": sum(abs(v) > thr for v in d) / len(d)}


def test_mismatch_metrics_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -4.0, -1.0]])
    gen = torch.tensor([[-1.05, -2.5, -0.5, -9.0], [-1.2, -0.25, -3.0, -1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])  # -9 is not trained
    got = rl.mismatch_metrics(lp, gen, mask, threshold=0.1)
    want = _hand_metrics(lp.flatten().tolist(), gen.flatten().tolist(), mask.flatten().tolist(), 0.1)
    assert want["mismatch_abs_max"] == pytest.approx(1.0) and want["mismatch_frac"] == pytest.approx(3 / 6)
    for k, v in want.items():
        assert got[k].item() == pytest.approx(v, rel=1e-6), k
    empty = rl.mismatch_metrics(lp, gen, torch.zeros_like(mask), threshold=0.1)
    assert all(v.item() == 0.0 for v in empty.values())


@pytest.mark.parametrize("backend", ["torch", "fwdgrad"])
def test_policy_loss_logs_the_mismatch_of_the_log_probs_it_trains_on(backend):
    """The trainer's PolicyLoss (unfused and fused paths): policy/mismatch_* of the trained tokens'
    log-probs against the rollouts' old_logprobs, by hand; tis_cap passes through hparams."""
    from components.losses import policy

    hidden, w, labels, mask, lp, old, _, adv = policy_head_batch()
    batch = {"rl_old_logprobs": old, "rl_advantages": adv}
    cfg = SimpleNamespace(objective="dapo", hparams=dict(eps_low=0.2, eps_high=0.28, norm="token", tis_cap=1.2),
                          temperature=0.9, entropy_coef=0.0, backend=backend, chunk_tokens=5, chunk_vocab=16384,
                          workspace_mb=256.0, logits_dtype="float32", dw_accum="float32", mismatch_threshold=0.25)
    me = SimpleNamespace(config=cfg, batch=batch, seq_group=None)
    h2 = hidden.reshape(-1, hidden.shape[-1]).clone().requires_grad_(True)
    loss = policy.policy_loss(me, h2, w.clone().requires_grad_(True), labels, mask.sum())
    want = _hand_metrics(lp.flatten().tolist(), old.flatten().tolist(), mask.flatten().tolist(), 0.25)
    assert 0 < want["mismatch_frac"] < 1
    for k, v in want.items():
        assert me.metrics[k].item() == pytest.approx(v, rel=1e-5), k
    assert me.metric_weight.item() == mask.sum().item()
    x = lp.clone().requires_grad_(True)
    ref, _ = rl.dapo(x, old, adv, mask, tis_cap=1.2)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert 0 < me.metrics["tis_capped_frac"].item() < 1


def test_fused_path_metrics_and_gradients_equal_the_unfused_with_tis():
    from components.losses.logprob import token_logprobs

    hidden, w, labels, mask, _, old, _, adv = policy_head_batch(seed=1)
    hp = dict(eps=0.2, norm="token", tis_cap=1.15)
    out = []
    for fused in (False, True):
        hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fused:
            loss, m = fused_policy_loss(hh, ww, labels, "grpo", old, adv, mask, hparams=hp, temperature=0.9,
                                        chunk_tokens=4, logits_dtype="float32", mismatch_threshold=0.1)
        else:
            lp, _ = token_logprobs(hh, ww, labels, temperature=0.9, backend="torch")
            loss, m = rl.grpo(lp, old, adv, mask, **hp)
            m = {**m, **rl.mismatch_metrics(lp, old, mask, 0.1)}
        loss.backward()
        out.append((loss.item(), m, hh.grad, ww.grad))
    (l0, m0, dh0, dw0), (l1, m1, dh1, dw1) = out
    assert l1 == pytest.approx(l0, rel=1e-6) and set(m0) == set(m1)
    for k in m0:
        assert m1[k].item() == pytest.approx(m0[k].item(), rel=1e-5, abs=1e-7), k
    assert m0["tis_capped_frac"].item() > 0
    assert torch.allclose(dh1, dh0, rtol=1e-5, atol=1e-7) and torch.allclose(dw1, dw0, rtol=1e-5, atol=1e-7)


# --- the trainer's reduction ---------------------------------------------------------------------


class _Loss:
    metrics: dict = {}
    metric_weight = None


def _fake_trainer(monkeypatch):
    """An ApiaryTrainer shell: its forward_backward_step and _policy_metrics, the parent's step stubbed."""
    from torchtitan.trainer import Trainer

    from framework.train.trainer import ApiaryTrainer

    monkeypatch.setattr(Trainer, "forward_backward_step", lambda self, **kw: torch.tensor(1.0))
    t = object.__new__(ApiaryTrainer)
    t.config = SimpleNamespace(on_nonfinite="stop")
    t.metrics_processor = SimpleNamespace(extra_source=object(), max_loss_source=None)
    t.loss_fn = _Loss()
    t.parallel_dims = SimpleNamespace(dp_cp_enabled=False, pp_enabled=False)
    t._policy_sums, t._policy_tokens, t._bad_loss = {}, 0.0, None
    return t


def _micro_step(t, tokens, abs_mean, abs_max):
    t.loss_fn.metrics = {"mismatch_abs_mean": torch.tensor(abs_mean), "mismatch_abs_max": torch.tensor(abs_max)}
    t.loss_fn.metric_weight = torch.tensor(float(tokens))
    t.forward_backward_step(input_dict={}, labels=torch.zeros(1), global_valid_tokens=None)


def test_trainer_max_reduces_max_keys_over_micro_steps_and_ranks(monkeypatch):
    """Means are token-weighted; a ``_max`` key is the max over micro-steps (and ranks: the
    all-reduce is asked for MAX; here two ranks are simulated by combining with the other rank's
    tensors); a micro-step without trained tokens does not count."""
    import torch.distributed as dist

    ranks = []
    for steps in ([(10, 0.1, 0.4), (30, 0.3, 0.9), (0, 0.0, 5.0)], [(20, 0.2, 1.7)]):
        t = _fake_trainer(monkeypatch)
        for s in steps:
            _micro_step(t, *s)
        ranks.append(t)
    alone = ranks[0]._policy_metrics()  # one rank, 2 micro-steps with tokens (the empty one ignored)
    assert alone["policy/mismatch_abs_max"] == pytest.approx(0.9)
    assert alone["policy/mismatch_abs_mean"] == pytest.approx((10 * 0.1 + 30 * 0.3) / 40)

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, op=dist.ReduceOp.SUM, group=None: seen.append(x.clone()))
    for t in ranks:
        t.parallel_dims = SimpleNamespace(dp_cp_enabled=True, pp_enabled=False, get_optional_mesh=lambda name: SimpleNamespace(
            get_group=lambda: None))
    ranks[1]._policy_metrics()  # records rank 1's tensors in call order
    other = list(seen)

    def combine(x, op=dist.ReduceOp.SUM, group=None):
        y = other.pop(0)
        x.copy_(torch.maximum(x, y) if op == dist.ReduceOp.MAX else x + y)

    monkeypatch.setattr(dist, "all_reduce", combine)
    both = ranks[0]._policy_metrics()
    assert both["policy/mismatch_abs_max"] == pytest.approx(1.7)  # the max, not a mean
    assert both["policy/mismatch_abs_mean"] == pytest.approx((10 * 0.1 + 30 * 0.3 + 20 * 0.2) / 60)


# --- a training and the refusals -----------------------------------------------------------------


def test_grpo_with_tis_is_untruncated_is_while_no_weight_is_capped(workdir, capsys, one_thread):
    """debug_grpo's packaged rollouts (old_logprobs = -ln 320, |logp - old| < ln 2 over these steps):
    with rl.tis_cap=2 no weight is capped, so the objective is the untruncated importance-sampled
    one, i.e. GRPO with a clip range too wide to clip (loss.eps=1e9); the run with TIS uses 2
    micro-steps per step (local_batch 2 of global 4) and must log the same step-1 mismatch metrics,
    the max a max over the micro-steps. The default GRPO clips these ratios (eps 0.2 < the
    mismatch), so its loss differs (checked in the unit tests above)."""
    common = ["train", "recipe=debug_grpo", "training.steps=2", "checkpoint.enable=false", "logging.tensorboard=false",
              "lr.warmup_steps=0"]
    runs = [[*common, "loss.eps=1e9", "output_dir=wide"],
            [*common, "rl.tis_cap=2", "training.local_batch=2", "training.global_batch=4", "output_dir=tis"]]
    for argv in runs:  # in this process, one thread each
        p = train_here(argv, workdir, capsys)
        assert p.returncode == 0, p.stderr[-3000:]
    wide, tis = read_metrics(workdir / "wide"), read_metrics(workdir / "tis")
    keys = {f"policy/mismatch_{k}" for k in ("abs_mean", "abs_max", "kl", "frac")}
    for r in wide + tis:
        assert keys <= set(r)
    for r in tis:
        assert r["policy/tis_capped_frac"] == 0.0 and r["policy/mismatch_abs_max"] < math.log(2)
        assert r["policy/clip_low_frac"] == r["policy/clip_high_frac"] == 0.0  # the surrogate's ratio is 1
        assert r["policy/mismatch_frac"] > 0
    for k in keys:  # same weights at step 1: the same numbers over 1 or 2 micro-steps
        assert tis[0][k] == pytest.approx(wide[0][k], rel=1e-5, abs=1e-7), k
    for a, b in zip(wide, tis):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("args,key", [
    (["recipe=debug_grpo", "rl.tis_cap=0"], "rl.tis_cap=0"),
    (["recipe=debug_grpo", "rl.tis_cap=-1"], "rl.tis_cap=-1"),
    (["recipe=debug_grpo", "rl.tis_cap=nan"], "rl.tis_cap=nan"),
    (["recipe=debug_grpo", "rl.mismatch_threshold=-0.5"], "rl.mismatch_threshold=-0.5"),
    (["recipe=debug_grpo", "loss=sft", "rl.tis_cap=2"], "rl.tis_cap=2"),
    (["recipe=debug_moe", "rl.tis_cap=2"], "rl.tis_cap=2"),
    (["recipe=debug_moe", "rl.mismatch_threshold=0.3"], "rl.mismatch_threshold=0.3"),
])
def test_bad_values_are_refused_before_launch(args, key):
    from framework.errors import UserError
    from framework.resolve import resolver as resolve

    with pytest.raises(UserError) as e:
        resolve.resolve(args[0].split("=")[1], args[1:], world_size=1, for_training=False)
    assert str(e.value).startswith(key) or key in str(e.value), str(e.value)


def test_bad_cap_exits_2_naming_the_key(workdir):
    p = run_cli(["train", "recipe=debug_grpo", "rl.tis_cap=0"], cwd=workdir)
    assert p.returncode == 2 and "rl.tis_cap=0" in p.stderr, p.stderr[-2000:]
    assert not (workdir / "runs").exists()
