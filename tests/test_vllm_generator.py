"""examples/rl_loop/vllm_generator.py without vLLM: a stand-in ``vllm`` module (an LLM that records the
weight-sync calls and samples deterministic tokens, log-probs and routed experts in vLLM's output
layout) drives the generator's own code against the trainer's real engine link. It answers the
trainer at once (no deadlock with a trainer waiting for rollouts), applies an update between shards,
stamps the next shard with the version the update's finish named, and writes records apiary's
rollout reader accepts, routed experts included. tests/gpu/test_vllm_gpu.py runs the real engine."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from components.data.rollouts import read_rollouts
from components.transport import link as link_mod

from conftest import ROOT

LAYERS, K = 2, 2


class _Logprob:
    def __init__(self, v):
        self.logprob = v


class _Completion:
    def __init__(self, prompt, n_new, seed):
        rng = np.random.default_rng(seed)
        self.token_ids = [int(t) for t in rng.integers(0, 256, n_new)]
        self.logprobs = [{t: _Logprob(-float(rng.random()))} for t in self.token_ids]
        # vLLM: every token but the last, [len(prompt) + n_new - 1, layers, k]
        self.routed_experts = rng.integers(0, 8, (len(prompt) + n_new - 1, LAYERS, K)).astype(np.uint8)


class FakeLLM:
    calls: list = []

    def __init__(self, model, **kw):
        self.kw = kw
        FakeLLM.calls.append(("LLM", kw.get("weight_transfer_config")))
        FakeLLM.made = (model, kw)

    def init_weight_transfer_engine(self, request):
        FakeLLM.calls.append(("init", request["init_info"]))

    def start_weight_update(self):
        FakeLLM.calls.append(("start", None))

    def update_weights(self, request):
        FakeLLM.calls.append(("update", request["update_info"]["names"]))

    def finish_weight_update(self, weight_version=None):
        FakeLLM.calls.append(("finish", weight_version))

    @property
    def llm_engine(self):
        return self

    def add_lora(self, request):
        FakeLLM.calls.append(("add_lora", request.lora_int_id))
        return True

    def remove_lora(self, lora_id):
        FakeLLM.calls.append(("remove_lora", lora_id))
        return True

    def reset_prefix_cache(self):
        FakeLLM.calls.append(("reset", None))

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        FakeLLM.calls.append(("generate", None if lora_request is None else (lora_request.name, lora_request.id,
                                                                               lora_request.path)))
        params = params if isinstance(params, list) else [params] * len(prompts)
        out = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            ids = p["prompt_token_ids"]
            out.append(types.SimpleNamespace(outputs=[_Completion(ids, sp.max_tokens, (sp.seed or 0) * 100 + i * 10 + j)
                                                      for j in range(sp.n)]))
        return out


class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, max_tokens=8, seed=None, **kw):
        self.n, self.temperature, self.max_tokens, self.seed = n, temperature, max_tokens, seed


@pytest.fixture
def generator(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams))
    request = types.SimpleNamespace(LoRARequest=lambda name, i, path: types.SimpleNamespace(name=name, id=i, lora_int_id=i,
                                                                                             path=path))
    monkeypatch.setitem(sys.modules, "vllm.lora", types.SimpleNamespace(request=request))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    FakeLLM.calls = []
    spec = importlib.util.spec_from_file_location("vllm_generator", ROOT / "examples" / "rl_loop" / "vllm_generator.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _first_folder(weights: Path) -> dict:
    d = weights / "step-0"
    d.mkdir(parents=True)
    cfg = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": LAYERS, "vocab_size": 320}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "apiary_version.json").write_text(json.dumps({"version": 0, "step": 0}))
    (weights / "latest").write_text("step-0\n")
    return cfg


def test_generator_links_applies_updates_between_shards_and_writes_readable_records(tmp_path, generator):
    weights, out = tmp_path / "weights", tmp_path / "rollouts"
    cfg = _first_folder(weights)
    link = link_mod.EngineLink(weights, "127.0.0.1:0", cfg, transport="vllm_ipc")
    link.start_accepting(30)  # as the trainer does from its first publication on
    seen = {}

    def trainer():  # the trainer's side; the generator runs in the main thread (it sets a signal handler)
        try:
            seen["hello"] = link.wait_connected()  # answered although the trainer has sent nothing yet
            seen["first"] = link_mod.wait_for(lambda: (out / "000000.jsonl").is_file(), 30)
            # the trainer's first in-memory version, as InMemorySender sends it
            link.init_weight_transfer_engine({"packed": True})
            link.start_weight_update()
            link.update_weights({"names": ["model.embed_tokens.weight"]})
            link.finish_weight_update("1")
            seen["second"] = link_mod.wait_for(lambda: (out / "000001.jsonl").is_file(), 30)
        finally:
            link.close()

    t = threading.Thread(target=trainer)
    t.start()
    rc = generator.main(["--weights", str(weights), "--out", str(out), "--shards", "2", "--prompts", "2", "--group",
                         "3", "--prompt-tokens", "4", "--new-tokens", "5", "--routing", "--patience", "30",
                         "--wait", "30"])
    t.join(30)
    assert rc == 0 and seen["hello"]["hf_config"]["hidden_size"] == 256 and seen["first"] and seen["second"]
    assert [c[0] for c in FakeLLM.calls if c[0] != "generate"] == ["LLM", "init", "start", "update", "finish", "reset"]
    assert FakeLLM.calls[0][1] == {"backend": "ipc"}
    shards = [[json.loads(x) for x in (out / f"00000{i}.jsonl").read_text().splitlines()] for i in (0, 1)]
    assert {r["policy_version"] for r in shards[0]} == {0} and {r["policy_version"] for r in shards[1]} == {1}
    r = shards[0][0]
    assert len(r["input_ids"]) == len(r["loss_mask"]) == len(r["old_logprobs"]) == len(r["routed_experts"]) == 9
    assert r["loss_mask"] == [0] * 4 + [1] * 5 and all(lp <= 0 for lp in r["old_logprobs"])
    batch = read_rollouts(out)  # apiary's reader takes the shards as written, routed experts included
    assert batch["input_ids"].shape[0] == 12 and batch["routed_experts"].shape[-2:] == (LAYERS, K)


def test_generator_refused_by_the_trainer_says_why(tmp_path, generator):
    weights = tmp_path / "weights"
    cfg = _first_folder(weights)
    link = link_mod.EngineLink(weights, "127.0.0.1:0", {**cfg, "hidden_size": 64}, transport="vllm_ipc")
    link.start_accepting(30)
    with pytest.raises(SystemExit, match="the trainer refused this engine: .*hidden_size: trainer 64 != engine 256"):
        generator.main(["--weights", str(weights), "--out", str(tmp_path / "r"), "--shards", "1", "--wait", "30"])
    with pytest.raises(link_mod.EngineError):
        link.wait_connected()
    link.close()


def test_generator_stops_when_the_trainer_closes_the_link(tmp_path, generator):
    """The trainer's run ended (it closed the link) while the generator waited for the next version: the
    generator stops instead of sampling shard after shard with the last weights (seen on an H200: 486
    shards after a 12-step run)."""
    weights, out = tmp_path / "weights", tmp_path / "rollouts"
    cfg = _first_folder(weights)
    link = link_mod.EngineLink(weights, "127.0.0.1:0", cfg, transport="vllm_ipc")
    link.start_accepting(30)

    def trainer():
        try:
            link.wait_connected()
            link_mod.wait_for(lambda: (out / "000000.jsonl").is_file(), 30)
        finally:
            link.close()

    t = threading.Thread(target=trainer)
    t.start()
    rc = generator.main(["--weights", str(weights), "--out", str(out), "--shards", "50", "--prompts", "1", "--group",
                         "2", "--prompt-tokens", "4", "--new-tokens", "3", "--patience", "30", "--wait", "30"])
    t.join(30)
    assert rc == 0
    assert sorted(f.name for f in out.iterdir()) == ["000000.jsonl"]


def _adapter_folder(weights: Path, version: int, base: Path) -> None:
    d = weights / f"step-{version}"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "r": 16,
                                                       "rank_pattern": {"in_proj_qkv": 48}}))
    (d / "apiary_version.json").write_text(json.dumps({"version": version, "step": version}))
    (weights / "latest").write_text(f"step-{version}\n")


def test_generator_loads_a_lora_runs_adapters_as_lora_requests(tmp_path, generator):
    """A LoRA run publishes PEFT folders naming the base: the engine starts on the base with LoRA enabled
    (its max rank rounded up to one vLLM takes), samples with the adapters of the version in use, and
    takes a newer version's adapters between shards under a new LoRA id; no link is made."""
    base, weights, out = tmp_path / "base", tmp_path / "weights", tmp_path / "rollouts"
    _first_folder(base)
    _adapter_folder(weights, 0, base / "step-0")

    def trainer():
        link_mod.wait_for(lambda: (out / "000000.jsonl").is_file(), 30)
        _adapter_folder(weights, 1, base / "step-0")

    t = threading.Thread(target=trainer)
    t.start()
    log = tmp_path / "updates.jsonl"
    rc = generator.main(["--weights", str(weights), "--out", str(out), "--shards", "2", "--prompts", "1", "--group",
                         "2", "--prompt-tokens", "4", "--new-tokens", "3", "--patience", "30", "--wait", "30",
                         "--log", str(log)])
    t.join(30)
    assert rc == 0
    # each adapter load is appended as it lands (version, seconds), so a killed generator keeps the ones before
    updates = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(u["version"], u["adapters"]) for u in updates] == [(0, True), (1, True)]
    assert all(u["paused_s"] >= 0 for u in updates)
    model, kw = FakeLLM.made
    assert model == str(base / "step-0") and kw["enable_lora"] and kw["max_lora_rank"] == 64  # 48 -> vLLM's 64
    assert kw["gdn_prefill_backend"] == "triton"  # no JIT build of flashinfer's GDN kernels at start
    assert FakeLLM.calls[0] == ("LLM", None)  # no weight-transfer engine: adapters arrive as folders
    gens = [c[1] for c in FakeLLM.calls if c[0] == "generate"]
    assert gens == [("step-0", 1, str(weights / "step-0")), ("step-1", 2, str(weights / "step-1"))]
    # each version's adapters are loaded when taken (timed as the update), and the previous ones dropped after
    loads = [c for c in FakeLLM.calls if c[0] in ("add_lora", "remove_lora")]
    assert loads == [("add_lora", 1), ("add_lora", 2), ("remove_lora", 1)]
    versions = [{json.loads(x)["policy_version"] for x in (out / f"00000{i}.jsonl").read_text().splitlines()}
                for i in (0, 1)]
    assert versions == [{0}, {1}]
    assert not (weights / "engine_link.json").exists()
