"""The planner: memory terms against hand-computed values (incl. seed 000's), dims, errors, search.

No training and no GPU: every test resolves recipes and does arithmetic (a few seconds each).
"""

import json
import math
import re
from dataclasses import replace

import pytest

from framework.plan import planner
from framework.resolve.resolver import resolve
from toolkit.plan import parse_bytes, plan_main

GiB = 2**30
QWEN = "qwen35_35b_128k"


@pytest.fixture(scope="module")
def base():
    """Qwen3.5-35B-A3B at 128K on 32 GPUs: the table's layout (EP 8, CP 4, PP 1, TP 1), full recompute
    (seed 000's setting; the recipe's own default, auto, chooses per block for the GPU planned)."""
    return resolve(QWEN, ["recompute=full"], world_size=32, for_training=False)


@pytest.fixture(scope="module")
def seed_baseline():
    """Seed 000's logits example: TP 2, CP 2, seq 131072, local_batch 1, loss ce, full recompute."""
    return resolve(QWEN, ["loss=ce", "parallel.tp=2", "parallel.cp=2", "recompute=full"], world_size=32,
                   for_training=False)


def _with(r, **dims):
    """The same resolved recipe on another (valid) layout, without composing it again."""
    return replace(r, layout=replace(r.layout, **dims))


