"""Qwen3.5 on CUDA: the torch GatedDeltaNet path (what CPU CI runs) and fla's kernels agree,
for one layer (forward and gradients, packed documents, bf16 and fp32) and for the whole
model; and, on 2 GPUs, CP=2 through fla's context-parallel kernels (head-tail = fla's
"zigzag" layout, and contiguous) matches CP=1 for logits, loss and gradients. In fp32, fla's
gate gradients (A_log, dt_bias, in_proj_a) do not agree: test_fla_fp32_gate_gradients is a
strict xfail that records it (it fails once fla's fp32 path agrees).

    python -m pytest -q tests/gpu/test_qwen35_gpu.py        # skipped without CUDA
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
torch.backends.cudnn.enabled = False  # the H200 image's cuDNN is older than torch 2.14's (shared/FACTS.md)


def _layer_pair(dtype):
    from components.models import qwen3_5
    from components.models.gated_deltanet import GatedDeltaRule
    from framework import devices

    # full-size GatedDeltaNet heads of 35B-A3B (16 key / 32 value heads of 128) at a small width
    arch = qwen3_5.Arch(dim=512, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, rotary_dim=16,
                        linear_key_heads=16, linear_value_heads=32, linear_key_head_dim=128,
                        linear_value_head_dim=128, vocab_size=320, ffn_hidden_dim=256, mrope_section=(3, 3, 2))
    cfg = qwen3_5.build_config(arch, linear_backend="fla").layers[0].delta_net
    torch.manual_seed(0)
    with torch.device("cuda"):
        fla = cfg.build()
        fla.init_states(buffer_device=torch.device("cuda"))
    ref = copy.deepcopy(fla)
    ref.kernel = GatedDeltaRule.Config(backend="torch").build()
    assert devices.linear_attention_backend() == "fla"
    return fla.to(dtype), ref.to(dtype)


def _context(positions, backend):
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from components.models.gated_deltanet import GDNContext

    varlen = create_varlen_metadata_for_document(positions, include_host_offsets=True) if backend == "fla" else None
    return GDNContext(resets=positions == 0, varlen=varlen)


GATE = ("A_log", "dt_bias", "in_proj_a")  # parameters whose gradient flows only through g
FLA_FP32_GATE = (
    "fla 0.6.0's fp32 chunk kernels (H200, Triton 3.8) give the gate gradient (dg -> A_log, dt_bias, "
    "in_proj_a) 10%-12% off in the layer test and 1% to 40x off on the debug model's small gate "
    "grads, while every other gradient agrees to <= 3.4e-3; the torch path matches fp64 to 1e-5 on CPU "
    "and fla in bf16 (the training dtype) agrees with it (gate gradients to 1%). Measured 2026-11-22.")


def _is_gate(name):
    return any(name.endswith(g) or name.endswith(g + ".weight") for g in GATE)


def _assert_close(pairs, rtol):
    """max|a - b| <= rtol * max|b| for every (name, a, b); prints every pair's numbers and reports
    all failures together."""
    failed = []
    for name, a, b in pairs:
        diff, own = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
        print(f"{name:48s} diff {diff:.3e}  max|ref| {own:.3e}  rel {diff / max(own, 1e-30):.2e}")
        if not diff <= rtol * own:
            failed.append(f"{name}: diff {diff:.3e} > {rtol} x {own:.3e}")
    assert not failed, "; ".join(failed)


def _layer_grads(dtype):
    fla, ref = _layer_pair(dtype)
    B, L = 2, 2048
    positions = torch.cat([torch.arange(700), torch.arange(1000), torch.arange(348)]).cuda().expand(B, L)
    x = torch.randn(B, L, 512, device="cuda", dtype=dtype, requires_grad=True)
    y_fla = fla(x, _context(positions, "fla"))
    y_ref = ref(x, _context(positions, "torch"))
    g = torch.randn_like(y_ref)
    pa, pb = list(fla.parameters()), list(ref.parameters())
    ga = torch.autograd.grad(y_fla, [x, *pa], g)
    gb = torch.autograd.grad(y_ref, [x, *pb], g)
    names = ["x"] + [n for n, _ in fla.named_parameters()]
    return [("out", y_fla, y_ref)], list(zip(names, ga, gb))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_gated_deltanet_torch_path_matches_fla(dtype, tol):
    out, grads = _layer_grads(dtype)
    _assert_close(out, tol)
    if dtype == torch.float32:  # the gate gradients: test_fla_fp32_gate_gradients
        grads = [g for g in grads if not _is_gate(g[0])]
    _assert_close(grads, 5 * tol)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=FLA_FP32_GATE)
def test_fla_fp32_gate_gradients():
    _, grads = _layer_grads(torch.float32)
    _assert_close([g for g in grads if _is_gate(g[0])], 2.5e-2)


def test_whole_model_torch_path_matches_fla():
    from framework.api import build_model

    fla = build_model("qwen3_5:debug_moe", device="cuda")
    ref = build_model("qwen3_5:debug_moe", device="cuda", linear_backend="torch")
    ref.load_state_dict(fla.state_dict())
    tokens = torch.randint(0, 320, (2, 512), device="cuda")
    positions = torch.cat([torch.arange(300), torch.arange(212)]).cuda().expand(2, 512)
    masks = fla.get_attention_masks(positions)
    a = fla(tokens, positions=positions, attention_masks=masks)
    b = ref(tokens, positions=positions, attention_masks=masks)
    _assert_close([("logits", a, b)], 2e-3)
    a.float().logsumexp(-1).mean().backward()
    b.float().logsumexp(-1).mean().backward()
    grads = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(fla.named_parameters(), ref.named_parameters())]
    _assert_close([g for g in grads if not _is_gate(g[0])], 1e-2)  # fp32 gate grads: see FLA_FP32_GATE


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fla_context_parallel_matches_cp1(tmp_path):
    from test_qwen35_cp import CASES, SEQ, run_cp_cases

    results = run_cp_cases(tmp_path, device="cuda", world=2)
    for r in results:
        for name, _, _ in CASES:
            res = r[name]
            assert res["local_len"] == SEQ // 2
            assert res["logits"] <= 2e-3 * res["logit_scale"], (name, res)
            assert res["loss"] <= 1e-4 * res["ref_loss"], (name, res)
            assert res["grad"] <= 1e-2 * res["grad_scale"], (name, res)
