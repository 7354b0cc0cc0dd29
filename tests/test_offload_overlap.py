"""state.offload_overlap=true and state.offload_update=device (components/state/offload.py) against
state.offload=optimizer without overlap and against state.offload=none, on CPU gloo ranks.

One spawn of 2 worker processes (one 2-rank world, FSDP2 over 2 ranks, EP 2) trains the debug_moe
recipe for 3 steps with gradient accumulation 2 (local batch 1, global batch 4) and a clip that
clips every step (training.max_norm far below the grad norm), checkpointing at step 2:
  none: offload=none; off: offload=optimizer; ovl: offload=optimizer + offload_overlap, with small
  host-update chunks; ovl->resume: ovl's step-2 checkpoint resumed to step 3; dev: offload=optimizer
  with offload_update=device (moments on the host, the update on the device, in small chunks);
  dev->resume: dev's step-2 checkpoint resumed with dev; none->dev: none's resumed with dev.
On CPU the overlap's copies are synchronous, but the path is the GPU's: FSDP2 calls the hooks after
each reduce-scatter, the clip goes through the gradients' scale owner (contracts.own_gradients) and the host update
runs chunk by chunk.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, fresh_process_state, read_metrics, run_cli, spawn_ranks

MAX_NORM = 0.05
COMMON = ["state=fsdp2", "training.seq_len=64", "logging.tensorboard=false", "checkpoint.keep_latest_k=0",
          "lr.decay_ratio=0.0", "training.local_batch=1", "training.global_batch=4", f"training.max_norm={MAX_NORM}",
          "training.steps=3", "checkpoint.interval=2"]
CHUNK_BYTES = 64 << 10  # several host-update chunks on debug_moe (its largest parameter is ~50 KiB per rank)


# ------------------------------------------------------------------ worker side (spawned)


def _locals(sd: dict) -> dict:
    import torch

    from components.state.common import local

    return {k: local(v).detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _run_job(job: dict, rank: int, port: int) -> dict:
    import torch.distributed as dist

    from framework.resolve.resolver import resolve
    from framework.train import run
    from framework.train.build import trainer_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_PORT=str(port))
    if "copy_from" in job:  # resume a copy of an earlier run at its step-2 checkpoint
        dst = Path(job["out"])
        if rank == 0:
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.copytree(job["copy_from"], tmp)
            shutil.rmtree(tmp / "checkpoint" / "step-3")
            (tmp / "metrics.jsonl").unlink()
            tmp.rename(dst)
        while not dst.is_dir():
            time.sleep(0.1)
    r = resolve("debug_moe", [*COMMON, *job["overrides"], f"output_dir={job['out']}", "launcher.nproc=2"])
    if rank == 0:
        run.write_run_files(r)
    tc = trainer_config(r)
    if "overlap=true" in " ".join(job["overrides"]) or "offload_update=device" in " ".join(job["overrides"]):
        tc.optimizer.chunk_bytes = CHUNK_BYTES
    trainer = tc.build()
    try:
        trainer.train()
        opt = trainer.optimizers
        out = {"model": _locals({k: v for m in trainer.model_parts for k, v in m.state_dict().items()}),
               "optim": _locals(opt.state_dict()), "grad_accum": None, "copies": None}
        if type(opt).__name__ == "DeviceUpdateOptimizers":
            states = [(p, opt._opt_of[id(p)].state[p]) for p in opt._params]
            out.update(chunk_steps=opt.chunk_steps, chunks=len(opt._chunks), n_params=len(opt._params),
                       host_moments=len(opt._host),
                       # between steps every moment is the host tensor the optimizer keeps, not a device one
                       moments_are_host=all(st[k] is opt._host[(id(p), k)] for p, st in states
                                            for k in ("exp_avg", "exp_avg_sq")))
        if type(opt).__name__ == "HostOptimizers":
            out.update(grad_accum=opt.grad_accum, copies=opt.copies, late_copies=opt.late_copies,
                       n_params=len(opt._pairs), chunks=len(opt._chunks) if opt.overlap else 0)
        return out
    finally:
        trainer.close()
        dist.destroy_process_group()
        fresh_process_state()


def _worker(rank: int, jobs: list[dict], ports: list[int], base: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", WANDB_MODE="disabled")
    sys.path.insert(0, str(ROOT))
    import logging

    import torch

    import framework  # noqa: F401  (device shims before torchtitan)

    torch.set_num_threads(1)
    from torchtitan.tools.logging import init_logger

    init_logger()
    logging.getLogger().setLevel(logging.ERROR)
    for job, port in zip(jobs, ports):
        torch.save(_run_job(job, rank, port), Path(f"{job['out']}.rank{rank}.pt"))  # tensors outlive the worker


# ------------------------------------------------------------------ test side


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch

    base = tmp_path_factory.mktemp("overlap")
    ovl = ["state.offload=optimizer", "state.offload_overlap=true"]
    dev = ["state.offload=optimizer", "state.offload_update=device"]
    jobs = [
        {"name": "none", "overrides": ["state.offload=none"], "out": str(base / "none")},
        {"name": "off", "overrides": ["state.offload=optimizer"], "out": str(base / "off")},
        {"name": "ovl", "overrides": ovl, "out": str(base / "ovl")},
        {"name": "ovl->resume", "overrides": [*ovl, "checkpoint.resume=true"], "out": str(base / "ovl_resume"),
         "copy_from": str(base / "ovl")},
        {"name": "dev", "overrides": dev, "out": str(base / "dev")},
        {"name": "dev->resume", "overrides": [*dev, "checkpoint.resume=true"], "out": str(base / "dev_resume"),
         "copy_from": str(base / "dev")},
        {"name": "none->dev", "overrides": [*dev, "checkpoint.resume=true"], "out": str(base / "none_dev"),
         "copy_from": str(base / "none")},
    ]
    procs = spawn_ranks(_worker, 2, jobs, [free_port() for _ in jobs], str(base), join=False)
    deadline = time.time() + 600
    while not procs.join(timeout=2):
        if time.time() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("overlap workers did not finish in 600 s")
    results: dict = {}
    for job in jobs:
        for rank in (0, 1):
            res = torch.load(Path(f"{job['out']}.rank{rank}.pt"), weights_only=False)
            res["metrics"] = read_metrics(Path(job["out"]))
            results.setdefault(job["name"], {})[rank] = res
    results["base"] = base
    return results


def _assert_states(a: dict, b: dict, atol: float = 0.0, rtol: float = 0.0) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            if atol == rtol == 0.0:
                assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())
            else:
                torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")
        else:
            assert a[k] == b[k], k


def test_the_clip_clips_and_the_runs_train(runs):
    m = runs["off"][0]["metrics"]
    assert [r["step"] for r in m] == [1, 2, 3]
    assert all(r["grad_norm"] > 10 * MAX_NORM for r in m)  # the clip coefficient is < 0.1 every step
    assert runs["ovl"][0]["grad_accum"] == runs["off"][0]["grad_accum"] == 2


def test_overlap_is_bit_equal_to_the_non_overlapped_offload(runs):
    """Same gradients on the device, same norm (torchtitan's, over the same device gradients), the
    clip coefficient multiplied into the gradient in fp32 on the host instead of on the device (one
    rounded product either way: the same bits), and Adam elementwise per parameter whether it steps
    all masters at once or chunk by chunk: parameters, moments and losses equal bit for bit."""
    for rank in (0, 1):
        off, ovl = runs["off"][rank], runs["ovl"][rank]
        _assert_states(ovl["model"], off["model"])
        _assert_states(ovl["optim"], off["optim"])
        assert [r["loss"] for r in ovl["metrics"]] == [r["loss"] for r in off["metrics"]]
        assert [r["grad_norm"] for r in ovl["metrics"]] == [r["grad_norm"] for r in off["metrics"]]


# offload=none steps torch's AdamW on the device's DTensor parameters (another kernel, and on CPU
# the same device as the host one), so the update's last bits may differ: one Adam step moves a
# parameter by at most ~lr (|m_hat / (sqrt(v_hat) + eps)| <= ~1), computed in another order it is off
# by a few fp32 roundings of that, ~1e-6 x lr, and adding it to a parameter of magnitude <= ~1 rounds
# to a neighbouring fp32 value at worst (6e-8 relative). Three steps, the later ones' gradients
# perturbed by those differences (Adam normalizes a gradient perturbation into the same relative
# perturbation of the step), stay below 1e-6 absolute and relative; the moments, which are sums of
# (clipped) gradients of ~1e-3 and their squares, below 1e-5 relative. Measured on this CPU: bit-equal
# (both update with the same AdamW arithmetic on the same processor).
NONE_ATOL, NONE_RTOL = 1e-6, 1e-5


def test_overlap_matches_offload_none(runs):
    for rank in (0, 1):
        ovl, none = runs["ovl"][rank], runs["none"][rank]
        _assert_states(ovl["model"], none["model"], NONE_ATOL, NONE_RTOL)
        o, n = ovl["optim"], none["optim"]
        assert o.keys() == n.keys()
        for k in o:
            if k.endswith(("exp_avg", "exp_avg_sq")):
                import torch

                torch.testing.assert_close(o[k], n[k], atol=1e-12, rtol=NONE_RTOL, msg=lambda m: f"{k}: {m}")


def test_the_hooks_copy_each_gradient_once_per_step(runs):
    for rank in (0, 1):
        ovl, res = runs["ovl"][rank], runs["ovl->resume"][rank]
        n = ovl["n_params"]
        assert n > 10 and ovl["chunks"] > 2  # several chunks: shards travel while the next chunk updates
        # last micro-batch only (2 accumulations each), none left to the step
        assert ovl["copies"] == 3 * n and ovl["late_copies"] == 0
        assert res["copies"] == 1 * n and res["late_copies"] == 0  # the resumed run ran step 3 only
        assert runs["off"][rank]["copies"] == 0  # without overlap nothing copies during the backward


def test_resume_of_an_overlapped_run(runs):
    """The overlapped run's step-2 checkpoint holds what the non-overlapped one's holds (same keys,
    same values); resumed with overlap it reaches the uninterrupted run's step 3 bit for bit."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    base = runs["base"]
    saved = {}
    for name in ("off", "ovl"):
        dcp_to_torch_save(base / name / "checkpoint" / "step-2", base / f"{name}.pt")
        saved[name] = torch.load(base / f"{name}.pt", weights_only=False)
    flat = {}
    for name, sd in saved.items():
        flat[name] = {}

        def walk(prefix, v, into):
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}{k}.", x, into)
            else:
                into[prefix[:-1]] = v

        walk("", sd, flat[name])
    assert flat["ovl"].keys() == flat["off"].keys()
    assert any(k.endswith("exp_avg_sq") for k in flat["ovl"])
    for k, v in flat["ovl"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, flat["off"][k]), k
        elif k.rpartition(".")[2] not in ("time", "timestamp"):
            assert v == flat["off"][k], k
    for rank in (0, 1):
        ovl, res = runs["ovl"][rank], runs["ovl->resume"][rank]
        assert [r["step"] for r in res["metrics"]] == [3]
        assert res["metrics"][0]["loss"] == ovl["metrics"][2]["loss"]
        _assert_states(res["model"], ovl["model"])
        _assert_states(res["optim"], ovl["optim"])


