"""The optional per-token ``gen_logprobs`` rollout field (the decoupled TIS form, docs/skills/tis.md):
the readers shift and pad it like old_logprobs, the policy loss hands it to rl.py's objective
(unfused and fused paths) and measures the mismatch against it, short debug_grpo trainings with and
without it, and records that carry it only in part refused with file:line."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from components.data.follow import FollowRows
from components.data.rollout_loader import RolloutRows
from components.data.rollouts import RL_KEYS, read_rollouts
from components.losses import rl

from conftest import ROOT, policy_head_batch, read_metrics, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

PACKAGED = ROOT / "components" / "data" / "tiny_rollouts.jsonl"
RECORDS = [json.loads(line) for line in PACKAGED.read_text().splitlines() if line.strip()]
IGN = -100


def _with_gen(rec: dict, shift: float) -> dict:
    """The record with gen_logprobs = old_logprobs - shift on its trained tokens (old elsewhere)."""
    gen = [o - shift if m else o for o, m in zip(rec["old_logprobs"], rec["loss_mask"])]
    return {**rec, "gen_logprobs": gen}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ------------------------------------------------------------------ readers


def _small_records():
    a = {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1], "old_logprobs": [0, 0, -1.0, -2.0, -3.0],
         "gen_logprobs": [9, 9, -1.5, -2.25, -3.125], "advantages": 0.5}
    b = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "old_logprobs": [0, -4.0, -5.0],
         "gen_logprobs": [7, -4.5, -5.5], "advantages": -1.0}
    return a, b


def test_reader_shifts_and_pads_gen_logprobs_like_old_logprobs(tmp_path):
    assert "rl_gen_logprobs" in RL_KEYS
    f = _write(tmp_path / "r.jsonl", _small_records())
    out = read_rollouts(f, pad_multiple=4)  # one sequence per row, T = 5 -> 8
    assert out["gen_logprobs"].shape == out["old_logprobs"].shape == (2, 8)
    assert out["gen_logprobs"].tolist() == [[0, -1.5, -2.25, -3.125, 0, 0, 0, 0], [-4.5, -5.5, 0, 0, 0, 0, 0, 0]]
    assert out["old_logprobs"].tolist() == [[0, -1.0, -2.0, -3.0, 0, 0, 0, 0], [-4.0, -5.0, 0, 0, 0, 0, 0, 0]]
    packed = read_rollouts(f, pack_to=8)  # both in one row: the second sequence starts at column 5
    assert packed["gen_logprobs"].tolist() == [[0, -1.5, -2.25, -3.125, 0, -4.5, -5.5, 0]]
    # the trainer's loaders: batch key rl_gen_logprobs (static and follow), absent without the field
    rows = RolloutRows(str(f), seq_len=8, dp_rank=0, dp_world_size=1, local_batch=1, global_batch=1)
    sample, _ = next(iter(rows))
    assert sample["rl_gen_logprobs"].tolist() == packed["gen_logprobs"][0].tolist()
    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "000000.jsonl", _small_records())
    follow = FollowRows(str(shards), seq_len=8, dp_rank=0, dp_world_size=1, local_batch=1, global_batch=1)
    sample, _ = next(iter(follow))
    assert sample["rl_gen_logprobs"].tolist() == packed["gen_logprobs"][0].tolist()
    plain = _write(tmp_path / "plain.jsonl", [{k: v for k, v in r.items() if k != "gen_logprobs"}
                                              for r in _small_records()])
    assert "gen_logprobs" not in read_rollouts(plain)
    sample, _ = next(iter(RolloutRows(str(plain), seq_len=8, dp_rank=0, dp_world_size=1, local_batch=1,
                                      global_batch=1)))
    assert "rl_gen_logprobs" not in sample


def test_malformed_gen_logprobs_are_named(tmp_path):
    a, b = _small_records()
    with pytest.raises(ValueError, match=r"r\.jsonl:2: gen_logprobs has 2 entries, input_ids 3"):
        read_rollouts(_write(tmp_path / "r.jsonl", [a, {**b, "gen_logprobs": [0, 1]}]))
    with pytest.raises(ValueError, match=r"s\.jsonl:1: gen_logprobs holds a value that is not a number"):
        read_rollouts(_write(tmp_path / "s.jsonl", [{**a, "gen_logprobs": [0, 0, "x", 0, 0]}, b]))


def test_mixed_presence_is_refused_naming_file_and_line(tmp_path):
    a, b = _small_records()
    nogen = {k: v for k, v in b.items() if k != "gen_logprobs"}
    with pytest.raises(ValueError, match=r"r\.jsonl:3: gen_logprobs missing here but present in .*r\.jsonl:1"):
        read_rollouts(_write(tmp_path / "r.jsonl", [a, b, nogen]))
    # follow mode: across shards, the shard that breaks the rule stops the stream at its record
    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "000000.jsonl", [a, b])
    _write(shards / "000001.jsonl", [nogen, nogen])
    follow = FollowRows(str(shards), seq_len=8, dp_rank=0, dp_world_size=1, local_batch=1, global_batch=4)
    with pytest.raises(ValueError, match=r"000001\.jsonl:1: gen_logprobs missing here but present in .*000000"):
        follow.ready()


# ------------------------------------------------------------------ the policy loss


def _policy(backend, objective="grpo", hp=None):
    from components.losses import policy

    hidden, w, labels, mask, _, old, gen, adv = policy_head_batch(old_noise=0.2, gen_noise=0.4)
    hp = hp or dict(eps=0.2, kl_coef=0.0, norm="token", tis_cap=1.1)
    batch = {"rl_old_logprobs": old, "rl_advantages": adv, "rl_gen_logprobs": gen}
    cfg = SimpleNamespace(objective=objective, hparams=dict(hp), temperature=0.9, entropy_coef=0.0, backend=backend,
                          chunk_tokens=5, chunk_vocab=16384, workspace_mb=256.0, logits_dtype="float32",
                          dw_accum="float32", mismatch_threshold=0.1)
    me = SimpleNamespace(config=cfg, batch=batch, seq_group=None)
    h2 = hidden.reshape(-1, hidden.shape[-1]).clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    loss = policy.policy_loss(me, h2, w2, labels, mask.sum())
    loss.backward()
    return loss, me.metrics, h2.grad, w2.grad, (hidden, w, labels, mask, old, gen, adv, hp)


def test_loss_with_gen_logprobs_is_rl_objective_by_hand():
    """Unfused path: rl.grpo(..., tis_cap, gen_logprobs) on the same log-probs (to fp32 rounding: the
    component sums the tokens' terms in chunks, the reference in one reduction), the mismatch
    metrics against gen_logprobs; the fused path equals it."""
    from components.losses.logprob import token_logprobs

    loss, metrics, dh, dw, (hidden, w, labels, mask, old, gen, adv, hp) = _policy("torch")
    hh = hidden.reshape(-1, hidden.shape[-1]).clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    lp, _ = token_logprobs(hh, ww, labels.reshape(-1), temperature=0.9, backend="torch")
    lp = lp.reshape(labels.shape)
    ref, ref_m = rl.grpo(lp, old, adv, mask, **hp, gen_logprobs=gen, normalizer=mask.sum().float())
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(dh, hh.grad, rtol=1e-5, atol=1e-7) and torch.allclose(dw, ww.grad, rtol=1e-5, atol=1e-7)
    assert metrics["tis_weight_mean"].item() == pytest.approx(ref_m["tis_weight_mean"].item(), rel=1e-6)
    assert 0 < metrics["tis_capped_frac"].item() < 1
    want = rl.mismatch_metrics(lp, gen, mask, 0.1)
    for k, v in want.items():
        assert metrics[k].item() == pytest.approx(v.item(), rel=1e-6), k
    assert want["mismatch_abs_mean"].item() != rl.mismatch_metrics(lp, old, mask, 0.1)["mismatch_abs_mean"].item()
    # without gen_logprobs the objective is another one (the on-the-fly form)
    other, _ = rl.grpo(lp.detach(), old, adv, mask, **hp, normalizer=mask.sum().float())
    assert other.item() != pytest.approx(ref.item(), rel=1e-4)
    # the fused path slices gen_logprobs per chunk like old_logprobs
    fl, fm, fdh, fdw, _ = _policy("fwdgrad")
    assert fl.item() == pytest.approx(loss.item(), rel=1e-6)
    for k in metrics:
        assert fm[k].item() == pytest.approx(metrics[k].item(), rel=1e-5, abs=1e-7), k
    assert torch.allclose(fdh, dh, rtol=1e-5, atol=1e-7) and torch.allclose(fdw, dw, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ short trainings


def test_debug_grpo_with_gen_logprobs(workdir):
    """gen = old - 0.3 on every trained token, rl.tis_cap=1.1: every weight is min(e^0.3, 1.1) = 1.1,
    so step 1's loss and grad norm are 1.1 x the run without gen_logprobs (same weights); gen == old
    with a cap never reached: the run without TIS. Side by side (mostly start-up
    time): rollouts with gen_logprobs in some records only stop before launch, exit 2, file:line."""
    shifted = _write(workdir / "shifted.jsonl", [_with_gen(r, 0.3) for r in RECORDS])
    same = _write(workdir / "same.jsonl", [_with_gen(r, 0.0) for r in RECORDS])
    mixed = _write(workdir / "mixed.jsonl", [_with_gen(RECORDS[0], 0.3), RECORDS[1]])
    common = ["train", "recipe=debug_grpo", "training.steps=1", "training.local_batch=2", "checkpoint.enable=false",
              "logging.tensorboard=false", "lr.warmup_steps=0"]
    runs = [[*common, "output_dir=plain"],
            [*common, f"data.path={shifted}", "rl.tis_cap=1.1", "output_dir=shifted"],
            [*common, f"data.path={same}", "rl.tis_cap=1e9", "output_dir=same"],
            ["train", "recipe=debug_grpo", f"data.path={mixed}", "training.steps=1", "output_dir=mixed"]]
    with ThreadPoolExecutor(len(runs)) as pool:
        *ok, refused = pool.map(lambda argv: run_cli(argv, cwd=workdir, env={"OMP_NUM_THREADS": "1"}), runs)
    for p in ok:
        assert p.returncode == 0, p.stderr[-3000:]
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "mixed.jsonl:2" in refused.stderr and "gen_logprobs" in refused.stderr, refused.stderr[-2000:]
    assert not (workdir / "mixed").exists()
    plain, shifted, same = (read_metrics(workdir / d) for d in ("plain", "shifted", "same"))
    assert len(plain) == len(shifted) == len(same) == 1
    for a, b in zip(plain, same):
        for k in ("loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-6), k
        assert b["policy/tis_weight_mean"] == 1.0 and b["policy/tis_capped_frac"] == 0.0
        assert b["policy/mismatch_abs_mean"] == pytest.approx(a["policy/mismatch_abs_mean"], rel=1e-6)
    for r in shifted:
        assert r["policy/tis_weight_mean"] == pytest.approx(1.1, rel=1e-6) and r["policy/tis_capped_frac"] == 1.0
    assert shifted[0]["loss"] == pytest.approx(1.1 * plain[0]["loss"], rel=1e-5)
    assert shifted[0]["grad_norm"] == pytest.approx(1.1 * plain[0]["grad_norm"], rel=1e-4)
    assert shifted[0]["loss"] != pytest.approx(plain[0]["loss"], rel=1e-3)
    # the mismatch is measured against gen_logprobs: 0.3 further from the trainer on every token
    assert shifted[0]["policy/mismatch_kl"] != pytest.approx(plain[0]["policy/mismatch_kl"], rel=1e-3)
