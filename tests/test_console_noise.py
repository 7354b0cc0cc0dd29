"""Console noise from third-party libraries that apiary's own calls trigger, silenced around that call
only, by message and category (docs/reliability.md, "What a run prints"): torch's DTensor RNG warning on
a CPU mesh (torchtitan's seeding), datasets' "Generating train split" bar while a run loads a local
file, peft's FutureWarning in `apiary logprobs --adapter`. Every other warning still reaches the
user, and the libraries' global settings are as they were afterwards."""

from __future__ import annotations

import json
import os
import uuid
import warnings

import pytest

from framework import compat
from framework.compat import originals as compat_originals
from framework.compat import torchtitan_patches

CPU_MESH = "DTensor manual_seed() may not have complete support on cpu device mesh"


def test_seeding_on_a_cpu_mesh_drops_torchs_dtensor_warning_only(monkeypatch):
    """nproc=2 on CPU (gloo): torchtitan's set_determinism seeds DTensor's RNG, which torch supports on
    GPU meshes only, and it warned once per rank (was: two UserWarning lines in the console)."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.model import BaseModel

    def fake_set_determinism(*args, **kwargs):  # what torchtitan's call warns on a CPU mesh, and a real warning
        warnings.warn(CPU_MESH, UserWarning, stacklevel=2)
        warnings.warn("DTensor manual_seed() may not have complete support on cuda device mesh", UserWarning,
                      stacklevel=2)
        warnings.warn("something the user should see", UserWarning, stacklevel=2)
        return "seeded"

    monkeypatch.setattr(dist_utils, "set_determinism", fake_set_determinism)
    monkeypatch.setattr(BaseModel, "init_weights", BaseModel.init_weights)  # restored after the test
    monkeypatch.setattr(compat_originals, "_ORIGINALS", dict(compat_originals._ORIGINALS))
    monkeypatch.setattr(torchtitan_patches, "_SEEDED", [None])
    compat.init_weights_from_seed()
    assert dist_utils.set_determinism is not fake_set_determinism  # apiary's wrapper
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dist_utils.set_determinism() == "seeded"
    messages = [str(w.message) for w in caught]
    assert CPU_MESH not in messages, messages
    assert "something the user should see" in messages and any("cuda device mesh" in m for m in messages), messages
    with warnings.catch_warnings(record=True) as caught:  # outside the call: the filter is gone
        warnings.simplefilter("always")
        warnings.warn(CPU_MESH, UserWarning)
    assert [str(w.message) for w in caught] == [CPU_MESH]


def test_loading_a_local_text_file_in_a_run_shows_no_progress_bar(tmp_path, capfd):
    """The run's loader reads a local jsonl with datasets, whose "Generating train split" bar came out in
    the middle of the run's console (tutorial 2); off around that call, on again after it."""
    import datasets

    from components.data.text import _load_local

    path = tmp_path / f"{uuid.uuid4().hex}.jsonl"  # new content: datasets generates its split (no cache hit)
    path.write_text("".join(json.dumps({"text": f"doc {uuid.uuid4().hex} {i}"}) + "\n" for i in range(5)))
    capfd.readouterr()
    assert not datasets.are_progress_bars_disabled()
    ds = _load_local(str(path))
    assert len(ds) == 5
    out, err = capfd.readouterr()
    assert "Generating train split" not in err + out, err
    assert not datasets.are_progress_bars_disabled()  # the global setting as it was


def test_logprobs_adapter_merge_drops_peft_futurewarning_only(tmp_path, monkeypatch):
    """`apiary logprobs BASE ROLLOUTS --adapter DIR`: peft reads transformers' deprecated
    `is_gradient_checkpointing` while applying the adapter (was: a FutureWarning in the console)."""
    pytest.importorskip("peft")
    import peft
    import transformers

    from components.adapters import export
    from toolkit import logprobs

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    (base / "config.json").write_text("{}")
    (adapter / "adapter_config.json").write_text("{}")

    class Merged:
        def save_pretrained(self, dest):
            self.dest = dest

    class Applied:
        def merge_and_unload(self):
            return Merged()

    def from_pretrained(model, folder):
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                      "`is_activation_checkpointing` instead.", FutureWarning, stacklevel=2)
        warnings.warn("a peft warning the user should see", UserWarning, stacklevel=2)
        return Applied()

    monkeypatch.setattr(export, "check_exported_base", lambda *a: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: object())
    monkeypatch.setattr(peft.PeftModel, "from_pretrained", from_pretrained)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logprobs.merge_adapter(str(base), str(adapter), tmp_path / "merged")
    messages = [str(w.message) for w in caught]
    assert not any("is_gradient_checkpointing" in m for m in messages), messages
    assert "a peft warning the user should see" in messages, messages


