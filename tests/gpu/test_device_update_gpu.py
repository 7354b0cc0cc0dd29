"""state.offload_update=device on a GPU: the optimizer step runs chunk by chunk on the device while the
Adam moments travel host->device on one side stream and device->host on another
(components/state/device_update.py). Those streams must wait for the right work: the fetch of a
chunk's moments for the previous step's copies out, the update for the fetch, the copy out for the
update. CPU CI runs the same code with synchronous copies (tests/test_offload_overlap.py), so only a
GPU can catch a missing wait.

The check: debug_moe trained 4 steps on one GPU with the device update in small chunks, against
state.offload=none, must give the same losses, gradient norms and final weights, bit for bit. Each
optimizer step starts behind a long sleep kernel on the current stream, so a side stream that does
not wait for the current one reads moments or gradients before they are written and the runs part.

    python -m pytest -q tests/gpu/test_device_update_gpu.py        # skipped without CUDA
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import ROOT, free_port, read_metrics, spawn_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

COMMON = ["training.seq_len=64", "training.steps=4", "training.local_batch=2", "checkpoint.enable=false",
          "logging.tensorboard=false", "lr.decay_ratio=0.0", "precision.compile=false"]
CHUNK_BYTES = 64 << 10  # many chunks on debug_moe, so fetches, updates and copies out overlap
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a busy current stream before every optimizer step


def _train(rank: int, out: str, overrides: list[str], delay: bool, port: int) -> None:
    """One run in a fresh process (one Trainer per process); its losses, grad norms and weights to out.pt."""
    sys.path.insert(0, str(ROOT))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WANDB_MODE="disabled")
    import framework  # noqa: F401  (device shims before torchtitan)
    from components.state.common import local
    from components.state.device_update import DeviceUpdateOptimizers
    from framework.resolve.resolver import resolve
    from framework.train import run
    from framework.train.build import trainer_config

    if delay:
        step = DeviceUpdateOptimizers.step

        def late_step(self, *a, **kw):
            torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is still busy when the side streams are asked
            return step(self, *a, **kw)

        DeviceUpdateOptimizers.step = late_step
    r = resolve("debug_moe", [*COMMON, *overrides, f"output_dir={out}"])
    run.write_run_files(r)
    tc = trainer_config(r)
    if "state.offload_update=device" in overrides:
        tc.optimizer.chunk_bytes = CHUNK_BYTES
    trainer = tc.build()
    try:
        trainer.train()
        opt = trainer.optimizers
        chunks = len(opt._chunks) if isinstance(opt, DeviceUpdateOptimizers) else 0
        model = {k: local(v).detach().float().cpu().clone() for m in trainer.model_parts
                 for k, v in m.state_dict().items()}  # one rank: the local shard is the whole tensor
        torch.save({"model": model, "metrics": [r for r in read_metrics(Path(out)) if "loss" in r], "chunks": chunks},
                   f"{out}.pt")
    finally:
        trainer.close()


def _run(tmp_path: Path, name: str, overrides: list[str], delay: bool) -> dict:
    out = str(tmp_path / name)
    spawn_ranks(_train, 1, out, overrides, delay, free_port())
    return torch.load(f"{out}.pt")


def test_device_update_with_a_busy_stream_equals_no_offload(tmp_path):
    dev = _run(tmp_path, "dev", ["state.offload=optimizer", "state.offload_update=device"], True)
    none = _run(tmp_path, "none", ["state.offload=none"], False)
    assert dev["chunks"] > 2  # the moments really travel in several chunks
    assert [r["loss"] for r in dev["metrics"]] == [r["loss"] for r in none["metrics"]]
    assert [r["grad_norm"] for r in dev["metrics"]] == [r["grad_norm"] for r in none["metrics"]]
    assert dev["model"].keys() == none["model"].keys()
    for k in none["model"]:
        assert torch.equal(dev["model"][k], none["model"][k]), (k, (dev["model"][k] - none["model"][k]).abs().max())
