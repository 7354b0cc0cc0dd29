"""moe.chunk: chunked EP overlap gives the same MoE layer as moe.chunk=none.

Two gloo ranks (EP=2) in one torch.multiprocessing spawn; every check runs inside it:
- one MoE layer (the debug_moe recipe's: dim 64, 8 experts, top-2), policies chunk2/3/4 and
  auto (auto forced to 3 chunks through its table), with and without torchtitan's FullAC,
  random routing and a skewed routing that leaves rank 1 with no rows at all;
- the whole tiny_moe model (2 MoE blocks, FullAC on every block), none vs chunk2;
- the benchmark's CPU smoke mode on the same two ranks.

Bitwise (torch.equal) where the arithmetic is the same operations on the same rows: layer
output, input gradient, router-gate gradient, load-balancing counts, model loss. The expert
weight gradients are sums of per-chunk bf16 grouped-GEMM partials instead of one grouped GEMM
over all rows: compared within bf16 rounding (2% of the largest entry), and required non-zero.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

from conftest import ROOT, assert_same_trajectory, free_port, read_metrics, run_cli, spawn_ranks

WORLD = 2


# ---------------------------------------------------------------------------------------------
# the auto rule (no torch needed)


def test_auto_rule_table():
    sys.path.insert(0, str(ROOT))
    from components.moe.auto_chunks import AUTO_TOKEN_TABLE, auto_num_chunks

    q35 = dict(num_experts=256, top_k=8)  # Qwen3.5-35B-A3B
    assert auto_num_chunks(65_536, ep_size=1, **q35) == 1  # nothing to overlap without EP
    assert auto_num_chunks(2_048, ep_size=8, **q35) == 1
    assert auto_num_chunks(4_096, ep_size=8, **q35) == 2
    assert auto_num_chunks(16_384, ep_size=8, **q35) == 2
    assert auto_num_chunks(32_768, ep_size=8, **q35) == 3
    assert auto_num_chunks(65_536, ep_size=8, **q35) == 4
    # kernel-shape floor: 4K tokens, EP=2 -> 256 rows per local expert: one chunk only
    assert auto_num_chunks(4_096, ep_size=2, **q35) == 1
    assert auto_num_chunks(8_192, ep_size=2, **q35) == 1  # EP 2 in one node: measured no gain
    assert auto_num_chunks(16_384, ep_size=4, **q35) == 1  # EP 4 in one node: measured no gain either
    assert auto_num_chunks(65_536, ep_size=4, **q35) == 1
    assert auto_num_chunks(65_536, ep_size=8, num_experts=8192, top_k=8) == 2  # 512 rows: 4 -> 2 chunks
    assert AUTO_TOKEN_TABLE[-1][0] == math.inf


def test_policies_refuse_what_they_cannot_chunk():
    sys.path.insert(0, str(ROOT))
    from components.moe.chunk import AutoChunk, Chunked, NoChunk, chunk2
    from framework.errors import UserError

    with pytest.raises(ValueError):
        Chunked(1)
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from framework.compose.schema import MoEConfig
    from framework.contracts import make_options

    def ctx(backend):
        return SimpleNamespace(components={"moe_comm": SimpleNamespace(torchtitan_backend=backend)})

    def moe(policy, **kw):  # the moe: section's options, as resolve builds them from the recipe
        return make_options(policy, OmegaConf.structured(MoEConfig(load_balance_coeff=None, **kw)))

    for policy, name in ((chunk2, "chunk2"), (AutoChunk, "auto")):
        opts = moe(policy, comm="alltoall", chunk=name)
        policy.check(opts, ctx("standard"))
        with pytest.raises(UserError, match="moe.comm=alltoall"):
            policy.check(opts, ctx("deepep"))
    NoChunk.check(moe(NoChunk, comm="deepep", chunk="none"), ctx("deepep"))


# ---------------------------------------------------------------------------------------------
# two-rank checks


def _max_rel_err(a, b) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _ep_shard(module, mesh, rank: int, world: int) -> None:
    """Keep this rank's experts and wire the EP mesh (what torchtitan's EP sharding does)."""
    import torch
    from torchtitan.models.common.moe import RoutedExperts

    for m in module.modules():
        if isinstance(m, RoutedExperts):
            ex = m.inner_experts
            e = ex.num_experts // world
            for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
                full = getattr(ex, name)
                setattr(ex, name, torch.nn.Parameter(full.detach()[rank * e:(rank + 1) * e].clone()))
            m.token_dispatcher.wire_meshes(ep_mesh=mesh)


def _wrap(moe, recompute: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if recompute == "full":  # what recompute=full does to every block
        return FullAC(FullAC.Config())._wrap_block(moe)
    if recompute == "selective":  # recompute=selective (the debug recipes' default)
        return SelectiveAC(SelectiveAC.Config())._wrap_block(moe)
    return moe


def _layer_case(moe_cfg, policy, mesh, rank, ref_state, x, g, recompute, skew, lean=False):
    import copy

    import torch

    from components.moe import lean_combine
    from framework import devices

    cfg = copy.deepcopy(moe_cfg)
    policy.convert(cfg)
    moe = cfg.build()
    moe.load_state_dict(ref_state)
    _ep_shard(moe, mesh, rank, WORLD)
    devices.after_parallelize(moe)  # CPU: torchtitan's dispatcher through gloo's all_to_all_single
    if lean:  # moe.lean_combine (unset or true): the scoring without fp32 copies, at EP 2 here
        assert lean_combine.install(moe) == 1
    if skew:
        with torch.no_grad():  # every token picks experts 0..3: all rows go to rank 0
            moe.expert_bias_E.copy_(torch.tensor([10.0] * 4 + [0.0] * 4))
    moe.train()
    x = x.clone().requires_grad_(True)
    out = _wrap(moe, recompute)(x)
    (out * g).sum().backward()
    ex = moe.routed_experts.inner_experts
    return {
        "out": out.detach(), "dx": x.grad, "gate": moe.router.gate.weight.grad,
        "w1": ex.w1_EFD.grad, "w2": ex.w2_EDF.grad, "w3": ex.w3_EFD.grad,
        "counts": moe.tokens_per_expert_E.clone(), "module": moe.routed_experts,
    }


def _check_layer(rank, mesh):
    import copy

    import torch

    from components.models import qwen3
    from components.moe import auto_chunks
    from components.moe import chunk as chunk_mod
    from components.moe.chunked_experts import ChunkedRoutedExperts

    model_cfg = qwen3.model_config("tiny_moe")
    moe_cfg = copy.deepcopy(model_cfg.layers[0].moe)
    assert moe_cfg.num_experts == 8 and moe_cfg.router.top_k == 2
    torch.manual_seed(0)
    ref = moe_cfg.build()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref_state = copy.deepcopy(ref.state_dict())
    B, L, D = 2, 32, 64
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(B, L, D, generator=gen)
    g = torch.randn(B, L, D, generator=gen)

    table, floor, min_ep = auto_chunks.AUTO_TOKEN_TABLE, auto_chunks.AUTO_MIN_ROWS_PER_EXPERT, auto_chunks.AUTO_MIN_EP
    auto_chunks.AUTO_TOKEN_TABLE = ((16, 1), (math.inf, 3))  # force auto -> 3 chunks at 64 tokens
    auto_chunks.AUTO_MIN_ROWS_PER_EXPERT = 1
    auto_chunks.AUTO_MIN_EP = 2
    # (policy, chunks it must use, recompute modes to pair with none)
    policies = {"chunk2": (chunk_mod.chunk2, 2, ("none", "full", "selective")),
                "chunk3": (chunk_mod.chunk3, 3, ("none", "full")),
                "chunk4": (chunk_mod.chunk4, 4, ("none", "full")),
                "auto": (chunk_mod.AutoChunk, 3, ("none", "full"))}
    try:
        for skew in (False, True):
            base = {rc: _layer_case(moe_cfg, chunk_mod.NoChunk, mesh, rank, ref_state, x, g, rc, skew)
                    for rc in ("none", "full", "selective")}
            assert base["none"]["out"].abs().max() > 0 and base["none"]["w1"] is not None
            for rc in ("full", "selective"):  # recompute changes nothing on the baseline
                for key in ("out", "dx", "gate", "w1", "w2", "w3"):
                    assert torch.equal(base[rc][key], base["none"][key]), ("none", rc, key)
            if skew:
                assert (base["none"]["counts"][4:] == 0).all() and base["none"]["counts"].sum() == B * L * 2
            for name, (policy, n, modes) in policies.items():
                for rc in modes:
                    r, b = _layer_case(moe_cfg, policy, mesh, rank, ref_state, x, g, rc, skew), base[rc]
                    tag = (name, f"recompute={rc}", "skew" if skew else "random", f"rank{rank}")
                    mod = r["module"]
                    assert isinstance(mod, ChunkedRoutedExperts), tag
                    assert mod.last_num_chunks == n, (tag, mod.last_num_chunks)
                    # the chunked schedule ran in forward, and again in the recompute
                    assert mod.schedule_runs == (1 if rc == "none" else 2), (tag, mod.schedule_runs)
                    for key in ("out", "dx", "gate", "counts"):
                        assert torch.equal(r[key], b[key]), (tag, key, (r[key] - b[key]).abs().max())
                    for key in ("w1", "w2", "w3"):
                        if skew and rank == 1:  # no rows reach rank 1's experts
                            assert torch.equal(r[key], torch.zeros_like(r[key])) and torch.equal(b[key], r[key]), tag
                            continue
                        assert b[key].abs().max() > 0, (tag, key)
                        assert _max_rel_err(r[key], b[key]) < 2e-2, (tag, key, _max_rel_err(r[key], b[key]))
            _check_lean_at_ep2(moe_cfg, mesh, rank, ref_state, x, g, skew, base)
    finally:
        auto_chunks.AUTO_TOKEN_TABLE, auto_chunks.AUTO_MIN_ROWS_PER_EXPERT, auto_chunks.AUTO_MIN_EP = table, floor, min_ep


def _check_lean_at_ep2(moe_cfg, mesh, rank, ref_state, x, g, skew, base):
    """moe.lean_combine at EP 2 (components/moe/lean_combine.py): torchtitan's standard EP combine
    (moe.chunk=none) with the lean scoring equals it bit for bit, and the chunked path with it
    equals the chunked path without it bit for bit; the lean scoring ran in every forward."""
    import torch

    from components.moe import chunk as chunk_mod
    from components.moe import chunked_experts, lean_combine

    calls = []
    originals = lean_combine.score_rows, chunked_experts.score_rows

    def counted(*a, **k):
        calls.append(1)
        return originals[0](*a, **k)

    lean_combine.score_rows = chunked_experts.score_rows = counted
    try:
        for rc in ("none", "full"):
            for name, policy, ref in (("none", chunk_mod.NoChunk, base[rc]),
                                      ("chunk2", chunk_mod.chunk2,
                                       _layer_case(moe_cfg, chunk_mod.chunk2, mesh, rank, ref_state, x, g, rc, skew))):
                del calls[:]
                r = _layer_case(moe_cfg, policy, mesh, rank, ref_state, x, g, rc, skew, lean=True)
                tag = ("lean", name, f"recompute={rc}", "skew" if skew else "random", f"rank{rank}")
                assert len(calls) == (1 if rc == "none" else 2), (tag, len(calls))  # forward (+ recompute)
                for key in ("out", "dx", "gate", "w1", "w2", "w3", "counts"):
                    assert torch.equal(r[key], ref[key]), (tag, key)
    finally:
        lean_combine.score_rows, chunked_experts.score_rows = originals


def _check_model(rank, mesh):
    """The debug_moe recipe's whole model with FullAC on every block: none vs chunk2."""
    import copy

    import torch
    import torch.nn.functional as F
    from torchtitan.distributed.activation_checkpoint import FullAC

    from components.models import qwen3
    from components.moe import chunk as chunk_mod
    from components.moe.chunked_experts import ChunkedRoutedExperts
    from framework import devices

    base_cfg = qwen3.model_config("tiny_moe")
    torch.manual_seed(0)
    ref = copy.deepcopy(base_cfg).build()
    ref.init_states()
    state = copy.deepcopy(ref.state_dict())
    gen = torch.Generator().manual_seed(7 + rank)
    tokens = torch.randint(0, base_cfg.vocab_size, (2, 33), generator=gen)
    results = {}
    for name, policy in (("none", chunk_mod.NoChunk), ("chunk2", chunk_mod.chunk2)):
        cfg = copy.deepcopy(base_cfg)
        policy.convert(cfg)
        model = cfg.build()
        model.load_state_dict(state)
        _ep_shard(model, mesh, rank, WORLD)
        devices.after_parallelize(model)
        FullAC(FullAC.Config()).apply(model)
        model.train()
        inp = tokens[:, :-1]
        positions = torch.arange(inp.shape[1]).expand(inp.shape[0], -1)
        logits = model(inp, positions=positions, attention_masks=model.get_attention_masks(positions))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        chunked = [m for m in model.modules() if isinstance(m, ChunkedRoutedExperts)]
        results[name] = (loss.detach(), grads, chunked)
    (l0, g0, c0), (l1, g1, c1) = results["none"], results["chunk2"]
    assert not c0 and len(c1) == len(base_cfg.layers) >= 2
    assert all(m.schedule_runs == 2 and m.last_num_chunks == 2 for m in c1)  # forward + recompute
    assert torch.equal(l0, l1), (l0, l1)
    assert g0.keys() == g1.keys()
    # the recipe's dispatcher must be torchtitan's standard all-to-all: DeepEP is refused at build time
    with pytest.raises(ValueError, match="standard all-to-all"):
        chunk_mod.chunk2.convert(qwen3.model_config("tiny_moe", moe_comm_backend="deepep"))
    for k in g0:
        if ".experts." in k or k.endswith(("_EFD", "_EDF")):
            assert _max_rel_err(g1[k], g0[k]) < 2e-2, (k, _max_rel_err(g1[k], g0[k]))
        else:  # dense parameters see gradients through the expert weights' rounding only
            assert torch.allclose(g1[k], g0[k], rtol=1e-3, atol=1e-5), (k, (g1[k] - g0[k]).abs().max())