def test_offload_overlap_needs_offload_optimizer():
    from components.state.fsdp2 import FSDP2

    for offload in ("none", "all"):
        with pytest.raises(ValueError, match=f"state.offload_overlap=true .* has state.offload={offload}: .* "
                                             "Set state.offload=optimizer, or drop state.offload_overlap"):
            FSDP2.Options(offload=offload, offload_overlap=True)
    FSDP2.Options(offload="optimizer", offload_overlap=True)


def test_offload_overlap_refused_by_resolve(tmp_path):
    from framework.resolve.resolver import resolve

    with pytest.raises(Exception, match="state.offload_overlap=true .* has state.offload=none"):
        resolve("debug_moe", ["state.offload_overlap=true"], for_training=False)
    p = run_cli(["train", "state.offload=all", "state.offload_overlap=true", "--cfg", "job"], cwd=tmp_path)
    assert p.returncode == 2 and "Set state.offload=optimizer, or drop state.offload_overlap" in p.stdout + p.stderr


def test_overlap_plans_no_extra_device_memory():
    """The overlap's staging is pinned host memory: the plan is the non-overlapped offload's."""
    from framework.plan import planner
    from framework.resolve.resolver import resolve

    ov = ["model.n_layers=4", "training.seq_len=32768", "training.local_batch=1", "parallel.cp=1", "parallel.ep=1",
          "parallel.dp_shard=1", "parallel.gpus=1", "data.name=packaged", "data.tokenizer=byte", "recompute=full",
          "state.offload=optimizer"]
    off = planner.plan(resolve("qwen35_35b_128k", ov, for_training=False), gpu="H200")
    on = planner.plan(resolve("qwen35_35b_128k", ov + ["state.offload_overlap=true"], for_training=False), gpu="H200")
    assert on.memory_bytes == off.memory_bytes and on.torch_reserved_bytes == off.torch_reserved_bytes