def _with_moe(r, **keys):
    """The same resolved recipe with other ``moe:`` keys (a copy of its config)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(r.cfg))
    for k, v in keys.items():
        cfg.moe[k] = v
    return replace(r, cfg=cfg)


def _run(capsys, argv):
    rc = plan_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---- memory terms against hand-computed values ------------------------------------------------


def test_seed_fp32_logits_term_is_exact(seed_baseline):
    r = seed_baseline
    assert (r.layout.tp, r.layout.cp, r.cfg.training.seq_len, r.cfg.training.local_batch) == (2, 2, 131072, 1)
    assert r.facts.vocab_size == 248_320
    p = planner.plan(r, gpu_memory_bytes=80 * GiB)
    # seed 000's published arithmetic (FACTS.md): 65,536 tokens x 124,160 vocab columns x 4 bytes
    assert p.memory_bytes["logits_fp32"] == 32_547_799_040  # = 32.55 GB decimal, as published
    assert p.memory_bytes["logits_bf16"] == 32_547_799_040 // 2
    assert p.memory_bytes["logits_grad"] == 32_547_799_040
    # without TP's vocab split the same tokens need twice that (seed: 65.10 GB)
    r1 = _with(r, tp=1, dp_shard=16)
    assert planner.plan(r1).memory_bytes["logits_fp32"] == 2 * 32_547_799_040


def test_chunked_and_linear_ce_shrink_the_loss_terms(seed_baseline):
    chunked = planner.plan(seed_baseline, loss="chunked")  # recipe's loss is ce: default 8 chunks
    assert chunked.memory_bytes["logits_fp32"] == 65536 // 8 * 124160 * 4
    lin = planner.plan(seed_baseline, loss="linear_ce")
    assert not any(k.startswith("logits") for k in lin.memory_bytes)
    assert lin.memory_bytes["loss_hidden_grad"] == 65536 * 2048 * 4
    assert lin.total_bytes < chunked.total_bytes < planner.plan(seed_baseline).total_bytes
    # the recipe's own num_chunks is honoured
    r = resolve(QWEN, ["loss=chunked", "loss.num_chunks=4"], world_size=32, for_training=False)
    assert planner.plan(r).memory_bytes["logits_fp32"] == 32768 // 4 * 248320 * 4


def test_fsdp2_static_state_matches_seed_formulas(base):
    n, N = base.facts.n_params, 32
    p = planner.plan(base)
    # optimizer state (fp32 master + Adam moments) ~= n_param x 12 / nGPU
    assert abs(p.memory_bytes["optimizer_states"] - n * 12 / N) <= 1
    # torchtitan keeps no persistent bf16 shard: params + grads = 4 B/param / N by default ...
    assert abs(p.memory_bytes["parameters"] + p.memory_bytes["gradients"] - n * 4 / N) <= 2
    # ... and the seed's accounting (a 2-byte param shard) gives its n_param x 6 / nGPU
    seed = planner.plan(base, calibration={"fsdp2_param_bytes": 2})
    assert abs(seed.memory_bytes["parameters"] + seed.memory_bytes["gradients"] - n * 6 / N) <= 2


def test_zero1_params_follow_pp_and_ep(base):
    f = base.facts
    assert f.n_expert_params / f.n_params > 0.9  # an MoE whose experts dominate
    fsdp = planner.plan(base, state="fsdp2", calibration={"fsdp2_param_bytes": 2})
    z = planner.plan(base, state="zero1")
    pg = z.memory_bytes["parameters"] + z.memory_bytes["gradients"]
    seed_formula = f.n_params * 6 / (1 * 8)  # n_param x 6 / (PP x EP)
    dense = f.n_params - f.n_expert_params
    assert abs(pg - (dense * 6 + f.n_expert_params * 6 / 8)) <= 2  # dense replicated (TP 1), experts / EP
    assert seed_formula <= pg <= 1.6 * seed_formula  # the seed's estimate ignores the replicated dense part
    assert pg > 5 * (fsdp.memory_bytes["parameters"] + fsdp.memory_bytes["gradients"])  # vs n x 6 / 32
    assert z.memory_bytes["optimizer_states"] == fsdp.memory_bytes["optimizer_states"]  # both / nGPU
    assert "fsdp_allgather" not in z.memory_bytes and "grad_buckets" in z.memory_bytes
    assert z.total_bytes > fsdp.total_bytes
    # PP 2 halves the blocks a stage holds
    z2 = planner.plan(_with(base, pp=2, dp_shard=4), state="zero1")
    pg2 = z2.memory_bytes["parameters"] + z2.memory_bytes["gradients"]
    assert 0.45 * pg < pg2 < 0.6 * pg


@pytest.mark.parametrize("alloc,fragmentation", [("expandable_segments:True", 0.0), ("expandable_segments:False", 0.08)])
@pytest.mark.parametrize("lean,copies", [(None, 1), (False, 4)])
def test_full_recompute_terms_by_hand(base, monkeypatch, alloc, fragmentation, lean, copies):
    """The MoE's transient buffers follow the combine (the lean one: 1 copy; torchtitan's fp32 one,
    moe.lean_combine=false: 4), the allocator's reserve its setting (framework/alloc_conf.py)."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc)
    base = _with_moe(base, lean_combine=lean)
    p = planner.plan(base, loss="linear_ce")
    T, d, L, k = 131072 // 4, 2048, 40, 8
    assert p.memory_bytes["activations"] == T * L * d * 2  # block inputs only
    assert p.memory_bytes["moe_dispatch_combine"] == round(T * k * d * copies * 1.2 * 2)
    head = 248320 * 2048 + 2048  # the lm_head unit (+ final norm), the largest FSDP unit
    assert p.memory_bytes["fsdp_reduce_scatter"] == head * 6
    assert p.memory_bytes["cp_kv_allgather"] == 131072 * 2 * (2 * 256) * 2 * 2
    allocated = sum(v for k_, v in p.memory_bytes.items() if k_ not in ("fragmentation", "cuda_context_nccl"))
    assert abs(p.memory_bytes["fragmentation"] - fragmentation * allocated) <= 1
    assert p.total_bytes == sum(p.memory_bytes.values())
    assert p.headroom_bytes == 80 * GiB - p.total_bytes


def test_recompute_trades_memory_for_time(base):
    plans = {rc: planner.plan(base, recompute=rc, loss="linear_ce") for rc in ("none", "selective", "full")}
    act = {rc: p.memory_bytes["activations"] for rc, p in plans.items()}
    assert act["none"] > act["selective"] > act["full"]
    t = {rc: p.step_time_s for rc, p in plans.items()}
    assert t["none"] < t["selective"] < t["full"]
    assert plans["none"].verdict == "OOM" and plans["full"].verdict == "fits"


