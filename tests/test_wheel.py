"""A non-editable install runs: the wheel carries the registry, the recipes, the Slurm template and
the skill pages (pyproject.toml data-files; framework/compose/registry.py finds them under
<prefix>/share/apiary), so `train --cfg job` and two steps of the default recipe work from another
folder with the wheel installed in a fresh environment (whose other dependencies come from this one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

from conftest import ROOT


def _run(cmd, cwd, timeout=600):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_built_wheel_trains_from_another_folder(tmp_path):
    wheels, src = tmp_path / "wheels", tmp_path / "src"
    # a copy of the checkout to build from: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".gpu-stack", "build", "runs", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", "outputs", "wandb"))
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
              str(src)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = wheels.glob("apiary-*.whl")
    env_dir = tmp_path / "env"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    py = env_dir / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    # the fresh environment sees this one's dependencies (torch, torchtitan, ...) but not its apiary
    (tmp_path / site.stdout.strip() / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: never touch this environment's own (editable) apiary while installing elsewhere
    r = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
              "--prefix", str(env_dir), str(whl)], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(py), "-c", "import framework; print(framework.__file__)"], cwd=work)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr  # the wheel's code, not the checkout's

    r = _run([str(py), "-m", "framework.cli", "--cfg", "job"], cwd=work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "flavor: tiny_moe" in r.stdout

    r = _run([str(py), "-m", "framework.cli", "training.steps=2", "checkpoint.interval=2", "output_dir=run",
              "logging.tensorboard=false", "logging.color=false"], cwd=work)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert (work / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert (work / "run" / "checkpoint" / "step-2").is_dir()
    mine = _run([sys.executable, "-c", "import framework; print(framework.__file__)"], cwd=work)
    assert str(ROOT) in mine.stdout, mine.stdout + mine.stderr  # this environment's apiary is still the checkout's