def test_nonfinite_norm_reaches_the_guard_and_a_skipped_step_leaves_no_trace():
    """The clip returns torchtitan's norm, NaN included (the trainer's guard reads it from
    compat.LAST_GRAD_NORM and skips with zero_grad), without scaling the device gradients; after the
    skip the next step counts its micro-batches afresh and lands where the non-overlapped offload does."""
    import torch
    import torch.nn as nn

    from framework import compat
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    compat.patch_clip_grad_norm()  # as the trainer does: the norm lands in compat.LAST_GRAD_NORM
    from torchtitan.distributed import utils as dist_utils  # after framework's device shims

    final = {}
    for overlap in (False, True):
        tc = trainer_config(resolve("debug_moe", ["state.offload=optimizer", f"state.offload_overlap={str(overlap).lower()}",
                                                  "training.local_batch=1", "training.global_batch=2"]))
        assert tc.optimizer.grad_accum == 2 and tc.optimizer.overlap == overlap
        tc.optimizer.chunk_bytes = 256  # each Linear weight its own chunk
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
        opt = tc.optimizer.build(model_parts=[m])
        params = list(m.parameters())
        torch.manual_seed(1)
        for step in range(3):
            opt.zero_grad()
            for _ in range(2):
                m(torch.randn(5, 16)).square().sum().backward()
            if step == 1:  # a poisoned step: the guard skips it
                params[0].grad[0, 0] = float("nan")
                before = [p.grad.clone() for p in params]
                norm = dist_utils.clip_grad_norm_(params, 0.1)
                assert torch.isnan(norm) and compat.LAST_GRAD_NORM[0] is norm
                if overlap:  # the device gradients were not scaled (NaN x coefficient would be all NaN)
                    assert all(torch.equal(b[1:], p.grad[1:]) for b, p in zip(before, params) if b.dim() == 2)
                continue  # the guard: zero_grad, no step
            norm = dist_utils.clip_grad_norm_(params, 0.1)
            assert float(norm) > 0.1  # it clips
            opt.step()
        final[overlap] = [p.detach().clone() for p in params]
        if overlap:
            assert opt.copies == 3 * len(params) and opt.late_copies == 0 and len(opt._chunks) >= 2
    assert all(torch.equal(a, b) for a, b in zip(final[False], final[True]))