def test_the_python_api_on_cpu_prints_no_autocast_warning(tmp_path):
    """README's Python API example on an MoE recipe printed torch's "In CPU autocast, but the target dtype
    is not supported" (torchtitan's router asks for float32 autocast) three lines per call."""
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import torch\nfrom framework import api\nm = api.build_model('debug_moe')\n"
            "print(tuple(m(torch.randint(0, 256, (1, 16))).shape))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "(1, 16," in p.stdout and "autocast" not in p.stderr, p.stderr


def test_a_small_dataset_says_it_relooped_once_and_counts_the_passes(monkeypatch, capsys):
    """The tutorial's training printed torchtitan's `[titan] ... Dataset apiary_local_... is being re-looped
    (epoch N)` at every pass over its 200 documents: the first pass of a launch is said once, in apiary's
    words; each step's record carries the pass (data/epoch), which the summary counts. Other log lines
    from the same call still show, and the logger's filters are as they were afterwards."""
    import logging

    from torchtitan.hf_datasets import text_datasets

    from components.data.text import Passes, RankBlocks
    from framework import contracts
    from framework.report import summary

    def fake_reloop(self):  # what torchtitan's reloop logs, and a line the user should see
        self._epoch += 1
        logging.getLogger().warning(f"Dataset apiary_local_123_train_0.1 is being re-looped (epoch {self._epoch})")
        logging.getLogger().warning("something the user should see")

    monkeypatch.setattr(text_datasets.HuggingFaceTextDataset, "reloop", fake_reloop)
    ds = Passes.__new__(Passes)
    ds._epoch = 0  # what torchtitan's __init__ sets
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root, keep = logging.getLogger(), Keep()
    filters = list(root.filters)
    root.addHandler(keep)
    try:
        for _ in range(3):
            ds.reloop()
    finally:
        root.removeHandler(keep)
    assert not any("re-looped" in m for m in seen) and seen.count("something the user should see") == 3, seen
    assert root.filters == filters
    out = capsys.readouterr().out
    assert out.count("the training data ran out") == 1 and "(pass 2)" in out, out
    blocks = RankBlocks(ds, 0, 1, 1)
    assert isinstance(blocks, contracts.DataStepMetrics) and blocks.step_metrics(7) == {"data/epoch": 3}
    s = {"step": 9, "total_steps": 9, "launches": 1, "wall_time_s": None, "tokens": 10, "data_passes": 4,
         "tokens_per_s_mean": None, "tokens_per_s_missing_because": "one logged step", "device": "cpu",
         "mfu_pct_mean": None, "peak_tflops_per_gpu": None, "mfu_missing_because": "no known peak for cpu",
         "peak_mem_bytes": None, "loss_first": None, "val_loss_last": None, "checkpoint": None}
    assert ("data", "4 passes over the training data (it ran out and was reshuffled 3 times)") in summary.lines(s)


def _example_generator():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("rl_generator", ROOT / "examples" / "rl_loop" / "generator.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_the_example_generator_drops_transformers_cache_rename_notes_only(tmp_path, capfd):
    """examples/rl_loop/generator.py printed transformers 5's FutureWarning "`past_key_values` is deprecated
    ... Use `cache` instead", its `[transformers]` log line about the rename, and a "Loading weights" bar
    at every published version: dropped around the generator's own calls; other warnings still show,
    and the filters and the bar's setting are as they were afterwards."""
    import logging
    from types import SimpleNamespace

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    gen = _example_generator()
    generic = logging.getLogger("transformers.utils.generic")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def model(input_ids, past_key_values=None, use_cache=True):  # what transformers 5's forward says, and more
        warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                      "`Qwen3MoeForCausalLM.forward`. Use `cache` instead.", FutureWarning, stacklevel=2)
        warnings.warn("a transformers warning the user should see", FutureWarning, stacklevel=2)
        generic.warning("`past_key_values`/`cache_params` are deprecated. Use `cache` instead.")
        generic.warning("a log line the user should see")
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 5), past_key_values=None)

    keep, filters = Keep(), list(generic.filters)
    generic.addHandler(keep)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ids = gen.sample_group(model, [1, 2], group=2, new_tokens=2, temperature=1.0,
                                   gen=torch.Generator().manual_seed(0))
    finally:
        generic.removeHandler(keep)
    assert ids.shape == (2, 4)
    messages = [str(w.message) for w in caught]
    assert not any("`past_key_values` is deprecated" in m for m in messages), messages
    assert messages.count("a transformers warning the user should see") == 2, messages
    assert seen == ["a log line the user should see"] * 2, seen
    assert generic.filters == filters
    # a real load: no bar, the setting as it was
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(tmp_path / "m")
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    loaded, version = gen.load(tmp_path / "m")
    out, err = capfd.readouterr()
    assert version == -1 and "Loading weights" not in out + err, err
    assert hf_logging.is_progress_bar_enabled()


def test_logprobs_adapter_merge_shows_no_transformers_bars(tmp_path, monkeypatch, capfd):
    """`apiary logprobs BASE ROLLOUTS --adapter DIR` printed transformers' "Loading weights" and "Writing
    model shards" bars from apiary's own from_pretrained / save_pretrained: off around those calls, the
    setting as it was afterwards."""
    pytest.importorskip("peft")
    import peft
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    from components.adapters import export
    from toolkit import logprobs

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lora = peft.get_peft_model(Qwen3ForCausalLM(cfg), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    monkeypatch.setattr(export, "check_exported_base", lambda *a: None)
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    dest = logprobs.merge_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), tmp_path / "merged")
    out, err = capfd.readouterr()
    assert (dest / "config.json").is_file()
    assert "Loading weights" not in out + err and "Writing model shards" not in out + err, err
    assert hf_logging.is_progress_bar_enabled()
