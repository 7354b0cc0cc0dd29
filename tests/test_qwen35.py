"""Text-only Qwen3.5: architecture numbers, the torch GatedDeltaNet path, HuggingFace parity
(fp32 logits of a random tiny Qwen3_5MoeForCausalLM), export/import round trips, and a
3-step CPU training run exported to HF and read back."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from framework import devices

devices.install()  # before torchtitan is imported (CPU shims), as the trainer does

from components.models import qwen3_5, qwen3_5_hf  # noqa: E402
from framework.api import build_model  # noqa: E402
from framework.errors import UserError  # noqa: E402

HF_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.modules["fla"] = None  # else transformers routes GatedDeltaNet to fla's Triton kernels
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    out = sys.argv[1]
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0]})
    torch.manual_seed(0)
    m = Qwen3_5MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # every weight random, so that each one matters
        for n, p in m.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif "norm" in n:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "linear_attn.norm" in n else 0.0))
            else:
                p.normal_(0, 0.1)
    m.save_pretrained(out)
    tokens = torch.randint(0, 320, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": m(tokens).logits}, out + "/reference.pt")
""")


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tiny")
    p = subprocess.run([sys.executable, "-c", HF_SCRIPT, str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


# ---------------------------------------------------------------- architecture

@pytest.mark.parametrize("flavor", qwen3_5.TORCHTITAN_FLAVORS)
def test_flavors_carry_torchtitans_numbers(flavor):
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    tt = qwen3_5_configs[flavor](attn_backend="flex")
    ours = qwen3_5.build_config(qwen3_5.FLAVORS[flavor])
    assert (ours.dim, ours.vocab_size, len(ours.layers)) == (tt.dim, tt.vocab_size, len(tt.layers))
    for a, b in zip(ours.layers, tt.layers):
        assert (a.attention is None) == (b.attention is None)
        if a.attention is not None:
            for k in ("n_heads", "n_kv_heads", "head_dim", "rotary_dim"):
                assert getattr(a.attention, k) == getattr(b.attention, k), k
            assert a.attention.rope.theta == b.attention.rope.theta
        else:
            for k in ("in_proj_q", "in_proj_v", "in_proj_a", "out_proj"):
                x, y = getattr(a.delta_net, k), getattr(b.delta_net, k)
                assert (x.in_features, x.out_features) == (y.in_features, y.out_features), k
            assert a.delta_net.key_head_dim == b.delta_net.key_head_dim
        if b.moe is not None:
            assert a.moe.num_experts == b.moe.num_experts and a.moe.router.top_k == b.moe.router.top_k
            assert a.moe.routed_experts.inner_experts.hidden_dim == b.moe.routed_experts.inner_experts.hidden_dim
            assert a.moe.shared_experts.w1.out_features == b.moe.shared_experts.w1.out_features
        else:
            assert a.moe is None and a.feed_forward.w1.out_features == b.feed_forward.w1.out_features


@pytest.mark.parametrize("flavor,billions,active", [("35B-A3B", 34.66, 3.45), ("122B-A10B", 122.11, 9.77),
                                                    ("397B-A17B", 396.35, 17.35), ("27B", 26.90, 26.90)])
def test_facts_meta_count_matches_formula_and_name(flavor, billions, active):
    f = qwen3_5.facts(flavor)
    total, experts = qwen3_5.analytic_counts(qwen3_5.FLAVORS[flavor])
    assert (f.n_params, f.n_expert_params) == (total, experts)
    assert abs(f.n_params / 1e9 - billions) < 0.01 and abs(f.n_active_params / 1e9 - active) < 0.01


def test_n_layers_keeps_the_hybrid_pattern():
    cfg = qwen3_5.model_config("debug_moe", n_layers=8)
    assert [i for i, l in enumerate(cfg.layers) if l.attention is not None] == [3, 7]
    f = qwen3_5.facts("35B-A3B", n_layers=6)
    assert (f.n_layers, f.n_attention_layers, f.n_linear_attention_layers) == (6, 1, 5)


# ---------------------------------------------------------------- torch GatedDeltaNet path

def test_torch_gated_delta_rule_matches_recurrence_with_documents_and_state():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as naive

    from components.models.gated_deltanet_ops import causal_conv, chunk_gated_delta_rule, l2norm

    torch.manual_seed(0)
    B, T, H, HV, K, V = 2, 150, 2, 4, 8, 6
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, g, beta = torch.randn(B, T, HV, V), -torch.rand(B, T, HV), torch.rand(B, T, HV)
    s0 = torch.randn(B, HV, K, V)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk=16)
    qe, ke = (l2norm(x.repeat_interleave(2, dim=2)) for x in (q, k))
    ro, rs = naive(qe, ke, v, beta, g, initial_state=s0, output_final_state=True)
    assert (o - ro).abs().max() < 1e-5 and (s - rs).abs().max() < 1e-5
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[:, 0] = resets[0, 37] = resets[0, 64] = resets[1, 100] = True  # packed documents
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, resets=resets, chunk=16)
    x, w = torch.randn(B, T, 5), torch.randn(5, 1, 4)
    c = causal_conv(x, w, resets)
    for b in range(B):
        starts = resets[b].nonzero().flatten().tolist() + [T]
        for lo, hi in zip(starts[:-1], starts[1:]):
            r, _ = naive(qe[b:b + 1, lo:hi], ke[b:b + 1, lo:hi], v[b:b + 1, lo:hi], beta[b:b + 1, lo:hi],
                         g[b:b + 1, lo:hi])
            assert (o[b:b + 1, lo:hi] - r).abs().max() < 1e-5
            ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x[b:b + 1, lo:hi].transpose(1, 2), (3, 0)),
                                             w, groups=5)
            assert (c[b:b + 1, lo:hi] - torch.nn.functional.silu(ref).transpose(1, 2)).abs().max() < 1e-5


