"""precision=fp8 on a GPU with FP8 tensor cores: one FP8 layer of each backend against the
same layer in bf16 and an fp32 reference, forward and backward.

FP8's tolerance (components.precision.policies.FP8_LAYER_TOL): norm-wise relative error
||y - y_fp32|| / ||y_fp32|| of the output and of each gradient below 0.1 (e4m3 keeps 3
mantissa bits, e5m2 gradients 2; the rounding's rms is 2.5-5% per element). Each test also asserts
the FP8 layer is further from fp32 than bf16 is, so a layer that silently ran in bf16 fails.

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
        xx = x.to(dtype).detach().clone().requires_grad_()
        ww = w.to(dtype).detach().clone().requires_grad_() if fn is None else None
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
    from components.precision.torchao_fp8 import torchao_linear_config
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

    from components.precision.torchao_fp8 import torchao_linear_config
    from components.precision.torchao_linear import ApiaryFloat8Linear

    ao = torchao_linear_config("tensorwise", fp8_all_gather=True)
    m = ApiaryFloat8Linear.Config(in_features=DIM, out_features=HIDDEN, _torchao_config=ao).build()
    assert isinstance(m.weight, WeightWithDynamicFloat8CastTensor), type(m.weight)
    errs, base = linear_case(lambda: ApiaryFloat8Linear.Config(
        in_features=DIM, out_features=HIDDEN, _torchao_config=ao).build().to(torch.bfloat16))
    check(errs, base, "torchao tensorwise + fp8 all-gather weight")


def test_torchao_grouped_experts_match_bf16():
    """torchtitan's GroupedExperts (bf16 grouped GEMMs) and its FP8 conversion (torchao rowwise
    scaled grouped GEMMs) against an fp32 per-expert loop, forward and backward."""
    pytest.importorskip("torchao.prototype.moe_training")
    if cc() < (9, 0):
        pytest.skip("FP8 grouped GEMMs need SM 9.0")
    import torch.nn.functional as F
    from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls
    from torchtitan.models.common.moe import GroupedExperts

    E, D, H = 8, 1024, 512
    torch.manual_seed(0)
    counts = torch.tensor([640, 512, 384, 768, 256, 512, 640, 384], device="cuda")  # multiples of 16
    R = int(counts.sum())
    x, g = torch.randn(R, D, device="cuda"), torch.randn(R, D, device="cuda")
    weights = {"w1_EFD": torch.randn(E, H, D, device="cuda") * D ** -0.5,
               "w2_EDF": torch.randn(E, D, H, device="cuda") * H ** -0.5,
               "w3_EFD": torch.randn(E, H, D, device="cuda") * D ** -0.5}

    def reference():
        xx = x.clone().requires_grad_()
        ws = {k: v.clone().requires_grad_() for k, v in weights.items()}
        outs = []
        for e, xe in enumerate(torch.split(xx, counts.tolist())):
            h = F.silu(xe @ ws["w1_EFD"][e].t()) * (xe @ ws["w3_EFD"][e].t())
            outs.append(h @ ws["w2_EDF"][e].t())
        y = torch.cat(outs)
        y.backward(g)
        return [y, xx.grad, *(ws[k].grad for k in sorted(ws))]

    def module_run(cls):
        with torch.device("cuda"):
            mod = cls.Config(dim=D, hidden_dim=H, num_experts=E).build()
        with torch.no_grad():
            for name, p in mod.named_parameters():
                p.copy_(weights[name])
        xx = x.to(torch.bfloat16).requires_grad_()
        y = mod(xx, counts)
        y.backward(g.to(y.dtype))
        params = dict(mod.named_parameters())
        return [y, xx.grad, *(params[k].grad for k in sorted(params))]

    ref = reference()
    bf16 = module_run(GroupedExperts)
    fp8 = module_run(_get_float8_grouped_experts_cls(GroupedExperts))
    names = ["output", "input grad", *sorted(weights)]
    for n, a, b, r in zip(names, fp8, bf16, ref):
        e, eb = rel(a, r), rel(b, r)
        assert e < FP8_LAYER_TOL, f"torchao grouped experts: {n} rel error {e:.4f} above {FP8_LAYER_TOL}"
        assert e > eb, f"torchao grouped experts: {n} rel error {e:.2e} not above bf16's {eb:.2e}: did FP8 run?"


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
