import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")
# GPU tests: keep Triton's autotuning results on disk, so a rerun on the same machine skips the
# minutes of fla kernel autotuning (docs/skills/kernel_cache.md); no effect on CPU
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def run_cli(argv: list[str], cwd: Path, timeout: int = 600, env: dict | None = None):
    """Run the real console entry in a fresh interpreter (as a user would)."""
    import subprocess

    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        e.pop(k, None)
    return subprocess.run([sys.executable, "-m", "framework.cli", *argv], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


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
