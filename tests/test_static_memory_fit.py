"""A model whose parameters, gradients and optimizer states alone exceed the memory (was: "No local
batch fits at this training.seq_len; shorten it", repeated at training.seq_len=256): the memory
preflight says that no sequence length fits and names what would help (framework/plan/static_fit.py)."""

from __future__ import annotations

import pytest

from framework.errors import UserError

GiB = 2**30
BIG = ["parallel.cp=1", "data.tokenizer=byte", "data.name=packaged", "output_dir=run", "training.seq_len=256"]


def _refusal(overrides) -> str:
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve("qwen3_30b_a3b_64k", overrides)
    return " ".join(str(e.value).split())


def test_a_model_too_big_for_the_host_at_any_length_says_so(workdir, monkeypatch):
    from framework.plan import preflight

    monkeypatch.setattr(preflight, "host_memory_available", lambda: (22 * GiB, "a test's 22 GiB"))
    text = _refusal(BIG)
    assert "parameters, gradients and optimizer states alone need" in text
    assert "does not fit at any training.seq_len" in text
    assert "shorten it" not in text and "No local batch fits" not in text
    assert "more memory or GPUs to shard it over" in text and "model.n_layers=" in text and "adapter=lora" in text
    k = int(text.split("model.n_layers=")[1].split()[0])
    assert 1 <= k < 48
    assert not (workdir / "run").exists()


def test_a_model_too_big_for_the_gpu_at_any_length_says_so(workdir):
    text = _refusal(BIG + ["preflight.gpu=H100"])
    assert "alone need" in text and "per GPU at 1 GPU(s)" in text and "does not fit at any training.seq_len" in text
    assert "more GPUs to shard it over" in text and "a shorter training.seq_len" not in text
