"""benchmarks/weight_sync_bench.py builds the trainer's in-memory sender the way the trainer does: its
sender is made from the trainer's own PublishSettings, so a field the sender reads cannot be missing
from the bench (a GPU sitting lost tests/gpu/test_vllm_gpu.py to exactly that). On the CPU the sender
is built as far as waiting for an engine, which none starts here: it must stop with the trainer's
refusal, not an AttributeError."""

import sys
from pathlib import Path

import pytest

from framework.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sender_is_built_like_the_trainers(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import weight_sync_bench as w

    from framework import api
    from framework.resolve.resolver import resolve

    r = resolve("debug_grpo_vllm", ["publish.interval=1"], world_size=1, for_training=False)
    writer = r.ctx.components["model"].hf_writer(r.ctx.options["model"], r.ctx)
    model = api.build_model("debug_grpo_vllm", device="cpu")
    with pytest.raises(UserError, match="Start the generator"):
        w.sender(model, writer, tmp_path / "weights", "ipc", bucket_mb=1, timeout=0.5)
