"""loss=ce_zloss (components/losses/ce_zloss.py): cross-entropy + z-loss on materialised logits,
the unfused partner of linear_ce's z_loss, and the worked example of docs/architecture.md.

Paired: against an fp64 reference (loss and logits gradient), against torchtitan's cross-entropy
at z_loss=0, against linear_ce with the same z_loss (loss, dH, dW), and in training (the step-1
loss of `train loss=ce_zloss` equals `train loss=linear_ce loss.z_loss=C`'s)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from components.losses.ce_zloss import ZLossCrossEntropy, ZLossCrossEntropyLoss
from components.losses.linear_ce import linear_cross_entropy

from conftest import IGN, ROOT, assert_rel, lm_head_data, read_metrics, rel_close, run_cli, train_here


def _reference(logits: torch.Tensor, labels: torch.Tensor, z: float) -> torch.Tensor:
    """fp64: sum over valid tokens of (lse - s_y + z lse^2), divided by the valid-token count."""
    x = logits.double().flatten(0, -2)
    y = labels.flatten()
    keep = y != IGN
    lse = torch.logsumexp(x, -1)
    s_y = x.gather(1, y.clamp_min(0)[:, None])[:, 0]
    per = (lse - s_y + z * lse * lse)[keep]
    return per.sum() / keep.sum()


@pytest.mark.parametrize("z", [0.0, 1e-4, 0.05])
def test_loss_and_gradient_match_the_fp64_reference(z, one_thread):
    h, w, labels = lm_head_data(24, 16, 40, torch.float32)
    logits = (h @ w.T).reshape(2, 12, 40).requires_grad_(True)
    lab = labels.reshape(2, 12)
    n = (lab != IGN).sum()
    loss, _ = ZLossCrossEntropyLoss(ZLossCrossEntropyLoss.Config(z_loss=z, global_vocab_size=40))(logits, lab, n)
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = _reference(ref_logits, lab, z)
    ref.backward()
    assert rel_close(loss.item(), ref.item(), 1e-6)
    assert_rel(logits.grad, ref_logits.grad, 1e-5)


def test_zero_coefficient_is_torchtitans_cross_entropy(one_thread):
    from torchtitan.components.loss import CrossEntropyLoss  # reason: after components (device shims first)

    h, w, labels = lm_head_data(24, 16, 40, torch.float32, seed=3)
    logits, lab = (h @ w.T).reshape(2, 12, 40), labels.reshape(2, 12)
    n = (lab != IGN).sum()
    ours, _ = ZLossCrossEntropyLoss(ZLossCrossEntropyLoss.Config(z_loss=0.0, global_vocab_size=40))(logits, lab, n)
    theirs, _ = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=40))(logits, lab, n)
    assert torch.equal(ours, theirs)


def test_equals_linear_ce_with_the_same_z_loss(one_thread):
    """The partner: the fused head's z_loss (no logits) and this loss on h @ W^T agree in fp32."""
    z = 1e-3
    h, w, labels = lm_head_data(32, 16, 48, torch.float32, seed=5)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    n = (labels != IGN).sum()
    fused = linear_cross_entropy(h1, w1, labels, z_loss=z, backend="torch") / n
    fused.backward()
    ours, _ = ZLossCrossEntropyLoss(ZLossCrossEntropyLoss.Config(z_loss=z, global_vocab_size=48))(
        (h2 @ w2.T)[None], labels[None], n)
    ours.backward()
    assert rel_close(fused.item(), ours.item(), 1e-6)
    assert_rel(h1.grad, h2.grad, 1e-5)
    assert_rel(w1.grad, w2.grad, 1e-5)


def test_options_and_layout_are_checked_before_launch():
    with pytest.raises(ValueError, match="loss.z_loss must be >= 0"):
        ZLossCrossEntropy.Options(z_loss=-1.0)
    ctx = SimpleNamespace(choice=lambda kind: "text", layout=SimpleNamespace(tp=2))
    with pytest.raises(ValueError, match="needs parallel.tp=1"):
        ZLossCrossEntropy.check(ZLossCrossEntropy.Options(), ctx)
    ctx = SimpleNamespace(choice=lambda kind: "rollouts", layout=SimpleNamespace(tp=1))
    with pytest.raises(ValueError, match="trains on data.format=text"):
        ZLossCrossEntropy.check(ZLossCrossEntropy.Options(), ctx)


def test_trains_and_matches_linear_ce_at_step_one(workdir, capsys, one_thread):
    """`train loss=ce_zloss` takes effect: its fp32 step-1 loss equals linear_ce's with the same
    z_loss, and differs from plain ce's by the z term."""
    common = ["recipe=debug_moe", "training.steps=1", "training.seq_len=32", "training.dtype=float32",
              "checkpoint.enable=false", "logging.tensorboard=false"]
    first = {}
    runs = (("zloss", ["loss=ce_zloss", "loss.z_loss=0.01"]), ("linear", ["loss=linear_ce", "loss.z_loss=0.01"]),
            ("ce", ["loss=ce"]))
    for name, extra in runs:  # in this process, one thread each
        p = train_here(["train", *common, *extra, f"output_dir={workdir / name}"], workdir, capsys)
        assert p.returncode == 0, p.stderr[-3000:]
        first[name] = read_metrics(workdir / name)[0]["loss"]
    assert rel_close(first["zloss"], first["linear"], 1e-5), first
    assert first["zloss"] > first["ce"] * (1 + 1e-3), first  # lse^2 ~ (log 320)^2 ~ 33 per token: +0.33


def test_bad_z_loss_exits_2_before_any_worker(workdir):
    p = run_cli(["train", "recipe=debug_moe", "loss=ce_zloss", "loss.z_loss=-1"], cwd=workdir, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "loss.z_loss must be >= 0" in p.stderr
    assert not (workdir / "runs").exists()


def test_the_worked_example_in_architecture_md_is_this_code():
    """docs/architecture.md shows the example's files verbatim: each fenced block headed by a path
    (``# file: PATH``) is that file's text, or one line of it for registry.yaml."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```[a-z]*\n# file: (\S+)\n(.*?)```", doc, flags=re.S)
    assert {p for p, _ in blocks} >= {"components/losses/ce_zloss.py", "registry.yaml",
                                      "docs/skills/ce_zloss.md", "tests/test_ce_zloss.py"}
    for path, text in blocks:
        real = (ROOT / path).read_text()
        assert text.strip() in real, f"docs/architecture.md's block for {path} is not in {path}"
    assert Path(__file__).name == "test_ce_zloss.py"