def test_device_update_is_bit_equal_to_offload_none(runs):
    """offload_update=device steps torch's AdamW (the same optimizer objects offload=none builds) on the
    same device parameters, one chunk at a time: parameters, moments, losses and norms equal bit for bit,
    and between steps every moment is the host tensor the optimizer keeps."""
    for rank in (0, 1):
        dev, none = runs["dev"][rank], runs["none"][rank]
        _assert_states(dev["model"], none["model"])
        _assert_states(dev["optim"], none["optim"])
        assert [r["loss"] for r in dev["metrics"]] == [r["loss"] for r in none["metrics"]]
        assert [r["grad_norm"] for r in dev["metrics"]] == [r["grad_norm"] for r in none["metrics"]]
        assert dev["chunks"] > 2 and dev["chunk_steps"] == 3 * dev["chunks"]  # every chunk, every step
        assert dev["host_moments"] == 2 * dev["n_params"] and dev["moments_are_host"]


def test_device_update_checkpoints_interchange_with_offload_none(runs):
    """dev's step-2 checkpoint resumed with dev reaches dev's step 3, and none's step-2 checkpoint resumed
    with dev reaches none's step 3: bit for bit (the checkpoint layout is offload=none's)."""
    for rank in (0, 1):
        for resumed, whole in (("dev->resume", "dev"), ("none->dev", "none")):
            res, ref = runs[resumed][rank], runs[whole][rank]
            assert [r["step"] for r in res["metrics"]] == [3]
            assert res["metrics"][0]["loss"] == ref["metrics"][2]["loss"], resumed
            _assert_states(res["model"], ref["model"])
            _assert_states(res["optim"], ref["optim"])
            assert res["chunk_steps"] == res["chunks"]  # the resumed run stepped once


