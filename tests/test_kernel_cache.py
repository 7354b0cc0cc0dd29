"""Kernel caches across launches (framework.train.kernel_cache): which variables a recipe sets, that
user exports win, that autotuners defined before the setting (fla's, imported while resolving
a recipe) cache too, and the per-step autotuning counts that metrics.jsonl logs."""

import os

import pytest

from framework.train import kernel_cache


def test_configure_sets_caches_and_respects_user_exports(tmp_path):
    env = {}
    added = kernel_cache.configure(str(tmp_path / "k"), True, env)
    assert env == added == {"TRITON_CACHE_AUTOTUNING": "1", "TRITON_CACHE_DIR": str(tmp_path / "k" / "triton"),
                            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "k" / "inductor"),
                            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    env = {"TRITON_CACHE_DIR": "/mine", "TRITON_CACHE_AUTOTUNING": "0", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    assert kernel_cache.configure(str(tmp_path / "kc"), True, env) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "kc" / "inductor"), "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
    assert env["TRITON_CACHE_DIR"] == "/mine" and env["TRITON_CACHE_AUTOTUNING"] == "0"
    env = {}
    assert kernel_cache.configure(None, False, env) == {} and env == {}


def test_autotuners_defined_before_configure_cache_to_disk(monkeypatch):
    pytest.importorskip("fla")
    from fla.ops.common import chunk_delta_h  # defines autotuned kernels at import
    from triton.runtime.autotuner import Autotuner

    def autotuner(obj):  # under @triton.heuristics the Autotuner is the wrapped .fn
        while obj is not None and not isinstance(obj, Autotuner):
            obj = getattr(obj, "fn", None)
        return obj

    tuners = [t for t in map(autotuner, vars(chunk_delta_h).values()) if t is not None]
    assert len(tuners) >= 2
    for t in tuners:
        monkeypatch.setattr(t, "cache_results", False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # configure writes here; restored after
    kernel_cache.configure(None, True)
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert all(t.cache_results for t in tuners)


def test_autotune_log_counts_per_step():
    log = kernel_cache.AutotuneLog()
    ev = dict(fn=None, key=(1,), best_config=None, configs_timings={})
    log(**ev, duration=12.5, cache_hit=False)
    log(**ev, duration=0.5, cache_hit=False)
    log(**ev, duration=None, cache_hit=True)
    assert log.take() == {"autotune_s": 13.0, "autotuned_kernels": 2, "autotune_cache_hits": 1}
    assert log.take() == {"autotune_s": 0.0, "autotuned_kernels": 0, "autotune_cache_hits": 0}


def test_autotune_log_becomes_tritons_listener(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.autotuning, "listener", None)
    log = kernel_cache.AutotuneLog()
    assert log.install() and knobs.autotuning.listener is log


def test_console_line_names_autotuning_only_when_some_happened():
    from framework.report.progress import autotune_note as _autotune_note

    assert _autotune_note({"autotune_s": 0.0, "autotuned_kernels": 0, "autotune_cache_hits": 0}) == ""
    note = _autotune_note({"autotune_s": 212.34, "autotuned_kernels": 14, "autotune_cache_hits": 3})
    assert note == "  (autotuning 212.3 s: 14 kernels tuned, 3 from the disk cache)"
