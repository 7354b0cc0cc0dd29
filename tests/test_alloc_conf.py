"""The CUDA allocator settings every rank runs with (framework/alloc_conf.py)."""

from pathlib import Path

import pytest

from framework import alloc_conf, devices

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    for k in alloc_conf.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_default_is_expandable_segments(clean_env):
    assert alloc_conf.current() == "expandable_segments:True"
    assert alloc_conf.expandable()


@pytest.mark.parametrize("key", alloc_conf.ENV_KEYS)
def test_a_users_value_wins_and_is_read(clean_env, key):
    clean_env.setenv(key, "max_split_size_mb:512,expandable_segments:False")
    assert not alloc_conf.set_default()
    assert alloc_conf.current() == "max_split_size_mb:512,expandable_segments:False"
    assert not alloc_conf.expandable()


def test_torch_reads_the_new_name_first(clean_env):
    clean_env.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert alloc_conf.expandable()


def test_settings_without_the_key_are_torchs_default(clean_env):
    assert not alloc_conf.expandable("max_split_size_mb:256")
    assert alloc_conf.expandable(" garbage_collection_threshold:0.8 , expandable_segments: true ")


def test_a_rank_puts_the_default_into_its_environment(clean_env):
    import os

    devices.apply_allocator_default()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == alloc_conf.DEFAULT


def test_the_slurm_script_exports_the_same_default():
    text = (ROOT / "launchers/slurm/train.sbatch.j2").read_text()
    assert f"PYTORCH_CUDA_ALLOC_CONF=${{PYTORCH_CUDA_ALLOC_CONF:-{alloc_conf.DEFAULT}}}" in text


def test_every_rank_applies_it_before_training():
    """run.train prepares the process first (process.prepare), which applies the default right after the
    device shims, before torch builds anything."""
    run = (ROOT / "framework/train/run.py").read_text()
    train = run[run.index("def train(resolved"):]
    assert train.index("process.prepare(") < train.index("trainer_config")
    src = (ROOT / "framework/train/process.py").read_text()
    body = src[src.index("def prepare("):]
    assert body.index("devices.install()") < body.index("devices.apply_allocator_default()") \
        < body.index("kernel_cache.configure(")
