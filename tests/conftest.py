"""Shared fixtures and helpers for the whole suite (one definition each; test files import them
with ``from conftest import ...``).

- processes: ``run_cli`` (the console entry in a fresh interpreter, ``nproc=N`` for N ranks),
  ``train_here`` (one rank's ``train`` through the console entry in this process: no interpreter start-up),
  ``spawn_ranks`` (N ranks of a Python function), ``run_ranks`` (N ranks of a script under
  torchrun), ``free_port``;
- data and numbers: ``lm_head_data``, ``rel_err`` / ``assert_rel`` (norm-wise, tensors),
  ``rel_close`` (scalars), ``read_metrics``, and the fp32 trajectory bound ``TRAJ_LOSS_REL`` /
  ``TRAJ_NORM_REL`` with ``assert_same_trajectory``;
- ``run_in_triton_interpreter``: a test module's case function under ``TRITON_INTERPRET=1``.

Opt-in tests carry ``@pytest.mark.slow``; pyproject.toml deselects them by default and
``pytest -m slow`` runs them (docs/testing.md).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")
# GPU tests: keep Triton's autotuning results on disk, so a rerun on the same machine skips the
# minutes of fla kernel autotuning (docs/skills/kernel_cache.md); no effect on CPU
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
IGN = -100  # the ignore index of every loss

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
             "MASTER_PORT")


# ------------------------------------------------------------------ processes and ranks


def _child_env(env: dict | None = None) -> dict:
    """This environment for a fresh interpreter: the worktree on PYTHONPATH, no rank variables
    inherited from an outer launcher."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    for k in _RANK_ENV:
        e.pop(k, None)
    return e


def run_cli(argv: list[str], cwd: Path, timeout: int = 600, env: dict | None = None):
    """Run the real console entry in a fresh interpreter (as a user would); ``nproc=N`` in argv
    starts N ranks through the local launcher. ``["apiary", ...]`` runs the tools' command (toolkit.cli)."""
    cmd = ["-m", "toolkit.cli", *argv[1:]] if argv[:1] == ["apiary"] else ["-m", "framework.cli", *argv]
    return subprocess.run([sys.executable, *cmd], cwd=cwd, env=_child_env(env),
                          capture_output=True, text=True, timeout=timeout)


def train_here(argv: list[str], cwd: Path, capsys=None) -> subprocess.CompletedProcess:
    """``train ARGV`` (one rank) through the console entry's ``train_main`` in this process, as ``run_cli``
    would run it in a fresh interpreter but without the seconds of importing torch and torchtitan again:
    the same exit code, stdout and stderr (read from ``capsys``; without it, e.g. in a module fixture,
    sys.stdout and sys.stderr are redirected for the call). The working directory, the environment (the
    rank variables and the verified-checkpoint note a run leaves) and torch's thread count are put back
    afterwards. For what needs a real process (signals, torchrun, the interpreter's exit), run_cli."""
    import contextlib
    import io

    import torch

    from framework.cli import train_main

    assert argv[:1] == ["train"] and not any(a.startswith("nproc=") and a != "nproc=1" for a in argv), argv
    saved_env, here, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    for k in _RANK_ENV:
        os.environ.pop(k, None)
    out, err = io.StringIO(), io.StringIO()
    if capsys is not None:
        capsys.readouterr()  # what the test printed before
    try:
        os.chdir(cwd)
        with contextlib.ExitStack() as redirect:
            if capsys is None:
                redirect.enter_context(contextlib.redirect_stdout(out))
                redirect.enter_context(contextlib.redirect_stderr(err))
            code = train_main(list(argv[1:]))
    except SystemExit as e:  # a stop that ends the process with its code (a non-finite step: 76)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
    if capsys is not None:
        got = capsys.readouterr()
        return subprocess.CompletedProcess(["train", *argv[1:]], code, got.out, got.err)
    return subprocess.CompletedProcess(["train", *argv[1:]], code, out.getvalue(), err.getvalue())


def run_ranks(script: Path, args: list[str], nproc: int, cwd: Path, timeout: int = 400, env: dict | None = None):
    """Run a script on ``nproc`` ranks: a plain interpreter for 1, torchrun --standalone otherwise
    (each rank's stdout goes to this process's stdout)."""
    cmd = [sys.executable, str(script)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    return subprocess.run([*cmd, *map(str, args)], cwd=cwd, env=_child_env(env), capture_output=True, text=True,
                          timeout=timeout)


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and unlikely to be taken before a test's ranks listen on it: drawn below the
    kernel's ephemeral range (ports the OS hands to outgoing connections, such as the stores'
    clients, would otherwise collide with one chosen minutes earlier), never the same twice in a
    session, and checked by binding it."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    lo, hi = 10000, max(low - 1, 20000)
    for _ in range(200):
        port = random.randint(lo, hi)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:  # every draw taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_process_state() -> None:
    """torchtitan assumes one Trainer per process; clear what leaks from one to the next
    (the spmd-types mesh registry and DTensor's sharding caches, which compare meshes by
    value and would hand the next Trainer the previous Trainer's mesh objects)."""
    import torch
    import torchtitan.distributed.spmd_types as st
    from torch.distributed.tensor import DTensor

    for k in ("dense_mesh", "sparse_mesh", "mesh_stack"):
        if hasattr(st._MESH_TLS, k):
            delattr(st._MESH_TLS, k)
    sp = DTensor._op_dispatcher.sharding_propagator
    sp.propagate_op_sharding.cache_clear()
    sp._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def spawn_ranks(fn, nprocs: int, *args, join: bool = True):
    """``fn(rank, *args)`` in ``nprocs`` spawned processes (a worker raising fails the caller when
    join=True; with join=False the caller polls the returned context)."""
    import torch.multiprocessing as mp

    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="spawn")


