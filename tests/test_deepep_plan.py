"""moe.comm=deepep on CPU: the planner's term for DeepEP's buffer, the checks before launch, the
environment it sets. No GPU and no deep_ep: a stand-in module with ``ElasticBuffer`` passes the
package check (the buffer arithmetic never imports deep_ep).

The expected sizes are worked by hand from DeepEP's source at the commit scripts/deepep_source.sh
pins (csrc/elastic/buffer.hpp calculate_buffer_size, deep_ep/include/deep_ep/common/layout.cuh);
the GPU test (tests/gpu/test_deepep_gpu.py) compares them with ElasticBuffer.num_bytes.
"""

import sys
import types

import pytest

from components.moe import comm
from framework.errors import UserError
from framework.plan import planner
from framework.resolve.resolver import resolve

MiB = 2**20
# Qwen3.5-35B-A3B at 128K, CP 2 x EP 2, 8 layers: the two-GPU run
ARGS = ["model.n_layers=8", "parallel.cp=2", "parallel.ep=2", "data.name=packaged", "data.tokenizer=byte"]


@pytest.fixture
def fake_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(ElasticBuffer=object, __version__="2.1.0"))


def test_buffer_bytes_by_hand():
    # 65,536 tokens/rank (128K / CP 2), dim 2048, top-8, EP 2 on one node (direct NVLink mode):
    # dispatch token: 2 x 2048 hidden + align32(8 x (4 + 4) + (1 + 8) x 4 = 100) = 4096 + 128 = 4224 B,
    #   received from 2 ranks: 2 x 65,536 x 4224 = 553,648,128 B (528 MiB; no send buffer over NVLink)
    # combine token: 4096 + align32(8 x 8 = 64) = 4160 B, min(2 ranks, top-8) = 2 slots: 545,259,520 B
    # buffer: max, 2 MiB-aligned = 528 MiB; workspace 12,820,528 B -> 14 MiB
    assert comm.workspace_bytes() == 12_820_528
    assert comm.buffer_bytes(65536, 2048, 8, 2) == 528 * MiB + 14 * MiB
    # 4K tokens: 2 x 4096 x 4224 = 34,603,008 B -> 34 MiB (already 2 MiB-aligned: 33 MiB rounds to 34)
    assert comm.buffer_bytes(4096, 2048, 8, 2) == 34 * MiB + 14 * MiB
    # grows with EP inside a node (one receive slot per rank), then hybrid mode across nodes
    assert comm.buffer_bytes(16384, 2048, 8, 8) > comm.buffer_bytes(16384, 2048, 8, 4)
    assert comm.buffer_bytes(16384, 2048, 8, 16) > comm.buffer_bytes(16384, 2048, 8, 8)


def _plan(comm_name):
    r = resolve("qwen35_35b_128k", [f"moe.comm={comm_name}", *ARGS], world_size=2, for_training=False)
    return r, planner.plan(r, gpu="H200")


def test_planner_counts_deepep_buffer_outside_torch(fake_deep_ep):
    r, p = _plan("deepep")
    assert (r.layout.cp, r.layout.ep) == (2, 2)
    terms = {t.name: t for t in p.terms}
    t = terms["deepep_buffer"]
    assert t.bytes == 542 * MiB and t.group == "outside"
    assert p.memory_bytes["deepep_buffer"] == 542 * MiB
    # in the total, not in torch's reserved estimate, and no fragmentation on it
    assert p.total_bytes == sum(x.bytes for x in p.terms)
    assert p.torch_reserved_bytes == p.total_bytes - p.memory_bytes["cuda_context_nccl"] - 542 * MiB
    assert p.terms[-1].name == "deepep_buffer"
    assert not p.warnings or all("moe_comm" not in w for w in p.warnings)


def test_planner_no_deepep_term_for_alltoall():
    _, p = _plan("alltoall")
    assert "deepep_buffer" not in p.memory_bytes
    assert all(t.group != "outside" for t in p.terms)
    assert all("moe_comm" not in w for w in p.warnings)
    assert p.torch_reserved_bytes == p.total_bytes - p.memory_bytes["cuda_context_nccl"]


def test_deepep_refuses_ep1_before_launch(fake_deep_ep):
    with pytest.raises(UserError, match="EP 1"):
        resolve("qwen35_35b_128k", ["moe.comm=deepep", "model.n_layers=8", "parallel.cp=2", "parallel.ep=1",
                                    "data.name=packaged", "data.tokenizer=byte"], world_size=2, for_training=False)


def test_deepep_environment(monkeypatch):
    ctx = types.SimpleNamespace(layout=types.SimpleNamespace(ep=2))
    for k in ("EP_DISABLE_GIN", "EP_REUSE_NCCL_COMM"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert comm.DeepEP.environment(ctx) == {"EP_REUSE_NCCL_COMM": "0", "EP_DISABLE_GIN": "1"}
    monkeypatch.setenv("EP_REUSE_NCCL_COMM", "1")  # the user's value stays
    comm.DeepEP.apply(None, None, ctx)
    import os

    assert os.environ["EP_REUSE_NCCL_COMM"] == "1" and os.environ["EP_DISABLE_GIN"] == "1"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # EP spans nodes: GIN (RDMA) stays on
    assert "EP_DISABLE_GIN" not in comm.DeepEP.environment(ctx)