def test_verdicts_gpu_kind_and_calibration(base):
    assert planner.plan(base, gpu_memory_bytes=30 * GiB).verdict == "OOM"
    full = planner.plan(base, gpu_memory_bytes=80 * GiB)
    tight = planner.plan(base, gpu_memory_bytes=int(full.total_bytes * 1.05))
    assert tight.verdict == "tight" and tight.fits
    assert planner.plan(base, gpu_memory_bytes=141 * 10**9).choices["gpu"] == "H200"
    fast = planner.plan(base, calibration={"hardware.H100.bf16_dense_flops": 2 * 989e12})
    assert math.isclose(fast.time_s["compute_attention"], full.time_s["compute_attention"] / 2)
    assert planner.plan(base, calibration={"fragmentation_fraction": 0}).memory_bytes["fragmentation"] == 0
    with pytest.raises(planner.UserError, match="unknown planner constant"):
        planner.plan(base, calibration={"fragmentaton_fraction": 0})


def test_ep_across_nodes_costs_more(base):
    r16 = _with(base, ep=16)
    inside = planner.plan(r16, gpus_per_node=16).time_s["exposed_ep_alltoall"]
    across = planner.plan(r16, gpus_per_node=8).time_s["exposed_ep_alltoall"]
    assert across > 1.5 * inside
    chunked = planner.plan(r16, gpus_per_node=8, moe_chunk="chunk2")
    hidden = planner.Constants().ep_overlap["chunk2"]
    assert 0 < hidden < 1 and chunked.time_s["exposed_ep_alltoall"] == pytest.approx(across * (1 - hidden))
    # moe.chunk=auto runs unchunked below EP 8 (measured: no gain inside one node), so no overlap there
    r4 = _with(base, ep=4)
    auto4, none4 = (planner.plan(r4, gpus_per_node=8, moe_chunk=m).time_s["exposed_ep_alltoall"] for m in ("auto", "none"))
    assert auto4 == none4 > 0
    auto16 = planner.plan(r16, gpus_per_node=8, moe_chunk="auto").time_s["exposed_ep_alltoall"]
    assert auto16 == pytest.approx(across * (1 - planner.Constants().ep_overlap["auto"]))


def test_step_time_reproduces_the_seed_anchor_it_was_fitted_to(base):
    """The efficiencies carry one factor fitted to seed 000's PP1 point (180.18 TFLOPs/GPU on 32 x H100:
    EP 8, CP 4, FSDP2, full recompute, linear CE); a constant change that moves it shows up here."""
    p = planner.plan(base, loss="linear_ce", gpu_memory_bytes=80 * GiB)
    assert p.tflops_per_gpu == pytest.approx(180.18, rel=0.05)


def test_step_time_counts_the_models_flops(base):
    """Step time x TFLOPs/GPU x GPUs is the step's model FLOPs, counted here by hand from the shapes
    (FACTS.md: dim 2048, 10 full-attention layers of 16 heads x 256, vocab 248,320): 6 FLOPs per
    active weight outside the embedding lookup, plus causal attention's 12 x seq x heads x head_dim / 2
    per attention layer. The GatedDeltaNet layers are linear in seq and sit in the active weights."""
    p = planner.plan(base, loss="linear_ce", gpu_memory_bytes=80 * GiB)
    seq, tokens_per_step = 131072, 1 * 131072 * 8  # local_batch x seq x dp_shard
    active_matmul = base.facts.n_active_params - 248_320 * 2048  # the embedding is a lookup, no FLOPs
    flops_per_token = 6 * active_matmul + 6 * seq * 16 * 256 * 10  # = 4.99e10
    flops = p.tflops_per_gpu * 1e12 * p.step_time_s * 32
    assert flops == pytest.approx(tokens_per_step * flops_per_token, rel=0.01)  # router/conv/norms ~0.6%
    # and a second anchor the fit did not use: the seed's TFLOPs/GPU at seq 128K imply ~3.6K tokens/s/GPU
    assert p.tokens_per_s_per_gpu == pytest.approx(180.18e12 / flops_per_token, rel=0.06)