# ------------------------------------------------------------------ data and closeness


def policy_head_batch(seed=0, old_noise=0.3, gen_noise=None, b=2, t=9, h=8, v=23):
    """A small policy-loss batch: hidden [b, t, h], head weight [v, h], labels (IGN where masked), the
    trained-token mask, the head's log-probs at temperature 0.9, old log-probs = those + old_noise x
    N(0, 1) on trained tokens, gen log-probs = old + gen_noise x N(0, 1) (None without gen_noise), and
    per-row advantages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    w = torch.randn(v, h, generator=g) / 2
    labels = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    labels[~mask] = IGN
    with torch.no_grad():
        lp = torch.log_softmax(hidden @ w.T / 0.9, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    old = torch.where(mask, lp + old_noise * torch.randn(b, t, generator=g), torch.zeros_like(lp))
    gen = None
    if gen_noise is not None:
        gen = torch.where(mask, old + gen_noise * torch.randn(b, t, generator=g), torch.zeros_like(lp))
    return hidden, w, labels, mask, lp, old, gen, torch.randn(b, generator=g)


def lm_head_data(n, hd, v, dtype, seed=0, n_ignored=3, scale=1.0, device="cpu"):
    """Hidden states [n, hd], an lm_head weight [v, hd] scaled for O(1) logits, and labels with
    the last vocabulary row as one target and ``n_ignored`` ignored positions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hd, generator=g) * scale).to(dtype)
    w = (torch.randn(v, hd, generator=g) * scale / hd ** 0.5 * 2).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[0] = v - 1  # the last (odd) vocabulary row is a target
    labels[1 + torch.randperm(n - 1, generator=g)[:n_ignored]] = IGN
    return h.to(device), w.to(device), labels.to(device)


def rel_err(got, ref) -> float:
    """Norm-wise relative error (robust to entries that are zero in the reference)."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_rel(got, ref, rel: float) -> None:
    err = rel_err(got, ref)
    assert err <= rel, f"relative error {err:.3e} > {rel:.1e}"


def rel_close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# Two fp32 trainings of an MoE recipe from the same weights whose arithmetic differs only in
# rounding (another reduction order, another split of the batch over ranks, a fused vs a
# materialised loss) drift apart in two ways (benchmarks/fp32_divergence.py measures both on
# debug_moe, seq 64, global batch 4, 10 steps, with per-step gradient noise of 1 and 4 ulps --
# the size of a reordering error -- 8 trials each; Intel Xeon, 2026-11-24):
# - smoothly: clipping and Adam see gradients an ulp apart; <= 1.2e-6 relative in loss by step 10;
# - by routing flips: when a token's k-th and (k+1)-th router scores tie to within rounding, one
#   ulp sends it to another expert, and the step's mean loss jumps by that token's loss change
#   over the step's tokens: 2.7e-5 in loss and 7.7e-5 in grad norm at step 10 (and state=fsdp2
#   vs state=zero1 on 2 ranks of the same CPU: 2.5e-5 / 6.1e-5 at step 10, the failure another
#   2-core Xeon reported against a 1e-5 bound).
# The bound is 7x the largest measured (room for several flips in one step) and still 50x below
# what a real bug moves (a dropped rank's gradient or a wrong scale changes the loss by > 1e-2
# within two steps). It holds for a handful of steps of these debug recipes; a longer or larger
# comparison must measure its own with the script.
TRAJ_LOSS_REL, TRAJ_NORM_REL = 2e-4, 5e-4


def assert_same_trajectory(a: list[dict], b: list[dict], loss_rel: float = TRAJ_LOSS_REL,
                           norm_rel: float = TRAJ_NORM_REL) -> None:
    """Two metrics.jsonl runs: the same steps, losses and grad norms within the given bounds."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert rel_close(x["loss"], y["loss"], loss_rel), (x["step"], x["loss"], y["loss"])
        assert rel_close(x["grad_norm"], y["grad_norm"], norm_rel), (x["step"], x["grad_norm"], y["grad_norm"])


# ------------------------------------------------------------------ Triton interpreter


_INTERP = """
import importlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch
module, fn = sys.argv[2].split(":")
case = getattr(importlib.import_module(module), fn)
print("RESULT" + json.dumps({b + str(dt): case(b, dt) for b in ("triton", "cublas")
                             for dt in (torch.float32, torch.bfloat16)}))
"""


def run_in_triton_interpreter(case: str, timeout: int = 240) -> dict:
    """Triton kernels on the CPU: ``case`` = "test_module:function"; ``function(backend, dtype)``
    runs in a fresh interpreter with TRITON_INTERPRET=1 for backends triton and cublas in fp32 and
    bf16; returns {backend + str(dtype): its (JSON-able) result}."""
    proc = subprocess.run([sys.executable, "-c", _INTERP, str(ROOT), case], capture_output=True, text=True,
                          timeout=timeout, env=_child_env({"TRITON_INTERPRET": "1"}), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is several times faster than two on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _default_allocator_settings(monkeypatch):
    """Every test plans with apiary's default allocator settings (framework/alloc_conf.py), whatever the
    shell exported: the planner's reserve follows them."""
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