def test_cpu_uses_the_torch_path():
    cfg = qwen3_5.model_config("debug_moe")
    kernels = [l.delta_net.kernel.backend for l in cfg.layers if l.delta_net is not None]
    assert kernels == ["torch"] * 3 and devices.linear_attention_backend() == "torch"


# ---------------------------------------------------------------- HuggingFace

def test_hf_checkpoint_gives_hf_logits(hf_tiny):
    ref = torch.load(hf_tiny / "reference.pt")
    model = build_model("qwen35_debug_moe", hf_checkpoint=str(hf_tiny))
    with torch.no_grad():
        logits = model(ref["tokens"])
    assert logits.shape == ref["logits"].shape == (2, 150, 320)
    assert logits.dtype == torch.float32
    # two fp32 implementations of one forward (chunked vs HF's delta-rule algebra, other matmul
    # groupings): no drift over steps, only op-order rounding; measured 1.75e-5 max (5.2e-6 of the
    # largest |logit| 3.34, mean 9.5e-7; Intel Xeon, 2026-11-24), so 1e-4 leaves ~6x for another
    # CPU's SIMD reductions while a wrong weight mapping moves logits by O(0.1)
    assert (logits - ref["logits"]).abs().max().item() <= 1e-4


def test_export_reimport_round_trips_exactly(hf_tiny, tmp_path):
    from safetensors.torch import load_file

    model = build_model("qwen3_5:debug_moe", hf_checkpoint=str(hf_tiny))
    out = qwen3_5_hf.save_hf(model.state_dict(), qwen3_5.FLAVORS["debug_moe"], str(tmp_path / "hf"), model.config)
    exported, original = load_file(out / "model.safetensors"), load_file(hf_tiny / "model.safetensors")
    assert exported.keys() == original.keys()  # the hub's text layout, experts one by one
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert qwen3_5_hf.arch_from_hf_config(out) == qwen3_5_hf.arch_from_hf_config(hf_tiny)
    again = build_model("qwen3_5:debug_moe", hf_checkpoint=str(out))
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_recipe_settings_that_contradict_the_checkpoint_are_user_errors(hf_tiny):
    with pytest.raises(UserError) as e:
        build_model("qwen35_debug_moe", hf_checkpoint=str(hf_tiny), n_layers=8)
    assert "model.n_layers=8" in str(e.value) and "4 layers" in str(e.value)
    with pytest.raises(UserError) as e:
        build_model("qwen35_debug_moe", hf_checkpoint=str(hf_tiny), vocab_size=256)
    assert "model.vocab_size=256" in str(e.value) and "vocabulary is 320" in str(e.value)
    # the flavor supplies defaults only: a dense flavor loads the MoE checkpoint's architecture
    assert build_model("qwen3_5:debug_dense", hf_checkpoint=str(hf_tiny)).config.layers[0].moe is not None


