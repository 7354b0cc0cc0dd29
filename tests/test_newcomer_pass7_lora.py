"""What the seventh newcomer pass found in LoRA and publication (2026-11-29), each pinned here:

- #1 `apiary export RUN --hf OUT` of a llama3 LoRA run crashed in torchtitan's q/k permutation (the
  row map's [n, 1] marker tensors were reshaped with the model's width); the PEFT export must now
  give the run's logits on the transformers base, the row permutation of wq/wk carried into lora_B;
- #2 the same run with `publish.interval` crashed at its initial publication (same code path); each
  published version must be the export of its step;
- #3 docs/skills/publish.md: a run training the routing bias "publishes without it and warns once";
  the warning was spent on step 0's publication (bias still zero) and never said: it now comes once,
  at the first version whose bias has moved.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from framework import devices

devices.install()  # before torchtitan is imported (CPU shims), as the trainer does

from test_lora import _apiary_logits  # noqa: E402  (the run's model with and without its adapters)

from conftest import ROOT, _child_env, train_here  # noqa: E402

LLAMA = {"name": "llama_tiny", "cls": "llama", "config": dict(  # untied head: lm_head is a target too
    vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, rope_theta=1e4, max_position_embeddings=512)}
TIED = {"name": "llama_tied", "cls": "llama", "config": {**LLAMA["config"], "tie_word_embeddings": True}}
TARGETS = "[q,k,v,o,mlp,lm_head]"


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A tiny transformers Llama folder (and one with its head tied to the embeddings) and a 4-step
    adapter=lora run on the first (model.family=llama3, flavor debugmodel, publish.interval=2), trained
    through the console entry in this process."""
    work = tmp_path_factory.mktemp("pass7_lora")
    (work / "specs.json").write_text(json.dumps([LLAMA, TIED]))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "hf_reference.py"), str(work), str(work / "specs.json")],
                       capture_output=True, text=True, timeout=600, env=_child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    base, run = work / "llama_tiny", work / "runs" / "ld"
    got = train_here(["train", "adapter=lora", f"model.hf_checkpoint={base}", "model.family=llama3",
                      "model.flavor=debugmodel", f"adapter.targets={TARGETS}", "adapter.rank=4", "optimizer.lr=1e-2",
                      "training.steps=4", "training.seq_len=32", "training.local_batch=2", "publish.interval=2",
                      "logging.tensorboard=false", f"output_dir={run}"], cwd=work)
    assert got.returncode == 0, (got.stdout[-2000:], got.stderr[-3000:])
    return {"work": work, "base": base, "run": run, "out": got.stdout, "tied": work / "llama_tied"}


def _run_cfg(run: Path):
    from omegaconf import OmegaConf

    from framework.compose import registry

    cfg = OmegaConf.load(run / "config.yaml")
    return cfg, registry.resolve("model", cfg.model.family)


def test_the_row_map_moves_llama3_rows_as_its_hf_conversion_moves_the_weights(llama_run):
    """#1 at its root: for every HF linear of a llama3 model, each row the map names is the torchtitan
    row that the family's own to_hf puts there (on random weights), wq's and wk's permuted, every HF
    row fed exactly once."""
    from components.adapters import export

    cfg, fam = _run_cfg(llama_run["run"])
    config = export._family_config(fam, cfg)
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in export._meta(config).state_dict().items()}
    hf = fam.STATE_DICT_ADAPTER(config, None).to_hf({k: v.clone() for k, v in sd.items()})
    rmap = export.row_map(fam, config, sd)
    linears = {k[: -len(".weight")] for k, v in hf.items() if v.dim() == 2 and "embed_tokens" not in k}
    assert set(rmap) == linears
    for module, parts in rmap.items():
        w = hf[module + ".weight"]
        assert sorted(torch.cat([dst for _, _, dst in parts]).tolist()) == list(range(w.shape[0])), module
        for k, src, dst in parts:
            assert torch.equal(w[dst], sd[k][src]), (module, k)
    wq = rmap["model.layers.0.self_attn.q_proj"]
    assert [k for k, _, _ in wq] == ["layers.0.attention.qkv_linear.wq.weight"]
    assert not torch.equal(wq[0][1], wq[0][2])  # llama3's q rows really are permuted (not the identity)


PEFT_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, transformers
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    base, peft_dir, merged, naive, tokens, out = sys.argv[1:7]
    C, tokens, got = transformers.LlamaForCausalLM, torch.load(tokens), {}
    with torch.no_grad():
        for name, adapter in (("peft", peft_dir), ("naive", naive)):
            pm = PeftModel.from_pretrained(C.from_pretrained(base, dtype=torch.float32), adapter).eval()
            got[name] = pm(tokens).logits
            if name == "peft":
                want = set(get_peft_model_state_dict(pm, save_embedding_layers=False))
                have = set(load_file(adapter + "/adapter_model.safetensors"))
                got["missing"], got["unexpected"] = sorted(want - have), sorted(have - want)
        got["merged"] = C.from_pretrained(merged, dtype=torch.float32).eval()(tokens).logits
    torch.save(got, out)
