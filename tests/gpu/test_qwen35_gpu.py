"""Qwen3.5 on CUDA: the torch GatedDeltaNet path (what CPU CI runs) and fla's kernels agree,
for one layer (forward and gradients, packed documents, bf16 and fp32) and for the whole
model; and, on 2 GPUs, CP=2 through fla's context-parallel kernels (head-tail = fla's
"zigzag" layout, and contiguous) matches CP=1 for logits, loss and gradients.

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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_gated_deltanet_torch_path_matches_fla(dtype, tol):
    fla, ref = _layer_pair(dtype)
    B, L = 2, 2048
    positions = torch.cat([torch.arange(700), torch.arange(1000), torch.arange(348)]).cuda().expand(B, L)
    x = torch.randn(B, L, 512, device="cuda", dtype=dtype, requires_grad=True)
    y_fla = fla(x, _context(positions, "fla"))
    y_ref = ref(x, _context(positions, "torch"))
    diff, scale = (y_fla.float() - y_ref.float()).abs().max(), y_ref.float().abs().max()
    assert diff <= tol * scale, (diff, scale)
    g = torch.randn_like(y_ref)
    pa, pb = list(fla.parameters()), list(ref.parameters())
    ga = torch.autograd.grad(y_fla, [x, *pa], g)
    gb = torch.autograd.grad(y_ref, [x, *pb], g)
    names = ["x"] + [n for n, _ in fla.named_parameters()]
    for n, a, b in zip(names, ga, gb):
        d, m = (a.float() - b.float()).abs().max(), b.float().abs().max()
        assert d <= 5 * tol * m + 1e-6, (n, d, m)


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
    assert (a - b).abs().max() <= 2e-3 * b.abs().max()
    a.float().logsumexp(-1).mean().backward()
    b.float().logsumexp(-1).mean().backward()
    for (n, p), (_, q) in zip(fla.named_parameters(), ref.named_parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-2 * q.grad.abs().max() + 1e-6, n


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