def test_arch_from_multimodal_config_reads_its_text_config(hf_tiny):
    text = json.loads((hf_tiny / "config.json").read_text())
    mm = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 27}}
    assert qwen3_5_hf.arch_from_hf_config(mm) == qwen3_5_hf.arch_from_hf_config(hf_tiny)
    assert qwen3_5_hf.arch_from_hf_config(mm) == qwen3_5.FLAVORS["debug_moe"]
    odd = dict(text, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    assert qwen3_5_hf.arch_from_hf_config(odd).full_attention_interval == 2
    odd["layer_types"] = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(UserError):
        qwen3_5_hf.arch_from_hf_config(odd)
    with pytest.raises(UserError):
        qwen3_5_hf.arch_from_hf_config({"model_type": "llama"})


def test_multimodal_keys_load_and_vision_is_skipped(hf_tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(hf_tiny / "model.safetensors")
    mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    mm["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    mm["mtp.fc.weight"] = torch.zeros(2)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(mm, out / "model.safetensors")
    text = json.loads((hf_tiny / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    a = build_model("qwen3_5:debug_moe", hf_checkpoint=str(hf_tiny)).state_dict()
    b = build_model("qwen3_5:debug_moe", hf_checkpoint=str(out)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- training

def test_train_three_steps_then_export(workdir, monkeypatch, capsys):
    """`train recipe=qwen35_debug_moe training.steps=3` (in this process: the console entry's code
    path without a second interpreter start), then `apiary export RUN --hf OUT` and read back."""
    import os

    from framework.cli import train_main

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    steps = ["recipe=qwen35_debug_moe", "training.steps=3", "training.seq_len=128", "training.local_batch=2",
             "checkpoint.interval=3", "recompute=none", "output_dir=run"]
    try:
        code = train_main(steps)
    finally:
        torch.set_num_threads(threads)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    assert "step     3/3" in out.out
    m = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in m) and m[-1]["loss"] < m[0]["loss"]
    out = qwen3_5.export_hf(str(workdir / "run"), str(workdir / "hf"), dtype="float32")
    model = build_model("qwen35_debug_moe", hf_checkpoint=str(out))
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items() if k in dict(model.named_parameters())}
    dcp.load(sd, checkpoint_id=str(workdir / "run" / "checkpoint" / "step-3"), no_dist=True)
    params = dict(model.named_parameters())
    assert len(sd) == len(params) and all(torch.equal(params[k], v) for k, v in sd.items())


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.cp_load_balancer=ptrr"], "contiguous parts"),
    (["training.seq_len=384"], "multiple of cp x 128 = 256"),
    (["model.attn_backend=varlen"], "all-gathers K/V for flex"),
])
def test_layouts_this_family_cannot_run_are_user_errors(overrides, needle):
    from framework.compose.recipes import load
    from framework.resolve.layout import Layout

    cfg = load("qwen35_debug_moe", overrides)
    lay = Layout(world_size=2, dp_replicate=1, dp_shard=1, cp=2, ep=2, pp=1, tp=1)
    with pytest.raises(UserError) as e:
        qwen3_5.check_layout(cfg, lay)
    assert needle in str(e.value)
    qwen3_5.check_layout(load("qwen35_debug_moe", []), lay)  # headtail, flex, 256 tokens: fine
    with pytest.raises(UserError):
        qwen3_5.check_layout(cfg, Layout(world_size=2, dp_replicate=1, dp_shard=1, cp=1, ep=1, pp=1, tp=2))


def test_flex_autotune_switch(tmp_path):
    """model.flex_autotune=false (the default) recompiles flex attention without inductor's two
    tuners (the long first-step tuning at head dim 256); true restores torchtitan's options."""
    from framework import devices

    devices.install()
    from torchtitan.models.common.attention import FlexAttention

    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    before, before_options = FlexAttention._compiled_flex_attn, devices.FLEX_COMPILE_OPTIONS
    devices.FLEX_COMPILE_OPTIONS = None  # as in a fresh process (earlier tests may have compiled it already)
    try:
        trainer_config(resolve("qwen35_debug_moe", [f"output_dir={tmp_path}"], world_size=1, for_training=False))
        assert FlexAttention._compiled_flex_attn is not before
        assert devices.FLEX_COMPILE_OPTIONS["max_autotune"] is False
        assert devices.FLEX_COMPILE_OPTIONS["coordinate_descent_tuning"] is False
        assert devices.FLEX_COMPILE_OPTIONS["wrap_inductor_compiled_regions"] is True
        trainer_config(resolve("qwen35_debug_moe", ["model.flex_autotune=true", f"output_dir={tmp_path}"],
                               world_size=1, for_training=False))
        assert devices.FLEX_COMPILE_OPTIONS == FlexAttention.inductor_configs
    finally:
        FlexAttention._compiled_flex_attn = before
        devices.FLEX_COMPILE_OPTIONS = before_options


def test_fla_fp32_training_warns_once(caplog, monkeypatch):
    from components.models import gated_deltanet as gdn

    monkeypatch.setattr(gdn, "_FP32_WARNED", False)
    assert not gdn.warn_fla_fp32(torch.bfloat16, training=True)
    assert not gdn.warn_fla_fp32(torch.float32, training=False)  # inference / reference logprobs
    with caplog.at_level("WARNING", logger=gdn.__name__):
        assert gdn.warn_fla_fp32(torch.float32, training=True)
        assert not gdn.warn_fla_fp32(torch.float32, training=True)
    [record] = caplog.records
    assert "fp32 gate gradients" in record.getMessage() and "training.dtype=bfloat16" in record.getMessage()
