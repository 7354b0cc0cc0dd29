"""precision=bf16|fp8 on CPU: resolve, refusal before launch, option combinations, the guarded
backend imports, the planner's FP8 terms and compare's FP8 tolerance.

The FP8 layers' numerics run on GPU (tests/gpu/test_fp8_gpu.py). Where torchao is importable,
the conversion of a model config and one emulated FP8 layer are also checked here.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from components.precision import checkpoint_storage, policies, torchao_fp8
from components.precision.policies import FP8, FP8_LAYER_TOL
from framework.errors import UserError
from framework.plan import planner
from framework.resolve.resolver import resolve
from tests.conftest import run_cli
from toolkit import compare

QWEN3 = ["model.n_layers=4", "training.seq_len=16384", "parallel.cp=1", "data.name=packaged", "data.tokenizer=byte",
         "recompute=full"]


def test_fp8_refused_on_cpu_before_launch(workdir):
    out = workdir / "run"
    p = run_cli(["train", "recipe=debug_moe", "precision=fp8", "training.steps=2", f"output_dir={out}"], workdir)
    assert p.returncode == 2, p.stderr
    assert "precision=fp8: FP8 training needs an NVIDIA GPU with FP8 tensor cores" in p.stderr
    assert "compute capability >= 8.9" in p.stderr and "precision=bf16" in p.stderr
    assert not out.exists() and not (workdir / "runs").exists()


def test_fp8_refused_on_gpu_without_fp8(monkeypatch):
    import torch

    from framework import devices

    monkeypatch.setattr(devices, "has_accelerator", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    why = policies.device_problem("tensorwise")
    assert "compute capability >= 8.9" in why and "A100" in why and "is 8.0" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    assert policies.device_problem("rowwise") is None
    assert "Blackwell" in policies.device_problem("mxfp8")  # Hopper has no MX tensor cores
    with pytest.raises(UserError, match="Blackwell"):
        FP8.check_runtime(FP8.Options(scaling="mxfp8"), None)


@pytest.mark.parametrize("overrides, needle", [
    (["precision.scaling=rowwise", "precision.all_gather=fp8"], "needs one scale per weight tensor"),
    (["precision.backend=te", "precision.scaling=rowwise", "precision.experts=false"],
     "precision.backend=te has no rowwise FP8 recipe"),
    (["precision.scaling=blockwise"], "precision.backend=torchao has no blockwise FP8 recipe"),
    (["precision.backend=te"], "converts dense linears only"),
    (["precision.scaling=e4m3"], "precision.scaling must be one of"),
    (["precision.backend=cublas"], "precision.backend must be one of"),
    (["precision.all_gather=sometimes"], "must be auto, fp8 or bf16"),
    (["state=zero1", "precision.all_gather=fp8"], "state=zero1 does not all-gather parameters"),
    (["moe.chunk=chunk2"], "moe.chunk=chunk2 does not run"),
])
def test_option_combinations_refused_when_resolving(overrides, needle):
    with pytest.raises(UserError, match="precision=fp8") as e:
        resolve("debug_moe", ["precision=fp8", *overrides], for_training=False)
    assert needle in str(e.value) and "docs/skills/fp8.md" in str(e.value)


def test_unknown_precision_and_bf16_options():
    with pytest.raises(UserError, match="unknown precision 'fp4'"):
        resolve("debug_moe", ["precision=fp4"], for_training=False)
    with pytest.raises(UserError, match="precision.scaling"):  # bf16 has no scaling to set
        resolve("debug_moe", ["precision.scaling=rowwise"], for_training=False)


def test_fp8_resolves_and_prints_on_cpu():
    r = resolve("debug_moe", ["precision=fp8"], for_training=False)
    p = r.cfg.precision
    assert (p.name, p.backend, p.scaling, p.experts, p.all_gather) == ("fp8", "torchao", "tensorwise", True, "auto")
    assert FP8.fp8_all_gather(p, r.cfg)  # auto: FP8 all-gather where the backend supports it
    r = resolve("debug_moe", ["precision=fp8", "precision.scaling=rowwise"], for_training=False)
    assert not FP8.fp8_all_gather(r.cfg.precision, r.cfg)
    r = resolve("debug_moe", ["precision=fp8", "state=zero1"], for_training=False)
    assert not FP8.fp8_all_gather(r.cfg.precision, r.cfg)
    r = resolve("debug_dense", ["precision=fp8", "precision.backend=te"], for_training=False)  # dense: no experts
    assert r.cfg.precision.backend == "te"
    assert resolve("debug_moe", [], for_training=False).cfg.precision.name == "bf16"


@pytest.mark.parametrize("backend, module, needle", [
    ("te", "transformer_engine", "scripts/build_te.sh"),
    ("torchao", "torchao", "pip install torchao==0.18.0"),
])
def test_missing_backend_is_a_user_error_before_launch(workdir, monkeypatch, backend, module, needle):
    monkeypatch.setattr(policies, "device_problem", lambda scaling: None)  # as on an H100
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    out = workdir / "run"
    with pytest.raises(UserError) as e:
        resolve("debug_dense", ["precision=fp8", f"precision.backend={backend}", f"output_dir={out}"])
    assert e.value.where == f"precision.backend={backend}" and needle in str(e.value)
    assert "not importable" in str(e.value) and not out.exists()


def test_te_with_compile_is_refused_before_launch(workdir, monkeypatch):
    """TE's linears under per-block compile were never run: refused with the torchao alternative."""
    monkeypatch.setattr(policies, "device_problem", lambda scaling: None)  # as on an H100
    monkeypatch.setattr(policies, "backend_problem", lambda backend: None)  # as with TE installed
    out = workdir / "run"
    with pytest.raises(UserError) as e:
        resolve("debug_dense", ["precision=fp8", "precision.backend=te", "precision.compile=true", f"output_dir={out}"])
    assert e.value.where == "precision.backend=te precision.compile=true"
    assert "precision.backend=torchao precision.compile=true" in str(e.value) and not out.exists()
    r = resolve("debug_moe", ["precision=fp8", "precision.compile=true", f"output_dir={workdir / 'ao'}"])  # torchao
    assert "FP8 for the MoE expert GEMMs only" in r.data_summary  # said before training starts


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compile_of_gated_deltanet_models_is_refused(workdir, precision):
    """torch.compile stopped inside fla's causal_conv1d at step 1 (Qwen3.5 on an H200): refused before launch."""
    with pytest.raises(UserError) as e:
        resolve("qwen35_debug_moe", [f"precision={precision}", "precision.compile=true", f"output_dir={workdir / 'r'}"],
                for_training=False)
    assert "GatedDeltaNet" in str(e.value) and "causal_conv1d" in str(e.value)


