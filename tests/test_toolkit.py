"""The tools package: compare's tolerances come from the components' NUMERICS (its own table
names no component), and the `apiary` command lives in toolkit.cli, not on the training path."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from framework.compose import registry
from toolkit.compare import tolerance

from conftest import ROOT, _child_env


def _variant(**groups):
    cfg = SimpleNamespace(training=SimpleNamespace(dtype="float32", local_batch=2, deterministic=True),
                          data=SimpleNamespace(sharding="blocks"),
                          **{k: SimpleNamespace(name=v) for k, v in groups.items()})
    r = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(dp=1, dims={"dp_shard": 1, "ep": 1, "cp": 1, "tp": 1, "pp": 1}),
                        grad_accum=1, facts=SimpleNamespace(num_experts=0))
    return SimpleNamespace(resolved=r)


@pytest.mark.parametrize("kind", sorted(set(tolerance.SELECTED_BY) & set(registry.entries())))
def test_every_component_declares_its_numerics(kind):
    for name in registry.names(kind):
        numerics = registry.resolve(kind, name).NUMERICS
        assert isinstance(numerics, dict) and numerics, (kind, name)
        assert set(numerics.values()) <= set(tolerance.LOOSENESS), (kind, name, numerics)


def test_compare_table_names_no_component_key():
    paths = set(tolerance.SELECTED_BY.values())
    named = [pat for pat, _, _ in tolerance.KEY_KINDS
             if any(pat == p or pat.startswith(p + ".") or p.startswith(pat) and pat.endswith(".") for p in paths)]
    assert named == []


def test_a_user_component_without_numerics_is_a_deliberate_change(tmp_path, monkeypatch):
    """A loss from a user registry file that declares no NUMERICS: compare checks nothing unless told."""
    (tmp_path / "my_loss_mod.py").write_text("class Mine:\n    pass\n")
    reg = tmp_path / "reg.yaml"
    reg.write_text("loss:\n  mine_nonumerics:\n    target: my_loss_mod:Mine\n    doc: test\n")
    monkeypatch.setattr(registry, "_USED", [])
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.entries.cache_clear()
    try:
        registry.use(reg)
        kind, why = tolerance.classify("loss", [_variant(loss="ce"), _variant(loss="mine_nonumerics")], False)
    finally:
        registry.entries.cache_clear()  # the next caller reads registry.yaml afresh
    assert kind == "any" and "mine_nonumerics declares no NUMERICS" in why
    # an option the component does not list takes the kind of switching to another of its kind
    assert tolerance.classify("loss.num_chunks", [_variant(loss="chunked")] * 2, False)[0] == "fp32"
    assert tolerance.classify("moe.chunk", [_variant()] * 2, False) == (
        "exact", "moe.chunk (moe_chunk none): the same arithmetic, rescheduled")


def test_framework_cli_refuses_the_apiary_command():
    p = subprocess.run([sys.executable, "-m", "framework.cli", "apiary", "ls"], cwd=ROOT, env=_child_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "python -m framework.cli apiary" in p.stderr and "python -m toolkit.cli" in p.stderr


def test_show_lists_every_kind_that_binds_a_name(capsys):
    """`auto` is a recompute policy and a moe.chunk policy: `apiary show auto` shows both bindings."""
    from toolkit.cli import apiary_main

    assert apiary_main(["show", "auto"]) == 0
    out = capsys.readouterr().out
    assert "recompute auto:" in out and "components.recompute.policies:AutoRecompute" in out
    assert "moe_chunk auto:" in out


_HF_FOLDERS = r"""
import json, sys
sys.modules["fla"] = None  # transformers' Qwen3.5 without fla's kernels
import transformers
out, counts = sys.argv[1], {}
lin = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
specs = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        vocab_size=333, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, max_position_embeddings=512)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        vocab_size=260, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=512)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, dict(
        vocab_size=503, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, max_position_embeddings=1024, **lin)),
}
for name, (cfg, cls, kw) in specs.items():
    m = cls(cfg(**kw))
    m.save_pretrained(f"{out}/{name}")
    counts[name] = sum(p.numel() for p in m.parameters())
print("COUNTS " + json.dumps(counts))
"""
_SHOW = r"""
import sys
from toolkit.cli import apiary_main
for d in sys.argv[1:]:
    print(f"@@ {d}", flush=True)
    print(f"exit {apiary_main(['show', d])}", flush=True)
