"""One FLOPs count: the planner's model FLOPs per token (causal attention halved, an adapter's frozen
GEMMs without weight gradients) is what a run logs as ``tflops_per_gpu`` and MFU, with torchtitan's
count (full attention, every weight's gradient) beside it as ``tflops_per_gpu_torchtitan``.

No GPU: the counts against hand computations on the tiny dense model, the metrics processor's
computation directly, and a metrics.jsonl record through a faked GPU (a CPU run logs no TFLOPs)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from framework.plan import planner
from framework.report import metrics
from framework.resolve.resolver import resolve

# tiny_dense (debug_dense): dim 64, 2 layers, 4 heads x 16 (q 64), 2 KV heads (kv 32), SwiGLU 192,
# vocab 320, untied head, training.seq_len 256
SEQ, LAYERS, HEADS, HEAD_DIM = 256, 2, 4, 16
PER_LAYER = (64 * 64 + 2 * 64 * 32 + 64 * 64  # wq, wk, wv, wo
             + 3 * 64 * 192  # w1, w2, w3
             + 2 * 64 + 2 * 16)  # attention and FFN norms, q and k norms
HEAD = 320 * 64 + 64  # lm_head and the final norm
MATMUL = LAYERS * PER_LAYER + HEAD  # every parameter but the embedding (a lookup): 119,168
FULL_ATTENTION = 12 * SEQ * HEADS * HEAD_DIM * LAYERS  # scores and values, fwd + bwd, every (query, key) pair
RANK = 4
ADAPTERS = RANK * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)) * LAYERS  # q, k, v, o (the default targets)


@pytest.fixture(scope="module")
def dense():
    return resolve("debug_dense", [], for_training=False)


@pytest.fixture(scope="module")
def lora():
    return resolve("debug_dense", ["adapter=lora", f"adapter.rank={RANK}"], for_training=False)


def test_causal_attention_counts_half_the_full_score_and_value_flops(dense):
    assert MATMUL == 119_168 and dense.facts.n_params == MATMUL + 320 * 64
    full = 6 * MATMUL + FULL_ATTENTION  # torchtitan's convention (get_dense_model_nparams_and_flops)
    got = planner.model_flops_per_token(dense)
    assert got == 6 * MATMUL + FULL_ATTENTION / 2 == 911_616
    assert full - got == 6 * SEQ * HEADS * HEAD_DIM * LAYERS  # exactly the masked half of QK^T and PV
    # the plan's TFLOPs/GPU count the same FLOPs per token
    p = planner.plan(dense)
    assert p.flops_per_token == got
    assert p.tflops_per_gpu * 1e12 / p.tokens_per_s_per_gpu == pytest.approx(got, rel=1e-9)


def test_lora_counts_the_frozen_gemms_without_weight_gradients(dense, lora):
    """Each frozen weight costs forward (2) and input gradient (2) FLOPs per token, not the weight
    gradient's 2 more; the adapters train in full (6 per parameter); attention's own FLOPs stay."""
    full, got = planner.model_flops_per_token(dense), planner.model_flops_per_token(lora)
    assert full - got == 2 * MATMUL - 6 * ADAPTERS
    assert got == 4 * MATMUL + 6 * ADAPTERS + FULL_ATTENTION / 2 == 694_784
    p = planner.plan(lora)
    assert p.flops_per_token == got
    assert any("frozen GEMMs without weight gradients" in a for a in p.assumptions)
    # the step time follows the FLOPs, as before the count moved from the time factor to flops_factor
    assert p.time_s["compute_dense"] < planner.plan(dense).time_s["compute_dense"]


def test_the_metrics_processor_computes_apiarys_count_and_keeps_torchtitans():
    tt = {"throughput(tps)": 2000.0, "tflops": 7.0, "mfu(%)": 0.7, "loss_metrics/global_avg_loss": 1.0}
    out = metrics.counted(tt, 911_616.0, peak_flops=989e12, quantized=False)
    assert out["tflops"] == pytest.approx(911_616 * 2000 / 1e12)
    assert out["mfu(%)"] == pytest.approx(100 * 911_616 * 2000 / 989e12)
    assert out["tflops_torchtitan"] == 7.0 and out["loss_metrics/global_avg_loss"] == 1.0
    assert "mfu(%)" not in metrics.counted(tt, 911_616.0, peak_flops=None, quantized=False)  # no known peak
    assert "mfu(%)" not in metrics.counted(tt, 911_616.0, peak_flops=989e12, quantized=True)  # FP8 GEMMs
    none = metrics.counted(tt, None, peak_flops=989e12, quantized=False)  # no count: torchtitan's is not passed off
    assert "tflops" not in none and "mfu(%)" not in none and none["tflops_torchtitan"] == 7.0
    val = {"validation_metrics/loss": 2.0, "validation_metrics/throughput(tps)": 10.0}
    assert metrics.counted(val, 1.0, 989e12, False) is val


def test_a_gpu_record_carries_both_counts_labelled(tmp_path, monkeypatch, capsys):
    """The record metrics.jsonl gets from torchtitan's metrics on a (faked) H200: apiary's TFLOPs/GPU
    and MFU from the planner's count, torchtitan's figure under its own key."""
    from framework import devices

    fake = SimpleNamespace(**{k: getattr(devices, k) for k in dir(devices) if not k.startswith("_")})
    fake.has_accelerator = lambda: True
    fake.device_name = lambda: "NVIDIA H200"
    fake.peak_flops = lambda name=None: 989e12
    fake.peak_memory_bytes = lambda: 2**30
    fake.peak_memory_kind = lambda: "cuda_max_memory_reserved"
    fake.allocator_counters = lambda: {}
    monkeypatch.setattr(metrics, "devices", fake)
    path = tmp_path / "metrics.jsonl"
    jsonl = metrics.JsonlLogger(str(path), world_size=2, total_steps=1, color=False)
    logger = metrics.Counted(jsonl, flops_per_token=4.0e10, peak_flops=989e12, quantized=False)
    tps = 6000.0  # tokens/s per GPU
    logger.log({"loss_metrics/global_avg_loss": 1.0, "loss_metrics/global_max_loss": 1.5, "grad_norm": 0.5,
                "throughput(tps)": tps, "tflops": 5.9e10 * tps / 1e12, "mfu(%)": 100 * 5.9e10 * tps / 989e12,
                "time_metrics/end_to_end(s)": 1.0}, step=1)
    jsonl.close()
    rec = json.loads(path.read_text().splitlines()[-1])
    assert rec["tflops_per_gpu"] == pytest.approx(4.0e10 * tps / 1e12)
    assert rec["tflops_per_gpu_torchtitan"] == pytest.approx(5.9e10 * tps / 1e12)
    assert rec["mfu_pct"] == pytest.approx(100 * rec["tflops_per_gpu"] / 989) == pytest.approx(24.27, abs=0.01)
    assert rec["peak_tflops_per_gpu"] == 989.0 and rec["tokens_per_s_per_gpu"] == tps


def test_build_hands_the_planners_count_to_the_metrics_processor(tmp_path):
    from framework.train.build import trainer_config

    r = resolve("debug_dense", [f"output_dir={tmp_path}"], for_training=False)
    assert trainer_config(r).metrics.flops_per_token == planner.model_flops_per_token(r) == 911_616
