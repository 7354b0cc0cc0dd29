"""moe.comm=deepep against alltoall at EP 2 on two GPUs: one MoE layer with Qwen3.5-35B-A3B's MoE
shape (benchmarks/moe_layer_bench.py's layer: dim 2048, 256 experts top-8, expert hidden 512, gated
shared expert), bf16, the same weights and inputs on each rank, forward and backward through
torchtitan's standard dispatcher and through its deepep one (DeepEP's ElasticBuffer). Compared:
the output, the input gradient and every parameter gradient, on both ranks, twice (the second pass
reuses DeepEP's buffer). Also: the buffer DeepEP allocated is the size the planner counts
(components/moe/comm.py buffer_bytes, less the workspace DeepEP adds on top of ``num_bytes``).

Skipped without two CUDA GPUs or without deep_ep >= 2 (scripts/build_deepep.sh builds it).
NOT YET RUN ON A GPU: written before DeepEP was built on the GPU machines.

    python -m pytest -q -s tests/gpu/test_deepep_gpu.py
"""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def _deep_ep_problem() -> str | None:
    try:
        import deep_ep
    except Exception as e:  # ImportError, or deep_ep's import-time NCCL/JIT checks
        return f"deep_ep not importable ({type(e).__name__}: {e}); scripts/build_deepep.sh"
    return None if hasattr(deep_ep, "ElasticBuffer") else "deep_ep has no ElasticBuffer (needs DeepEP >= 2)"


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
WORLD = 2
TOKENS = 4096  # per rank
# bf16 agreement bounds, relative to the largest entry of the alltoall result: both paths compute the
# same products; DeepEP applies the routing scores in bf16 before its (fp32-accumulating) combine,
# torchtitan's standard path in fp32 before a bf16 scatter-add, so sums round differently (a few bf16
# ulps, 2^-8 = 3.9e-3 each); a routing or layout error is O(1)
TOL_OUT = 2e-2
TOL_GRAD = 2e-2


def _rel(a, b) -> float:
    scale = b.float().abs().max().item()
    return (a.float() - b.float()).abs().max().item() / (scale if scale > 0 else 1.0)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    os.environ.setdefault("EP_DISABLE_GIN", "1")  # one node, NVLink only (components/moe/comm.py)
    os.environ.setdefault("EP_REUSE_NCCL_COMM", "0")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from framework import devices

    devices.install()  # the device shims, before torchtitan is imported
    import moe_layer_bench as mlb
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from components.moe.comm import _ALIGN_BUFFER, _align, buffer_bytes, workspace_bytes
    torch.backends.cudnn.enabled = False
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    try:
        set_spmd_backend("partial_dtensor")
        mesh = init_device_mesh("cuda", (WORLD,), mesh_dim_names=("ep",))
        args = mlb.parse_args(["--tokens", str(TOKENS), "--comms", "alltoall", "deepep", "--policies", "none"])
        dtype = torch.bfloat16
        ref = mlb.build_layer(mlb.moe_config(args), "none", rank, WORLD, mesh, device, dtype)
        state = {k: v.clone() for k, v in ref.state_dict().items()}
        del ref
        g = torch.Generator().manual_seed(1000 + rank)
        x0 = torch.randn(1, TOKENS, args.dim, generator=g).to(device, dtype)
        gy = (torch.randn(1, TOKENS, args.dim, generator=g) * 1e-2).to(device, dtype)
        runs = {}
        for comm in ("alltoall", "deepep"):
            moe = mlb.build_layer(mlb.moe_config(args, comm), "none", rank, WORLD, mesh, device, dtype, state)
            runs[comm] = []
            for _ in range(2):
                x = x0.clone().requires_grad_(True)
                for p in moe.parameters():
                    p.grad = None
                y = moe(x)
                y.backward(gy)
                torch.cuda.synchronize()
                runs[comm].append((y.detach(), x.grad.detach(), {k: p.grad.detach().clone()
                                                                  for k, p in moe.named_parameters()}))
            del moe
        a, d = runs["alltoall"][0], runs["deepep"][0]
        res = {"out": _rel(d[0], a[0]), "grad_x": _rel(d[1], a[1]),
               "grad_params": {k: _rel(d[2][k], a[2][k]) for k in a[2]},
               "deepep_repeat_out": _rel(runs["deepep"][1][0], d[0]),
               "deepep_repeat_grad_x": _rel(runs["deepep"][1][1], d[1]),
               "missing_grads": sorted(k for k in a[2] if d[2].get(k) is None)}
        from torchtitan.distributed.deepep import deepep as tt_deepep

        buf = tt_deepep._buffer
        res["buffer_num_bytes"] = int(buf.num_bytes) if buf is not None else None
        res["planned_num_bytes"] = buffer_bytes(TOKENS, args.dim, args.top_k, WORLD) - _align(workspace_bytes(),
                                                                                                _ALIGN_BUFFER)
        res["buffer_max_tokens"] = int(buf.num_max_tokens_per_rank) if buf is not None else None
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    problem = _deep_ep_problem()
    if problem:
        pytest.skip(problem)
    from conftest import free_port, spawn_ranks

    out = tmp_path_factory.mktemp("deepep")
    spawn_ranks(_worker, WORLD, free_port(), str(out))
    res = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    for r, x in enumerate(res):
        worst = max(x["grad_params"].items(), key=lambda kv: kv[1])
        print(f"rank {r}: deepep vs alltoall rel err out {x['out']:.2e}, grad x {x['grad_x']:.2e}, worst param "
              f"grad {worst[1]:.2e} ({worst[0]}); repeat {x['deepep_repeat_out']:.2e}/"
              f"{x['deepep_repeat_grad_x']:.2e}; buffer {x['buffer_num_bytes']} B (planned {x['planned_num_bytes']})")
    return res


def test_deepep_forward_matches_alltoall(results):
    for x in results:
        assert x["out"] <= TOL_OUT, x["out"]


def test_deepep_backward_matches_alltoall(results):
    for x in results:
        assert not x["missing_grads"], x["missing_grads"]
        assert x["grad_x"] <= TOL_GRAD, x["grad_x"]
        bad = {k: v for k, v in x["grad_params"].items() if v > TOL_GRAD}
        assert not bad, bad


def test_deepep_second_pass_matches_first(results):
    for x in results:  # the cached buffer and handles: same inputs, same result up to reduction order
        assert x["deepep_repeat_out"] <= TOL_OUT and x["deepep_repeat_grad_x"] <= TOL_GRAD


def test_deepep_buffer_is_the_planned_size(results):
    for x in results:
        assert x["buffer_max_tokens"] == TOKENS
        assert x["buffer_num_bytes"] == x["planned_num_bytes"], x