@pytest.mark.parametrize("recipe,extra,needle", [("debug_dense", [], "no MoE experts"),
                                                 ("debug_moe", ["precision.experts=false"], "precision.experts=false")])
def test_compiled_fp8_with_nothing_to_convert_is_refused(workdir, recipe, extra, needle):
    """Compiled FP8 converts the expert GEMMs only: a run without them would train bf16 under an fp8 name."""
    with pytest.raises(UserError) as e:
        resolve(recipe, ["precision=fp8", "precision.compile=true", *extra, f"output_dir={workdir / 'r'}"],
                for_training=False)
    assert needle in str(e.value) and "nothing would run in FP8" in str(e.value)


def test_policies_import_no_backend():
    """policies imports neither torchao nor TransformerEngine (bf16 runs never touch them)."""
    import subprocess

    code = ("import sys, components.precision.policies as p; "
            "assert not any(m.startswith(('torchao', 'transformer_engine')) for m in sys.modules), 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(policies.__file__).rsplit("/components", 1)[0])


def test_keep_bf16_names():
    assert policies.keep_bf16("lm_head") and policies.keep_bf16("layers.3.moe.router.gate")
    assert policies.keep_bf16("layers.0.moe.shared_experts.gate")
    assert not policies.keep_bf16("layers.0.moe.shared_experts.w1")
    assert not policies.fp8_linear("layers.0.delta_net.in_proj_a", 2048, 32 + 1)  # not a multiple of 16
    assert policies.fp8_linear("layers.0.attention.wo", 4096, 2048)


# --------------------------------------------------------------------------- planner
@pytest.fixture(scope="module")
def qwen3_plans():
    def p(*ov, gpus=1):
        r = resolve("qwen3_30b_a3b_64k", [*QWEN3, *ov], world_size=gpus, for_training=False)
        return planner.plan(r, gpu="H200")
    return {"bf16": p(), "fp8": p("precision=fp8"), "row": p("precision=fp8", "precision.scaling=rowwise"),
            "noexp": p("precision=fp8", "precision.experts=false"),
            "fp8x8": p("precision=fp8", gpus=8), "rowx8": p("precision=fp8", "precision.scaling=rowwise", gpus=8),
            "compiled": p("precision=fp8", "precision.compile=true")}


def test_planner_fp8_gemm_time(qwen3_plans):
    c = planner.Constants()
    b, f = qwen3_plans["bf16"].time_s, qwen3_plans["fp8"].time_s
    factor = 1 / c.fp8_flops_ratio + c.fp8_cast_overhead
    assert f["compute_experts"] == pytest.approx(b["compute_experts"] * factor)
    # dense blocks: everything but the routers (dim x experts per layer) runs in FP8
    r = resolve("qwen3_30b_a3b_64k", QWEN3, world_size=1, for_training=False)
    split = planner._param_split(r.facts, c)
    router = r.facts.n_layers * r.facts.dim * r.facts.num_experts
    share = (split["dense_blocks"] - router) / split["dense_blocks"]
    assert f["compute_dense"] == pytest.approx(b["compute_dense"] * ((1 - share) + share * factor))
    for k in ("compute_attention", "compute_lm_head", "optimizer"):  # bf16 parts unchanged
        assert f[k] == b[k]
    assert qwen3_plans["noexp"].time_s["compute_experts"] == b["compute_experts"]
    compiled = qwen3_plans["compiled"].time_s["compute_experts"]
    assert compiled == pytest.approx(b["compute_experts"] * (1 / c.fp8_flops_ratio + c.fp8_cast_overhead_compiled))
    # compiled: only the expert GEMMs run in FP8, the dense blocks keep bf16 time
    assert qwen3_plans["compiled"].time_s["compute_dense"] == pytest.approx(b["compute_dense"])
    assert any("dense linears (compiled) in bf16" in a for a in qwen3_plans["compiled"].assumptions)
    # fitted on an H200: FP8 with its casts is slower than bf16 at these shapes (as measured)
    assert qwen3_plans["fp8"].step_time_s > qwen3_plans["bf16"].step_time_s
    assert any("precision fp8 torchao tensorwise" in a for a in qwen3_plans["fp8"].assumptions)


def test_planner_fp8_memory_terms(qwen3_plans):
    c = planner.Constants()
    assert "fp8_weight_copies" not in qwen3_plans["bf16"].memory_bytes
    r = resolve("qwen3_30b_a3b_64k", QWEN3, world_size=1, for_training=False)
    f, split = r.facts, planner._param_split(r.facts, c)
    router = f.n_layers * f.dim * f.num_experts
    per_block = (split["dense_blocks"] - router) / f.n_layers + split["experts"] / f.n_layers
    assert qwen3_plans["fp8"].memory_bytes["fp8_weight_copies"] == round(per_block * c.fp8_copy_bytes)
    no_exp = (split["dense_blocks"] - router) / f.n_layers
    assert qwen3_plans["noexp"].memory_bytes["fp8_weight_copies"] == round(no_exp * c.fp8_copy_bytes)
    # tensorwise all-gathers the converted linears in FP8 (1 B): less FSDP buffer and traffic than rowwise
    t8, r8 = qwen3_plans["fp8x8"], qwen3_plans["rowx8"]
    assert t8.memory_bytes["fsdp_allgather"] <= r8.memory_bytes["fsdp_allgather"]
    assert t8.time_s.get("exposed_fsdp", 0) <= r8.time_s.get("exposed_fsdp", 0)


# --------------------------------------------------------------------------- compare
def _variant(precision="bf16", experts=8):
    cfg = SimpleNamespace(training=SimpleNamespace(dtype="bfloat16", local_batch=2, deterministic=False),
                          data=SimpleNamespace(sharding="blocks"), loss=SimpleNamespace(name="ce"),
                          precision=SimpleNamespace(name=precision))
    r = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(dp=1, dims={"dp_shard": 1, "ep": 1, "cp": 1, "tp": 1,
                                                                    "pp": 1}),
                        grad_accum=1, facts=SimpleNamespace(num_experts=experts))
    return compare.Variant(0, "v", "k=v", "0-v", [], resolved=r)


