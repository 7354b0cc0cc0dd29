"""Every shipped recipe works as shipped: it plans (`apiary plan recipe=R`), prints (`train recipe=R
--cfg job`) and renders its Slurm launch for its own GPU count (`apiary launch recipe=R
launcher=slurm nodes=N gpus_per_node=8 --dry-run`), with nothing supplied but the documented
tokenizer folder (docs/recipes.md, "Tokenizers"; a stand-in here). A sequence beyond the model's
RoPE length is refused the same way by all three, and qwen3_30b_a3b_64k's YaRN RoPE is the one
Qwen3's model card publishes (transformers' cos/sin)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import _RANK_ENV, ROOT

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("_"))
H200_GIB = 140.0  # the planner's H200 memory: what the GPU recipes are laid out for


@pytest.fixture(autouse=True)
def _no_rank_environment(monkeypatch):
    """As from a fresh shell: an in-process training earlier in the session leaves RANK, WORLD_SIZE, ...
    behind, which would make `train` think torchrun started it."""
    for k in _RANK_ENV:
        monkeypatch.delenv(k, raising=False)


def _recipe(name: str):
    from framework.compose import recipes

    return recipes.load(name, [])


def _run(fn, argv, capsys) -> tuple[int, str, str]:
    code = fn(argv)
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


def _plan(argv):
    from toolkit.cli import apiary_main

    return apiary_main(["plan", *argv])


def _cfg(argv):
    from framework.cli import train_main

    return train_main([*argv, "--cfg", "job"])


def _launch(argv):
    from toolkit.launch import launch_main

    return launch_main(["launcher=slurm", *argv, "--dry-run"])


@pytest.fixture(scope="module")
def tokenizer_standin(tmp_path_factory) -> Path:
    """A loadable HF tokenizer folder (tokenizer.json + tokenizer_config.json, 4 ids) where the GPU
    recipes expect the model's own: what a user puts at data.tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<bos>": 1, "<eos>": 2, "a": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return d


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_plans_prints_and_renders_its_launch(recipe, workdir, capsys, tokenizer_standin):
    cfg = _recipe(recipe)
    gpus = int(cfg.parallel.gpus or 1)  # the debug recipes: one rank
    nodes, per_node = (gpus // 8, 8) if gpus >= 8 else (1, gpus)
    family, flavor = cfg.model.family, cfg.model.flavor

    code, out, err = _run(_plan, [f"recipe={recipe}"], capsys)
    assert code == 0, err
    head = out.splitlines()[0]
    assert head.startswith(f"apiary plan {recipe}: {family} {flavor} ") and f", {gpus if gpus > 1 else 8} x " in head
    total = re.search(r"^total ([\d.]+) GiB .* -> (fits|tight|OOM)", out, re.M)
    assert total, out[-2000:]
    if gpus > 1:  # laid out for H200-class memory (141 GB): the 256K recipes do not fit 80 GB GPUs
        assert float(total.group(1)) <= H200_GIB, (recipe, total.group(0))

    code, out, err = _run(_cfg, [f"recipe={recipe}"], capsys)
    assert code == 0, err
    assert f"flavor: {flavor}\n" in out and f"seq_len: {cfg.training.seq_len}\n" in out
    assert f"# derived layout for {gpus} GPU{'s' if gpus > 1 else ''}:" in out

    tok = [] if cfg.data.tokenizer == "byte" else [f"data.tokenizer={tokenizer_standin}"]
    code, script, err = _run(_launch, [f"recipe={recipe}", f"nodes={nodes}", f"gpus_per_node={per_node}", *tok],
                             capsys)
    assert code == 0, err
    assert f"#SBATCH --nodes={nodes}" in script and f"--nproc-per-node={per_node}" in script
    assert re.search(rf"^TRAIN_ARGS=\(.*recipe={recipe}\b", script, re.M), script[-2000:]
    assert "dry run: nothing submitted" in err  # the script on stdout, the note on stderr
    assert not (workdir / "runs").exists()


def test_gpu_recipes_need_only_the_documented_tokenizer_folder(workdir, capsys):
    """Without the tokenizer folder a launch stops naming data.tokenizer and the fix, while a dry run
    (README's Slurm line) renders the script and warns that the job needs it; the recipe file and
    docs/recipes.md say how to supply it."""
    from toolkit.launch import launch_main

    argv = ["recipe=qwen3_30b_a3b_64k", "nodes=2", "gpus_per_node=8"]
    code, script, err = _run(_launch, argv, capsys)
    assert code == 0 and "#SBATCH --nodes=2" in script, err
    assert ("warning data.tokenizer=./assets/hf/Qwen3-30B-A3B does not exist on this machine; the job needs it "
            "where it runs, or it stops with exit 2 before training. Download the model's tokenizer") in err, err
    code, _, err = _run(launch_main, ["launcher=slurm", *argv], capsys)
    assert code == 2 and "data.tokenizer=./assets/hf/Qwen3-30B-A3B: no tokenizer folder there" in err, err
    assert "Traceback" not in err and not (workdir / "runs").exists()
    for r in RECIPES:
        text = (ROOT / "recipes" / f"{r}.yaml").read_text()
        if "tokenizer: ./assets/" in text:
            assert "data.tokenizer=PATH (docs/recipes.md)" in text, r
    assert "data.tokenizer=PATH" in (ROOT / "docs" / "recipes.md").read_text()


@pytest.mark.parametrize("command", [_cfg, _plan, _launch])
def test_a_sequence_beyond_rope_is_refused_by_print_plan_and_launch_alike(command, workdir, capsys):
    """The RoPE check is a property of the config: --cfg job and plan refuse what a launch refuses."""
    args = ["recipe=qwen3_30b_a3b_64k", "model.flavor=30B-A3B"]
    if command is _launch:
        args += ["nodes=2", "gpus_per_node=8"]
    code, out, err = _run(command, args, capsys)
    assert code == 2, out[-1000:]
    assert ("training.seq_len=65536: exceeds the model's RoPE length 40960 (model.flavor=30B-A3B). Use "
            "training.seq_len <= 40960, or model.flavor=30B-A3B-yarn (RoPE scaling to 131072") in err, err
    assert "Traceback" not in err


def test_qwen3_yarn_flavor_is_the_published_rope_scaling():
    """30B-A3B-yarn: the model card's rope_scaling (yarn, factor 4.0, original 32768), cos/sin equal to
    transformers' Qwen3-MoE rotary embedding (attention factor included) up to position 131071."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    from framework import devices

    devices.install()
    from components.models import qwen3

    config = qwen3.model_config("30B-A3B-yarn")
    rope = config.layers[0].attention.rope
    assert all(layer.attention.rope == rope for layer in config.layers)
    assert (rope.scaling, rope.rope_factor, rope.original_seq_len, rope.max_seq_len) == ("yarn", 4.0, 32768, 131072)
    assert qwen3.facts("30B-A3B-yarn").max_seq_len == 131072 and qwen3.facts("30B-A3B").max_seq_len == 40960
    assert qwen3.facts("30B-A3B-yarn").n_params == qwen3.facts("30B-A3B").n_params  # the same weights

    hf = Qwen3MoeConfig(hidden_size=2048, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
                        rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                             original_max_position_embeddings=32768))
    ref = Qwen3MoeRotaryEmbedding(hf)
    pos = torch.tensor([[0, 1, 7, 1000, 32767, 40960, 65535, 131071]])
    cos, sin = ref(torch.zeros(1, 1, 128), pos)
    cache = rope.build().cache[pos[0]]
    assert abs(ref.attention_scaling - 1.1386294361) < 1e-9  # 0.1 ln 4 + 1
    torch.testing.assert_close(cache[:, :128], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(cache[:, 128:], sin[0], rtol=0, atol=1e-6)
    plain = qwen3.model_config("30B-A3B").layers[0].attention.rope.build().cache[pos[0, :5]]
    assert (cache[:5] - plain).abs().max() > 0.1  # YaRN moves every position, not just the long ones


def test_readmes_qwen3_30b_line_states_todays_plan_on_80gb_gpus():
    """README's qwen3_30b_a3b_64k line said "79 GiB planned per GPU" after the planner had moved to 81.22: the
    number it quotes is `apiary plan recipe=qwen3_30b_a3b_64k gpus=8 gpu=H100`'s total, and, as it says, that
    plan is OOM for `apiary plan` and within the preflight's measured error above (a warning, not a refusal)."""
    from framework.plan import planner, preflight
    from framework.resolve.resolver import resolve
    from toolkit import plan as plan_cli

    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if "recipe=qwen3_30b_a3b_64k" in ln
                and "80 GB" in ln)
    quoted, pct = re.search(r"says ([\d.]+) GiB -> OOM and the preflight warns \(within the planner's (\d+)% ",
                            line).groups()
    # the plan command as the line spells it, copyable: the torchrun line's 8 GPUs (pass 11: `gpu=H100` alone
    # planned the recipe's 16 GPUs, 74.36 GiB -> fits)
    assert "`apiary plan recipe=qwen3_30b_a3b_64k gpus=8 gpu=H100`" in line, line
    r = resolve("qwen3_30b_a3b_64k", [], for_training=False, world_size=8)
    p = planner.plan(r, gpu="H100")
    _, over, _ = preflight.measured_band(r.layout.cp)
    assert quoted == f"{p.total_bytes / 2**30:.2f}" and int(pct) == round(over * 100), (quoted, p.total_bytes)
    assert p.verdict == "OOM" and p.gpu_memory_bytes < p.total_bytes <= p.gpu_memory_bytes * (1 + over)
    assert plan_cli._preflight_note(p, r.layout.cp).startswith("a launch warns, not refuses")
