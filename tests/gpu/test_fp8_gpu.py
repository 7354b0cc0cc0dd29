"""precision=fp8 on a GPU with FP8 tensor cores: one FP8 layer of each backend against the
same layer in bf16 and an fp32 reference, forward and backward.

FP8's tolerance (components.precision.policies.FP8_LAYER_TOL): norm-wise relative error
||y - y_fp32|| / ||y_fp32|| of the output and of each gradient below 0.1 (e4m3 keeps 3
mantissa bits, e5m2 gradients 2; the rounding's rms is 2.5-5% per element). Each test also asserts the FP8 layer is further from fp32
than bf16 is, so a layer that silently ran in bf16 fails.

Skips without CUDA, on GPUs below compute capability 8.9, without torchao (torchao tests) or
without TransformerEngine (te tests).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")

from components.precision.policies import FP8_LAYER_TOL  # noqa: E402

TOKENS, DIM, HIDDEN = 4096, 2048, 1536


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def cc() -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(0))


def linear_case(make_fp8):
    """Output, input-grad and weight-grad errors of an FP8 linear and of bf16, vs fp32."""
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM, device="cuda")
    w = torch.randn(HIDDEN, DIM, device="cuda") / DIM ** 0.5
    g = torch.randn(TOKENS, HIDDEN, device="cuda")

    def run(fn, dtype):
        xx = x.to(dtype).requires_grad_()
        ww = w.to(dtype).requires_grad_() if fn is None else None
        if fn is None:
            y = xx @ ww.t()
            y.backward(g.to(dtype))
            return y, xx.grad, ww.grad
        layer = fn()
        with torch.no_grad():
            layer.weight.copy_(w)
        layer = layer.cuda()
        y = layer(xx)
        y.backward(g.to(y.dtype))
        return y, xx.grad, layer.weight.grad

    ref = run(None, torch.float32)
    bf16 = run(None, torch.bfloat16)
    fp8 = run(make_fp8, torch.bfloat16)
    return [rel(a, r) for a, r in zip(fp8, ref)], [rel(a, r) for a, r in zip(bf16, ref)]


def check(errs, base, what):
    names = ("output", "input grad", "weight grad")
    for n, e, b in zip(names, errs, base):
        assert e < FP8_LAYER_TOL, f"{what}: {n} rel error {e:.4f} above FP8 tolerance {FP8_LAYER_TOL}"
        assert e > b, f"{what}: {n} rel error {e:.2e} not above bf16's {b:.2e}: did FP8 run?"


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_torchao_dense_linear_matches_bf16(scaling):
    pytest.importorskip("torchao.float8")
    if scaling == "rowwise" and cc() < (9, 0):
        pytest.skip("rowwise scaled GEMMs need SM 9.0")
    from components.precision.policies import torchao_linear_config
    from components.precision.torchao_linear import ApiaryFloat8Linear

    ao = torchao_linear_config(scaling, fp8_all_gather=False)

    def make():
        m = ApiaryFloat8Linear.Config(in_features=DIM, out_features=HIDDEN, _torchao_config=ao).build()
        return m.to(torch.bfloat16)

    errs, base = linear_case(make)
    check(errs, base, f"torchao {scaling}")


def test_torchao_fp8_all_gather_weight_wrapped():
    pytest.importorskip("torchao.float8")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from components.precision.policies import torchao_linear_config
    from components.precision.torchao_linear import ApiaryFloat8Linear

    ao = torchao_linear_config("tensorwise", fp8_all_gather=True)
    m = ApiaryFloat8Linear.Config(in_features=DIM, out_features=HIDDEN, _torchao_config=ao).build()
    assert isinstance(m.weight, WeightWithDynamicFloat8CastTensor), type(m.weight)
    errs, base = linear_case(lambda: ApiaryFloat8Linear.Config(
        in_features=DIM, out_features=HIDDEN, _torchao_config=ao).build().to(torch.bfloat16))
    check(errs, base, "torchao tensorwise + fp8 all-gather weight")


def test_torchao_grouped_experts_match_bf16():
    pytest.importorskip("torchao.prototype.moe_training")
    if cc() < (9, 0):
        pytest.skip("FP8 grouped GEMMs need SM 9.0")
    from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls
    from torchtitan.models.common.moe import GroupedExperts

    E, D, F = 8, 1024, 512
    torch.manual_seed(0)
    counts = torch.tensor([640, 512, 384, 768, 256, 512, 640, 384], device="cuda")  # multiples of 16
    x = torch.randn(int(counts.sum()), D, device="cuda")
    g = torch.randn(int(counts.sum()), D, device="cuda")
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    with torch.device("cuda"):
        base_mod = cfg.build()
    with torch.no_grad():
        for p in base_mod.parameters():
            p.normal_(0, D ** -0.5)
    state = {k: v.detach().clone() for k, v in base_mod.state_dict().items()}

    def run(mod, dtype):
        xx = x.to(dtype).requires_grad_()
        y = mod(xx, counts)
        y.backward(g.to(y.dtype))
        return [y, xx.grad, *(p.grad for p in mod.parameters())]

    ref = run(base_mod, torch.float32)
    bf = cfg.build().cuda().to(torch.bfloat16)
    bf.load_state_dict(state)
    bf16 = run(bf, torch.bfloat16)
    fp8_cls = _get_float8_grouped_experts_cls(GroupedExperts)
    with torch.device("cuda"):
        q = fp8_cls.Config(dim=D, hidden_dim=F, num_experts=E).build()
    with torch.no_grad():
        for name, p in q.named_parameters():
            p.copy_(state[name])
    q = q.to(torch.bfloat16)
    fp8 = run(q, torch.bfloat16)
    names = ["output", "input grad", *(n for n, _ in base_mod.named_parameters())]
    for n, a, b, r in zip(names, fp8, bf16, ref):
        e, eb = rel(a, r), rel(b, r)
        assert e < FP8_LAYER_TOL, f"torchao grouped experts: {n} rel error {e:.4f} above {FP8_LAYER_TOL}"
        assert e > eb, f"torchao grouped experts: {n} rel error {e:.2e} not above bf16's {eb:.2e}"


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_te_dense_linear_matches_bf16(scaling):
    pytest.importorskip("transformer_engine.pytorch")
    if scaling == "blockwise" and cc() < (9, 0):
        pytest.skip("block-scaled FP8 needs SM 9.0")
    from components.precision.te import TELinear

    def make():
        with torch.device("cuda"):
            m = TELinear.Config(in_features=DIM, out_features=HIDDEN, scaling=scaling).build()
        return m.to(torch.bfloat16)

    errs, base = linear_case(make)
    check(errs, base, f"te {scaling}")