def _check_bench_smoke(rank, out_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe_layer_bench

    # the documented smoke shape; small expert hidden sizes because torch's CPU bf16 grouped GEMM
    # is a slow reference loop
    moe_layer_bench.main(["--device", "cpu", "--tokens", "256", "--dim", "64", "--experts", "8", "--top-k", "2",
                          "--hidden", "32", "--shared-hidden", "32", "--warmup", "1", "--iters", "2",
                          "--out", out_path])


def _chunk_worker(rank: int, port: int, out_path: str) -> None:
    os.environ["APIARY_DEVICE"] = "cpu"
    sys.path.insert(0, str(ROOT))
    from framework import devices

    devices.install()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    torch.set_num_threads(1)
    set_spmd_backend("partial_dtensor")  # the dispatcher's plain-ProcessGroup path (no trainer mesh context)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        _check_layer(rank, mesh)
        _check_model(rank, mesh)
        _check_bench_smoke(rank, out_path)
        dist.barrier()  # tear gloo down together: a rank leaving early can abort its peer's exit
    finally:
        dist.destroy_process_group()


def test_chunked_ep_matches_none_on_two_gloo_ranks(tmp_path):
    import json

    out = tmp_path / "bench.json"
    spawn_ranks(_chunk_worker, WORLD, free_port(), str(out))
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {r["policy"] for r in rows} == {"none", "chunk2", "chunk3", "chunk4"}
    assert report["env"]["ep"] == WORLD
    for r in rows:
        assert r["tokens"] == 256 and r["median_ms"] > 0 and r["chunks_used"] == (
            1 if r["policy"] == "none" else int(r["policy"][-1]))
        assert r["max_rel_err_out"] == 0.0 or r["policy"] != "none"
        assert r["max_rel_err_out"] < 1e-2 and r["max_rel_err_grad"] < 5e-2


# ---------------------------------------------------------------------------------------------
# opt-in: the real trainer (FSDP2 + EP=2 + full recompute, 2 gloo ranks); ~2 minutes per run


@pytest.mark.slow  # about 4 minutes
def test_trainer_chunk2_matches_none(workdir):
    runs = {}
    for name in ("none", "chunk2"):
        p = run_cli(["train", "nproc=2", f"moe.chunk={name}", "recompute=full", "training.steps=3",
                     "checkpoint.interval=100", f"output_dir={name}"], cwd=workdir)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = read_metrics(workdir / name)
    a, b = runs["none"], runs["chunk2"]
    assert a[0]["loss"] == b[0]["loss"]  # same forward arithmetic (and same weights: one seed)
    # the expert gradients are sums of per-chunk partials: rounding-level differences from step 1's
    # update on, so conftest's fp32 trajectory bound for the later steps
    assert_same_trajectory(a, b)