def test_device_update_settings_are_checked():
    from components.state.fsdp2 import FSDP2

    for offload in ("none", "all"):
        with pytest.raises(ValueError, match=f"state.offload_update=device .* has state.offload={offload}.* "
                                             "Set state.offload=optimizer, or drop state.offload_update"):
            FSDP2.Options(offload=offload, offload_update="device")
    for extra in ({"offload_overlap": True}, {"offload_threads": 4}):
        with pytest.raises(ValueError, match="settings of the host update.* would do nothing"):
            FSDP2.Options(offload="optimizer", offload_update="device", **extra)
    FSDP2.Options(offload="optimizer", offload_update="device")
    p = run_cli(["train", "state.offload_update=device", "--cfg", "job"], cwd=ROOT)
    assert p.returncode == 2 and "Set state.offload=optimizer, or drop state.offload_update" in p.stdout + p.stderr


def test_device_update_plans_its_moment_window():
    """The plan is the host update's (fp32 master on the device, moments on the host) plus the window of
    chunks whose moments are on the device at once."""
    from components.state.fsdp2 import DEVICE_UPDATE_CHUNK_BYTES
    from framework.plan import planner
    from framework.resolve.resolver import resolve

    ov = ["model.n_layers=4", "training.seq_len=32768", "training.local_batch=1", "parallel.cp=1", "parallel.ep=1",
          "parallel.dp_shard=1", "parallel.gpus=1", "data.name=packaged", "data.tokenizer=byte", "recompute=full",
          "state.offload=optimizer"]
    host = planner.plan(resolve("qwen35_35b_128k", ov, for_training=False), gpu="H200")
    dev = planner.plan(resolve("qwen35_35b_128k", ov + ["state.offload_update=device"], for_training=False), gpu="H200")
    from components.state.device_update import DeviceUpdateOptimizers
    from components.state.fsdp2 import PLAN_CONSTANTS

    window = dev.memory_bytes.pop("offload_moment_window")
    # the largest parameter's chunk (the LM head's 248,320 x 2,048, which the planner counts with the final
    # norm's 2,048, on this one rank) and two chunks of 256 MiB of fp32 parameters, 8 bytes of fp32 moments
    # each (one H200: 57.7 GiB reserved against 55.8 planned with 3 plain chunks; that chunk's moments
    # alone are 3.8 GiB)
    assert window == (248320 * 2048 + 2048 + 2 * DEVICE_UPDATE_CHUNK_BYTES / 4) * 8
    assert DeviceUpdateOptimizers.WINDOW == PLAN_CONSTANTS["offload_device_window_chunks"].value == 3
    assert dev.memory_bytes == host.memory_bytes


def test_offloaded_state_stays_on_the_host_in_its_checkpoint_wrapper(tmp_path):
    """Checkpoints wrap offloaded state (host tensors) in its parameter's DTensor placements; the wrapper
    must not copy it to the mesh's device (DTensor.from_local would: a device copy of every moment at
    each save, the memory the offload frees). A CUDA mesh is built without a GPU (no backend), so on this
    machine the copy would fail and on a GPU machine it would land on the device."""
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}", RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from components.state.offload import _like, flat_state_dict
        mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size([4, 3]), (3, 1), torch.float32))
        p = DTensor(torch.zeros(4, 3), spec, requires_grad=False)  # a parameter shard of a CUDA mesh
        host = torch.randn(4, 3)
        w = _like(p, host)
        assert isinstance(w, DTensor) and w._local_tensor.data_ptr() == host.data_ptr(), w._local_tensor.device
        assert w.device_mesh is mesh and w.placements == p.placements and w.shape == p.shape
        assert w.dtype == host.dtype and _like(host, host) is host
        dist.destroy_process_group()
        print("wrapped in place")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "wrapped in place" in proc.stdout, proc.stderr[-3000:]


def test_the_finite_check_waits_for_the_host_copies(monkeypatch):
    """The trainer's finite-state check reads the optimizer's host moments before a checkpoint: with the
    device update it first waits for the copies still in flight (host_state_ready)."""
    from framework.train.trainer import ApiaryTrainer

    calls = []

    class Opt:
        optimizers = []

        def host_state_ready(self):
            calls.append("ready")

    t = ApiaryTrainer.__new__(ApiaryTrainer)
    t.model_parts, t.optimizers = [], Opt()
    monkeypatch.setattr(ApiaryTrainer, "_agree", lambda self, flags: flags, raising=False)
    t._check_state_finite()
    assert calls == ["ready"]
