"""A real vLLM engine takes the trainer's weights in memory (publish.transport=vllm_ipc|vllm_nccl):
after the update its greedy tokens and log-probs equal those of a fresh engine started from the
published folder of the same weights. Skipped without vLLM or a GPU (NCCL: without two GPUs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                                reason="needs vLLM and a GPU")


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import weight_sync_bench
    return weight_sync_bench


@needs_vllm
@pytest.mark.parametrize("recipe, backend", [
    ("debug_grpo_vllm", "ipc"),
    ("qwen35_debug_moe", "ipc"),
    pytest.param("debug_grpo_vllm", "nccl", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL: the engine on a second GPU")),
])
def test_in_memory_update_equals_the_folder(tmp_path, recipe, backend):
    overrides = ["model.flavor=vllm_debug_moe"] if recipe == "qwen35_debug_moe" else []
    r = _bench().check_same_as_folder(recipe, overrides, backend, tmp_path)
    print(f"{recipe} {backend}: update {r['record']}, max |logprob diff| vs folder {r['max_logprob_diff']:.3g}")
    assert r["before"]["version"] == 0 and r["after"]["version"] == 1
    assert r["after"]["logprobs"] != r["before"]["logprobs"]  # the update changed the engine's weights
    assert r["after"]["tokens"] == r["folder"]["tokens"]
    assert r["max_logprob_diff"] <= 1e-5
