"""The buckets an in-memory transport hands the engine hold the trained weights when the model is
sharded: 2 gloo ranks, FSDP2 over both and expert parallel 2 (debug_moe), one training step, then
every rank joins Snapshot.fill; rank 0's buckets equal the folder a publication of the same weights
writes (framework/train/publish.py's gather and the family's converter), tensor for tensor."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conftest import ROOT, free_port, fresh_process_state, spawn_ranks


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", WANDB_MODE="disabled", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port))
    sys.path.insert(0, str(ROOT))
    import logging

    import torch
    import torch.distributed as dist

    import framework  # noqa: F401  (device shims before torchtitan)

    torch.set_num_threads(1)
    from torchtitan.tools.logging import init_logger

    from components.transport import snapshot
    from framework.resolve.resolver import resolve
    from framework.train import publish
    from framework.train.build import trainer_config

    init_logger()
    logging.getLogger().setLevel(logging.ERROR)
    r = resolve("debug_moe", ["state=fsdp2", "parallel.ep=2", "training.seq_len=64", "training.local_batch=1",
                              "training.steps=1", "checkpoint.enable=false", "logging.tensorboard=false",
                              f"output_dir={out}/run", "launcher.nproc=2"])
    trainer = trainer_config(r).build()
    try:
        trainer.train()
        writer = r.ctx.components["model"].hf_writer(r.ctx.options["model"], r.ctx)
        parts = trainer.model_parts
        assert any(isinstance(v, torch.distributed.tensor.DTensor) for p in parts for v in p.state_dict().values())
        plan = snapshot.plan(snapshot.meta_state(parts), writer.to_hf, torch.bfloat16, bucket_bytes=32 * 1024)
        snap = snapshot.Snapshot(plan, torch.device("cpu"), holder=rank == 0)
        snap.fill(parts, writer.to_hf)
        settings = publish.PublishSettings(interval=1, dir=f"{out}/w", keep=1, background="false", convert=writer,
                                           dtype="bfloat16")
        sd = publish.Publisher(settings)._gather(trainer)  # a collective, as a publication runs it
        if rank == 0:
            folder, _ = writer(sd)
            got = {name: snap.view(name).clone() for name in folder}
            torch.save({"folder": folder, "buckets": got, "n_buckets": len(plan.buckets),
                        "names": [e.name for e in plan.entries()]}, f"{out}/result.pt")
    finally:
        trainer.close()
        dist.destroy_process_group()
        fresh_process_state()


def test_two_ranks_fsdp_and_ep_fill_the_buckets_with_the_published_weights(tmp_path):
    import torch

    spawn_ranks(_worker, 2, free_port(), str(tmp_path))
    res = torch.load(Path(tmp_path) / "result.pt", weights_only=False)
    assert res["n_buckets"] > 1
    assert sorted(res["names"]) == sorted(res["folder"])
    for name, t in res["folder"].items():
        assert t.dtype == torch.bfloat16 and torch.equal(res["buckets"][name], t), name