print("TORCH", sorted(m for m in ("torch", "torchtitan", "transformers") if m in sys.modules))
"""


def test_show_of_an_hf_folder_counts_its_parameters_without_torch(tmp_path):
    """`apiary show DIR` (was: ~6 s, torch and torchtitan imported to count the folder's parameters on
    a meta model): config.json read with json, the parameters counted from it arithmetically, the
    planner on the folder's own model; in a fresh interpreter torch is never imported, and the count
    printed is transformers' own count of the model it saved (qwen3 MoE, llama with tied embeddings,
    Qwen3.5 MoE)."""
    import json
    import re

    p = subprocess.run([sys.executable, "-c", _HF_FOLDERS, str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env=_child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    counts = json.loads(p.stdout.split("COUNTS ", 1)[1])
    folders = [str(tmp_path / name) for name in counts]
    p = subprocess.run([sys.executable, "-c", _SHOW, *folders], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=_child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "TORCH []", p.stdout[-2000:]
    for name, part in zip(counts, p.stdout.split("@@ ")[1:]):
        text = " ".join(part.split())
        assert text.startswith(f"{tmp_path / name} ") and " exit 0" in text, text
        printed = int(re.search(r"parameters: ([\d,]+) total", text)[1].replace(",", ""))
        assert printed == counts[name], (name, printed, counts[name])
        assert "the folder's model" in text and "on 1 x H100 (the fewest GPUs for its size" in text, text


def test_show_of_an_hf_folder_plans_its_own_model_with_one_compose(tmp_path, monkeypatch):
    """`apiary show DIR`: the folder's ~100K-parameter model is planned on one GPU (not the family's
    30B recipe's 16), at its RoPE length, and the recipe is composed once (it was 13 times, one per
    shipped recipe, to find the family's)."""
    import io
    import json

    import transformers
    from rich.console import Console

    from framework.compose import recipes
    from toolkit import show

    c = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c)).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3"
    loads = []
    monkeypatch.setattr(recipes, "load", lambda *a, _load=recipes.load, **k: loads.append(a) or _load(*a, **k))
    buf = io.StringIO()
    assert show.show_hf(str(tmp_path / "hf"), Console(file=buf, width=400, color_system=None)) == 0
    text = buf.getvalue()
    assert len(loads) == 1, loads
    assert "on 1 x H100 (the fewest GPUs for its size; the recipe's: 16)" in text, text
    assert "seq 2,048" in text and "-> fits" in text
    assert show.gpus_for(30_500_000_000, 16) == 16 and show.gpus_for(1_000_000_000, 16) == 1
    # a small folder's count in thousands, not "(0.000B)" (newcomer pass 3)
    assert "total (106.9K), 106,880 active per token (106.9K)" in text and "0.000B" not in text, text
    assert [show.short_count(n) for n in (34_660_000_000, 3_500_000, 12)] == ["34.66B", "3.5M", "12"]


def test_a_launch_from_an_hf_folder_names_the_folder_not_the_flavor(tmp_path, monkeypatch, capsys):
    """The first line of `train model.hf_checkpoint=DIR` and of `apiary launch ... --dry-run` names the
    folder the architecture comes from (was: the recipe's flavor, `qwen3 tiny_moe`, for a dense folder)."""
    import transformers

    from components.launchers.local import LocalLauncher
    from framework.cli import train_main
    from toolkit.cli import apiary_main

    c = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c)).save_pretrained(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LocalLauncher, "launch", staticmethod(lambda opts, argv, env: 0))  # the line, no training
    assert train_main(["model.hf_checkpoint=hf", "training.seq_len=256"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "qwen3 HF folder hf (0.0M params)" in first and "tiny_moe" not in first, first
    assert apiary_main(["launch", "launcher=slurm", "nodes=1", "gpus_per_node=1", "model.hf_checkpoint=hf",
                        "training.seq_len=256", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "qwen3 HF folder hf (0.0M params)" in err and "tiny_moe" not in err, err


def test_plan_names_one_pipeline_stage_plainly(capsys):
    """pp 1: the memory table's title and the notes say "one pipeline stage" (were: "peak pipeline stage: only",
    "peak stage: only")."""
    from toolkit.cli import apiary_main

    assert apiary_main(["plan", "recipe=qwen35_35b_128k", "gpus=32"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "memory per GPU (one pipeline stage; state fsdp2," in out and "pipeline stage: only" not in out, out[:3000]
    assert "after TP 1; one pipeline stage" in out and "stage: only" not in out, out


def test_export_and_logprobs_of_a_run_launched_elsewhere_name_the_launch_folder(tmp_path, monkeypatch, capsys):
    """A run launched in L with model.hf_checkpoint=hf (relative, as docs/tutorial.md does) keeps `hf` in its
    config.yaml; `apiary export`/`apiary logprobs` of it from another folder say the path is relative to L
    and name L (was: "model.hf_checkpoint=hf: no such folder", the run unmentioned)."""
    launch = tmp_path / "launch"
    run = launch / "runs" / "mine"
    (launch / "hf").mkdir(parents=True)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  family: qwen3\n  flavor: tiny_moe\n  hf_checkpoint: hf\n")
    (tmp_path / "ro.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    monkeypatch.chdir(tmp_path)
    from toolkit.cli import apiary_main

    for argv in (["export", "launch/runs/mine", "--hf", "out"], ["logprobs", "launch/runs/mine", "ro.jsonl", "--out", "o"]):
        assert apiary_main(argv) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "names model.hf_checkpoint=hf, a path relative to the folder the run was launched from" in err, err
        assert f"cd {launch}, the run folder then being runs/mine." in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