def test_dense_model_plans_without_moe_terms():
    r = resolve("debug_dense", [], world_size=2, for_training=False)
    p = planner.plan(r)
    assert p.dims["ep"] == 1 and p.dims["dp_shard"] == 2 and "moe_dispatch_combine" not in p.memory_bytes
    assert abs(p.memory_bytes["optimizer_states"] - r.facts.n_params * 12 / 2) <= 1
    assert p.time_s["compute_experts"] == 0 and p.verdict == "fits"


def test_estimate_for_run_and_metrics_merge(base, tmp_path):
    est = planner.estimate_for_run(base, gpu_memory_bytes=80 * GiB)
    assert est["plan_torch_reserved_bytes"] < est["plan_total_bytes"]
    assert est["plan_verdict"] in ("fits", "tight", "OOM") and est["plan_step_time_s"] > 0
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "peak_mem_bytes": 10}) + "\n"
                    + json.dumps({"step": 2, "peak_mem_bytes": est["plan_torch_reserved_bytes"] // 2}) + "\n")
    assert planner.merge_into_last_record(path, est)
    first, last = [json.loads(x) for x in path.read_text().splitlines()]
    assert "plan_total_bytes" not in first and last["plan_total_bytes"] == est["plan_total_bytes"]
    assert last["plan_error_fraction"] == pytest.approx(1.0, abs=1e-3)
    assert not planner.merge_into_last_record(tmp_path / "missing.jsonl", est)


# ---- the command ------------------------------------------------------------------------------


def test_plan_cli_derives_the_seed_layout(capsys):
    rc, out, err = _run(capsys, [f"recipe={QWEN}", "gpus=32", "gpu_memory=80GiB", "--json"])
    assert rc == 0, err
    j = json.loads(out)
    assert {k: j["dims"][k] for k in ("dp_shard", "cp", "ep", "pp", "tp")} == \
        {"dp_shard": 8, "cp": 4, "ep": 8, "pp": 1, "tp": 1}
    assert j["gpu_memory_bytes"] == 80 * GiB and j["fits"] is True
    assert j["total_bytes"] == sum(j["memory_bytes"].values())
    assert j["step_time_s"] > 0 and j["tflops_per_gpu"] > 0
    for term in ("parameters", "gradients", "optimizer_states", "activations", "fsdp_allgather",
                 "cp_kv_allgather", "fragmentation", "cuda_context_nccl"):
        assert term in j["memory_bytes"]
    assert "table" in j["rules"]["cp"] and "table" in j["rules"]["ep"]


def test_plan_cli_prints_tables(capsys):
    rc, out, _ = _run(capsys, [f"recipe={QWEN}", "gpus=32", "gpu_memory=80GiB", "loss=ce"])
    assert rc == 0
    for text in ("derived dims", "memory per GPU", "headroom", "TFLOPs/GPU", "assumptions"):
        assert text in out
    # the row carries the number: CP 4 -> 32,768 local tokens x 248,320 vocab x 4 B = 30.31 GiB, 32.55 GB
    row = next(line for line in out.splitlines() if "logits_fp32" in line)
    assert re.search(r"logits_fp32\W+30\.31\W+32\.55\W", row), row
    assert "32,768 tokens" in row


def test_plan_cli_names_a_tiny_model_in_millions(capsys):
    rc, out, _ = _run(capsys, ["recipe=debug_moe", "gpus=8"])
    assert rc == 0
    assert re.search(r"\(0\.\dM params, 0\.\dM active\)", out.splitlines()[0]), out.splitlines()[0]
    assert "0.00B" not in out


@pytest.mark.parametrize("argv, needle", [
    (["parallel.ep=32", "gpus=24"], "EP 32 must divide dp_shard x cp x tp"),
    (["training.seq_len=131072", "parallel.cp=3"], "CP 3 does not divide"),  # the ranks first: no seq_len helps
    (["training.seq_len=131070", "parallel.cp=2"], "not divisible by 2 x cp = 4"),
    (["training.seq_len=100000", "parallel.cp=32"], "not divisible by 2 x cp = 64"),
    (["gpu_memory=lots"], "is not a memory size"),
    (["gpus=0"], "must be a positive integer"),
    (["calib.no_such_constant=1"], "unknown planner constant"),
    (["parallel.epp=8"], "unknown key"),
])
def test_impossible_requests_exit_2(capsys, argv, needle):
    rc, out, err = _run(capsys, [f"recipe={QWEN}", *argv, "--json"])
    assert rc == 2 and out == ""
    assert needle in err and "Traceback" not in err


def test_seq_100000_splits_over_cp4(capsys):
    """100000 = 8 x 12500: torchtitan's rule (seq % (2 x cp x tp) == 0) accepts it."""
    rc, out, _ = _run(capsys, [f"recipe={QWEN}", "training.seq_len=100000", "parallel.cp=4", "--json"])
    assert rc == 0 and json.loads(out)["dims"]["cp"] == 4


def test_search_ranks_rows_that_fit(capsys):
    rc, out, err = _run(capsys, [f"recipe={QWEN}", "gpus=32", "gpu_memory=80GiB", "parallel.pp=1", "parallel.tp=1",
                                 "--search", "--top=3", "--json"])
    assert rc == 0, err
    j = json.loads(out)
    rows, counts = j["search"], j["search_counts"]
    assert 1 <= len(rows) <= 3 and counts["oom"] > 0
    # on 32 GPUs with PP = TP = 1 every (EP, CP) pair of the space divides dp_shard x cp = 32 and
    # 131072 / 2, so none is invalid; each valid layout is planned for 4 recompute (none, selective,
    # full, auto) x 3 loss x 2 state
    assert counts["invalid_layouts"] == 0 and counts["plans"] == 24 * counts["layouts"]
    assert counts["oom"] + counts["fit"] == counts["plans"] and counts["fit"] >= len(rows)
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    for r in rows:
        assert r["verdict"] != "OOM" and r["total_bytes"] <= j["gpu_memory_bytes"]
        assert r["dims"]["pp"] == 1 and r["dims"]["tp"] == 1  # dims set on the command line stay fixed
        assert r["recompute"] in ("none", "selective", "full", "auto") and r["loss"] in ("ce", "chunked", "linear_ce")
        assert any(o.startswith("parallel.ep=") for o in r["overrides"])


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("79.5GiB") == int(79.5 * GiB)
    assert parse_bytes("123") == 123
    with pytest.raises(planner.UserError):
        parse_bytes("-3GB")


def test_fsdp2_cpu_offload_leaves_no_static_state_on_gpu():
    r = resolve(QWEN, ["state.offload=all"], world_size=32, for_training=False)
    p = planner.plan(r)
    assert p.memory_bytes["gradients"] == p.memory_bytes["optimizer_states"] == 0
    assert p.memory_bytes["fsdp_allgather"] > 0  # gathered bf16 params still live on the GPU


def test_optimizer_offload_plans_the_adam_moments_on_the_host(monkeypatch):
    """state.offload=optimizer keeps the fp32 master shard on the GPU and moves the two Adam moments
    to the host: the GPU's optimizer term is the master's bytes only (measured on an H200: 64.2 GiB
    against 97.2 without offload, with torch's fixed segments and torchtitan's fp32 MoE combine, as
    planned here; docs/benchmarks.md)."""
    from framework.plan.planner.constants import Constants
    from framework.resolve.resolver import resolve

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    ov = ["model.n_layers=4", "training.seq_len=32768", "training.local_batch=1", "parallel.cp=1", "parallel.ep=1",
          "parallel.dp_shard=1", "parallel.gpus=1", "data.name=packaged", "data.tokenizer=byte", "recompute=full",
          "moe.lean_combine=false"]
    on = planner.plan(resolve("qwen35_35b_128k", ov + ["state.offload=optimizer"], for_training=False), gpu="H200")
    off = planner.plan(resolve("qwen35_35b_128k", ov, for_training=False), gpu="H200")
    c = Constants()
    ratio = on.memory_bytes["optimizer_states"] / off.memory_bytes["optimizer_states"]
    assert ratio == pytest.approx(c.master_bytes / (c.master_bytes + c.adam_bytes))
    assert abs(on.torch_reserved_bytes / 2**30 - 64.2) / 64.2 < 0.05