""")


def test_the_peft_export_of_a_llama3_run_gives_the_runs_logits(llama_run, capsys):
    """#1: `apiary export RUN --hf OUT` of the llama3 run (was: exit 1 in torchtitan's _permute), loaded
    by peft onto the transformers base, gives apiary's logits and the `--merged` export's; the same
    adapters with wq/wk's lora_B left in torchtitan's row order give other logits (the permutation
    is what is tested), and peft finds every key it expects and nothing else."""
    from safetensors.torch import load_file, save_file

    from components.adapters import export
    from components.models import hf_export
    from toolkit.cli import apiary_main

    work, run, base = llama_run["work"], llama_run["run"], llama_run["base"]
    peft_dir, merged, naive = work / "ld_peft", work / "ld_merged", work / "ld_naive"
    assert apiary_main(["export", str(run), "--hf", str(peft_dir)]) == 0
    assert apiary_main(["export", str(run), "--hf", str(merged), "--merged"]) == 0
    assert "PEFT LoRA adapter (rank 4, alpha 32)" in capsys.readouterr().out
    body = json.loads((peft_dir / "adapter_config.json").read_text())
    assert body["target_modules"] == ["lm_head", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                      "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    # the same adapters with q/k's lora_B as trained, rows in torchtitan's (unpermuted) order
    cfg, fam = _run_cfg(run)
    adapters = export.load_adapters(fam, cfg, hf_export.latest_step(run))
    shutil.copytree(peft_dir, naive)
    tensors = load_file(naive / "adapter_model.safetensors")
    for layer in range(2):
        for hf_name, tt in (("q_proj", "wq"), ("k_proj", "wk")):
            key = f"{export.PEFT_PREFIX}model.layers.{layer}.self_attn.{hf_name}.lora_B.weight"
            raw = adapters[f"layers.{layer}.attention.qkv_linear.{tt}.lora_B"]
            assert tensors[key].shape == raw.shape and not torch.equal(tensors[key], raw)
            tensors[key] = raw.contiguous()
    save_file(tensors, str(naive / "adapter_model.safetensors"), metadata={"format": "pt"})

    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(4))
    torch.save(tokens, work / "tokens.pt")
    on, off = _apiary_logits(run, tokens)
    p = subprocess.run([sys.executable, "-c", PEFT_SCRIPT, str(base), str(peft_dir), str(merged), str(naive),
                        str(work / "tokens.pt"), str(work / "hf_logits.pt")],
                       capture_output=True, text=True, timeout=600, cwd=work, env=_child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(work / "hf_logits.pt")
    assert got["missing"] == [] and got["unexpected"] == []
    assert (on - off).abs().max() > 0.1  # the adapters matter
    diffs = {k: (got[k] - on).abs().max().item() for k in ("peft", "merged", "naive")}
    print(f"llama3 LoRA: max |logits| difference from apiary's: {diffs}")
    # measured (2 cores, fp32): PEFT ~2e-6, merged ~3e-6; q/k's rows left unpermuted: ~1 (a wrong row order shows)
    assert diffs["peft"] < 2e-4 and diffs["merged"] < 2e-4, diffs
    assert diffs["naive"] > 1e-2, diffs
    assert (got["peft"] - got["merged"]).abs().max() < 2e-4


def test_a_llama3_lora_run_publishes_its_adapters_as_the_export(llama_run):
    """#2: publish.interval=2 on the llama3 LoRA run (was: a crash at the initial publication): versions
    0, 2 and 4, each the adapters alone in PEFT's format; the last equals `apiary export` of step 4 bitwise
    (tensors and adapter_config.json), the first holds B = 0."""
    from safetensors.torch import load_file

    from framework.train import published
    from toolkit.cli import apiary_main

    work, run = llama_run["work"], llama_run["run"]
    assert "published adapters step-0" in llama_run["out"] and "published adapters step-4" in llama_run["out"]
    weights = run / "weights"
    assert published.versions(weights) == [0, 2, 4]
    last = published.read_latest(weights)
    assert last.name == "step-4"
    assert sorted(f.name for f in last.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                      published.VERSION_FILE]
    exported = work / "ld_publish_ref"
    assert apiary_main(["export", str(run), "--hf", str(exported)]) == 0
    mine, ref = load_file(last / "adapter_model.safetensors"), load_file(exported / "adapter_model.safetensors")
    assert sorted(mine) == sorted(ref) and any(".self_attn.q_proj.lora_B." in k for k in ref)
    for k in ref:
        assert mine[k].dtype == ref[k].dtype and torch.equal(mine[k], ref[k]), k
    assert json.loads((last / "adapter_config.json").read_text()) == \
        json.loads((exported / "adapter_config.json").read_text())
    first = load_file(weights / "step-0" / "adapter_model.safetensors")
    assert sorted(first) == sorted(ref) and all(not v.any() for k, v in first.items() if ".lora_B." in k)


def test_lm_head_on_a_tied_head_is_refused_before_launch(llama_run, capsys):
    """Found beside #1: on a base whose head is tied to the embeddings (Llama 3.2 1B/3B, small Qwen3s),
    the lm_head adapter trained, and then the PEFT export, the merged folder and every published version
    left it out silently (torchtitan's to_hf drops a tied lm_head.weight; measured: PEFT's logits 0.43 off
    the trained model's). Refused before launch, naming the tie; an export of such a run names the
    adapters it cannot place rather than dropping them."""
    from framework.cli import train_main

    work = llama_run["work"]
    run = work / "runs" / "tied"
    code = train_main(["adapter=lora", f"model.hf_checkpoint={llama_run['tied']}", "model.family=llama3",
                       "model.flavor=debugmodel", "adapter.targets=[q,lm_head]", f"output_dir={run}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert err.startswith("error apiary:") and "Traceback" not in err
    assert "adapter.targets=lm_head on a model whose lm_head is tied to the token embeddings" in err, err
    assert "tie_word_embeddings" in err and "Drop lm_head from adapter.targets" in err, err
    assert not run.exists()

    from omegaconf import OmegaConf

    from components.adapters import export

    cfg, fam = _run_cfg(llama_run["run"])
    cfg = OmegaConf.merge(cfg, {"model": {"hf_checkpoint": str(llama_run["tied"])}})
    config = export._family_config(fam, cfg)
    assert config.enable_weight_tying
    rmap = export.row_map(fam, config, export._meta(config).state_dict())
    adapters = {"lm_head.lora_A": torch.zeros(4, 64), "lm_head.lora_B": torch.zeros(260, 4),
                "layers.0.attention.qkv_linear.wq.lora_A": torch.zeros(4, 64),
                "layers.0.attention.qkv_linear.wq.lora_B": torch.zeros(64, 4)}
    assert export.unplaced(adapters, rmap) == ["lm_head.weight"]


# ---------------------------------------------------------------- #3 the routing-bias warning


class _NoNames:
    def __init__(self, config, path):
        pass

    def to_hf(self, sd):
        return {}


def test_the_hf_writer_warns_once_at_the_first_state_whose_routing_bias_has_moved(caplog):
    from components.models.hf_export import HFWriter

    writer = HFWriter(config=None, adapter_cls=_NoNames, hf_config={})
    zero = {"layers.1.moe.expert_bias_E": torch.zeros(4), "layers.1.moe.router.gate.weight": torch.ones(4, 2)}
    moved = {**zero, "layers.1.moe.expert_bias_E": torch.tensor([0.0, 1e-3, -1e-3, 0.0])}
    said = []
    with caplog.at_level("WARNING", logger="apiary"):
        for sd in (zero, zero, moved, moved, zero, moved):
            caplog.clear()
            writer(sd)
            said.append(sum("routing bias" in r.getMessage() for r in caplog.records))
    assert said == [0, 0, 1, 0, 0, 0]


def test_a_grpo_run_publishing_its_weights_warns_once_when_the_bias_has_moved(tmp_path):
    """#3 as the user ran it: `train recipe=debug_grpo publish.interval=2 publish.dtype=bfloat16
    training.steps=6` (moe.load_balance_coeff at its default) says the routing-bias warning exactly
    once, after the starting weights' publication (bias zero) and before step 2's (the first whose
    bias has moved)."""
    p = subprocess.run([sys.executable, "-m", "framework.cli", "recipe=debug_grpo", "publish.interval=2",
                        "publish.dtype=bfloat16", "training.steps=6", f"output_dir={tmp_path / 'g'}"],
                       cwd=tmp_path, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    lines = p.stdout.splitlines()
    warned = [i for i, s in enumerate(lines) if "publish: the MoE routing bias" in s]
    assert len(warned) == 1, p.stdout[-3000:]
    at = {v: next(i for i, s in enumerate(lines) if s.startswith(f"published weights step-{v} ")) for v in (0, 2, 6)}
    assert at[0] < warned[0] < at[2] < at[6], p.stdout[-3000:]