def test_compare_holds_precision_to_the_fp8_tolerance():
    pair = [_variant("bf16"), _variant("fp8")]
    kind, why = compare.classify("precision", pair, accelerator=True)
    assert kind == "fp8" and "mantissa" in why
    assert compare.classify("precision.scaling", pair, accelerator=True)[0] == "fp8"
    assert compare.classify("precision.compile", pair, accelerator=True)[0] == "bf16"
    t = compare.TOLERANCES["fp8"]
    assert (t.step0, t.curve, t.grad_norm) == (0.15, 2e-2, 0.15)
    base = {"label": "precision=bf16", "status": "ok", "steps": [1, 50], "loss": [5.0, 2.0],
            "grad_norm": [1.0, 1.0], "probe": None}
    ok = dict(base, label="precision=fp8", loss=[5.0, 2.03])
    ok["diff"] = compare.differences(base, ok)
    assert compare.check(base, ok, t) == []  # 1.5% at step 50
    bad = dict(base, label="precision=fp8", loss=[5.0, 2.1])
    bad["diff"] = compare.differences(base, bad)
    (v,) = compare.check(base, bad, t)
    assert v["metric"].startswith("loss curve") and v["tol"] == 2e-2


def test_compare_fp8_refused_on_cpu(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare.compare_main(["recipe=debug_moe", "precision=bf16,fp8", "training.steps=2",
                                 f"output_dir={out}", "--check"]) == 2
    assert "FP8 training needs an NVIDIA GPU" in capsys.readouterr().err and not out.exists()


# --------------------------------------------------------------------------- with torchao (optional here)
def test_torchao_conversion_of_a_moe_config():
    pytest.importorskip("torchao.float8")
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher

    from components.models import qwen3
    from components.precision.torchao_linear import ApiaryFloat8Linear

    spec = qwen3.model_spec("tiny_moe", attn_backend="flex", n_layers=None, vocab_size=None,
                            moe_comm_backend="standard", load_balance_coeff=1e-3)
    cfg = FP8.convert(FP8.Options(), spec.model, emulate=True)
    kinds = {fqn: type(lc) for fqn, lc, _, _ in cfg.traverse(Linear.Config)}
    assert kinds["lm_head"] is Linear.Config and kinds["layers.0.moe.router.gate"] is Linear.Config
    assert kinds["layers.0.attention.wo"] is ApiaryFloat8Linear.Config
    assert kinds["layers.1.attention.qkv_linear.wqkv"] is ApiaryFloat8Linear.Config
    experts = [(ec, parent) for _, ec, parent, _ in cfg.traverse(GroupedExperts.Config)]
    assert len(experts) == 2
    for ec, parent in experts:
        assert type(ec)._owner.__name__ == "Float8GroupedExperts"
        assert isinstance(parent.token_dispatcher, TorchAOTokenDispatcher.Config)
        assert parent.token_dispatcher.pad_multiple == 16
    no_exp = FP8.convert(FP8.Options(experts=False), qwen3.model_spec(
        "tiny_moe", attn_backend="flex", n_layers=None, vocab_size=None, moe_comm_backend="standard",
        load_balance_coeff=1e-3).model, emulate=True)
    assert all(type(ec) is GroupedExperts.Config for _, ec, _, _ in no_exp.traverse(GroupedExperts.Config))
    compiled = FP8.convert(FP8.Options(compile=True), qwen3.model_spec(
        "tiny_moe", attn_backend="flex", n_layers=None, vocab_size=None, moe_comm_backend="standard",
        load_balance_coeff=1e-3).model, emulate=True)
    # compiled: the expert GEMMs only (compiled FP8 dense linears gave NaN weight gradients on an H200)
    assert all(type(lc) is Linear.Config for _, lc, _, _ in compiled.traverse(Linear.Config))
    assert all(type(ec)._owner.__name__ == "Float8GroupedExperts"
               for _, ec, _, _ in compiled.traverse(GroupedExperts.Config))


@pytest.mark.parametrize("all_gather", [False, True])
def test_torchao_emulated_fp8_linear_matches_bf16(one_thread, all_gather):
    """One emulated FP8 linear (torchao's casts, fp32 matmul) against fp32 and bf16, fwd + bwd."""
    pytest.importorskip("torchao.float8")
    import torch
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from components.precision.torchao_linear import ApiaryFloat8Linear

    ao = torchao_fp8.torchao_linear_config("tensorwise", all_gather, emulate=True)
    layer = ApiaryFloat8Linear.Config(in_features=128, out_features=64, _torchao_config=ao).build()
    assert isinstance(layer.weight, WeightWithDynamicFloat8CastTensor) == all_gather
    torch.manual_seed(0)
    x, w, g = torch.randn(256, 128), torch.randn(64, 128) / 128 ** 0.5, torch.randn(256, 64)
    with torch.no_grad():
        layer.weight.copy_(w)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    def run(fn, dtype):
        xx = x.to(dtype).detach().clone().requires_grad_()
        ww = w.to(dtype).detach().clone().requires_grad_()
        y = fn(xx, ww)
        y.backward(g.to(y.dtype))
        return y, xx.grad, ww.grad

    ref = run(lambda a, b: a @ b.t(), torch.float32)
    bf16 = run(lambda a, b: a @ b.t(), torch.bfloat16)
    xx = x.clone().requires_grad_()
    y = layer(xx)
    y.backward(g)
    fp8 = (y, xx.grad, layer.weight.grad)
    for name, a, b, r in zip(("output", "input grad", "weight grad"), fp8, bf16, ref):
        assert rel(b, r) < rel(a, r) < FP8_LAYER_TOL, name


# --------------------------------------------------------------------------- build (trainer config)
def test_trainer_config_applies_precision(tmp_path):
    """precision.compile turns on torchtitan's per-block compile; bf16 leaves the model alone."""
    from torchtitan.models.common.linear import Linear

    from framework.train.build import trainer_config

    tc = trainer_config(resolve("debug_moe", [f"output_dir={tmp_path / 'a'}"], world_size=1, for_training=False))
    assert not tc.compile.enable
    assert all(type(lc) is Linear.Config for _, lc, _, _ in tc.model_spec.model.traverse(Linear.Config))
    tc = trainer_config(resolve("debug_moe", ["precision.compile=true", f"output_dir={tmp_path / 'b'}"],
                                world_size=1, for_training=False))
    assert tc.compile.enable and tc.compile.components == ["model"]


def test_trainer_config_fp8_without_an_fp8_gpu_fails_in_the_worker_too(tmp_path):
    """A launch that skipped resolve's check (Slurm on a login node) still stops before training."""
    from framework.train.build import trainer_config

    r = resolve("debug_moe", ["precision=fp8", f"output_dir={tmp_path}"], world_size=1, for_training=False)
    with pytest.raises(RuntimeError, match="precision=fp8: FP8 training needs an NVIDIA GPU"):
        trainer_config(r)


def test_trainer_config_fp8_all_gather_hook(tmp_path, monkeypatch):
    """torchao tensorwise: linears converted with FP8 all-gather, one amax pass after each optimizer step."""
    pytest.importorskip("torchao.float8")
    from framework.train.build import trainer_config

    monkeypatch.setattr(policies, "device_problem", lambda scaling: None)
    real = FP8.convert
    monkeypatch.setattr(FP8, "convert", staticmethod(lambda o, mc, emulate=True: real(o, mc, emulate=True)))
    r = resolve("debug_dense", ["precision=fp8", f"output_dir={tmp_path}"], world_size=1, for_training=False)
    tc = trainer_config(r)
    convs = [lc for _, lc, _, _ in tc.model_spec.model.traverse(type(tc.model_spec.model.lm_head))]
    assert any(getattr(lc, "_torchao_config", None) is not None and lc._torchao_config.enable_fsdp_float8_all_gather
               for lc in convs)
    hooks = []
    tc.model_spec.post_optimizer_build_fn(SimpleNamespace(register_step_post_hook=hooks.append), [], None)
    assert len(hooks) == 1


def test_fp8_checkpoints_hold_plain_tensors(tmp_path):
    """torchtitan's checkpoint wrapper with torchao's FP8 weight subclasses: saving, loading FP8 into
    FP8, a bf16 seed into FP8 and FP8 into bf16 (the patch in policies.patch_checkpoint_storage_check)."""
    pytest.importorskip("torchao.prototype.moe_training")
    import torch
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    from components.models import qwen3

    checkpoint_storage.patch_checkpoint_storage_check()

    def config():
        return qwen3.model_spec("tiny_moe", attn_backend="flex", n_layers=None, vocab_size=None,
                                moe_comm_backend="standard", load_balance_coeff=1e-3).model

    def build(fp8: bool, seed: int):
        torch.manual_seed(seed)
        m = (FP8.convert(FP8.Options(), config(), emulate=True) if fp8 else config()).build()
        m.init_states()
        return m

    def values(m):
        return {k: v.detach().float().clone() for k, v in ModelWrapper(m).state_dict().items()}

    def load(m, path):
        w = ModelWrapper(m)
        sd = w.state_dict()
        dcp.load(sd, checkpoint_id=str(path))
        w.load_state_dict(sd)

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    src, bf16 = build(True, 1), build(False, 2)
    assert type(src.layers["0"].attention.wo.weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    dcp.save(ModelWrapper(src).state_dict(), checkpoint_id=str(tmp_path / "fp8"))
    dcp.save(ModelWrapper(bf16).state_dict(), checkpoint_id=str(tmp_path / "bf16"))
    for saved, model, ref in ((tmp_path / "fp8", build(True, 3), src), (tmp_path / "bf16", build(True, 4), bf16),
                              (tmp_path / "fp8", build(False, 5), src)):
        assert not same(values(ref), values(model))
        load(model, saved)
        assert same(values(ref), values(model)), saved
