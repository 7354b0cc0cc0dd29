"""recompute=auto: the planner's per-block choice for a memory budget, and what the trainer runs.

The choice is the last candidate (fewest recomputed blocks) whose planned total fits the budget less
the margin, the next one does not; nothing kept when nothing fits, everything kept when all fits;
without a GPU or a budget every block is recomputed (today's default). The blocks the choice keeps
are left unwrapped and the others wrapped; the losses equal full recompute's bit for bit."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from components.recompute.policies import MARGIN
from framework import devices
from framework.errors import UserError
from framework.plan import planner, preflight
from framework.plan.planner.constants import Constants, GiB
from framework.plan.planner.estimate import Asked, ask_components, choices, run_constants, shapes_and_context, stage_memory
from framework.resolve.resolver import resolve

BIG = ["model.n_layers=4", "training.seq_len=32768", "training.local_batch=1", "parallel.cp=1", "parallel.ep=1",
       "parallel.dp_shard=1", "parallel.gpus=1", "data.name=packaged", "data.tokenizer=byte", "recompute=auto"]


def _here():
    """The calibration recompute=auto's budget plans with on this machine: a CPU run counts no CUDA context
    or NCCL (framework.plan.preflight.NO_GPU_RESERVE)."""
    return None if devices.has_accelerator() else preflight.NO_GPU_RESERVE


def _chain_totals(r, gpu_bytes: int, run_here: bool = False):
    """Every candidate's planned total, as the planner computes it (with the constants of the run's
    allocator and MoE combine settings, framework.plan.planner.estimate.run_constants); ``run_here``:
    as a run on this machine plans it (_here)."""
    hw = Constants().gpu("H200")
    ch = choices(r.cfg, loss=None, state=None, recompute=None, moe_chunk=None)
    base = Constants().calibrated(_here()) if run_here and _here() else Constants()
    c = run_constants(r, base, ch, hw)
    sh, pc = shapes_and_context(r, c, hw)
    asked = ask_components(r, ch, pc, [])
    cands = asked.terms["recompute"].facts.candidates
    out = []
    for cand in cands:
        trial = Asked(names=asked.names, terms={**asked.terms, "recompute": cand})
        out.append((cand.facts.blocks, sum(x.bytes for x in stage_memory(r, sh, trial, pc, [])[1])))
    return out


@pytest.fixture(autouse=True)
def _no_rank_environment(monkeypatch):
    """As from a fresh shell, before and after each test: an in-process training leaves RANK,
    WORLD_SIZE, ... behind, which would make a later resolve lay a recipe out for one rank."""
    from conftest import _RANK_ENV

    for k in _RANK_ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    for k in _RANK_ENV:  # what the test's trainings set (monkeypatch then restores what was there)
        os.environ.pop(k, None)


@pytest.fixture(scope="module")
def big():
    return resolve("qwen35_35b_128k", BIG, for_training=False)


def test_candidates_grow_in_memory_and_end_with_every_block_kept(big):
    totals = _chain_totals(big, 141 * 10**9)
    assert len(totals) >= 4
    mem = [t for _, t in totals]
    assert mem == sorted(mem) and mem[0] < mem[-1]
    first, last = totals[0][0], totals[-1][0]
    assert all(v["recomputed"] == sum(v.values()) for v in first.values())
    assert all(v["kept"] == sum(v.values()) for v in last.values())


@pytest.mark.parametrize("budget_gib", [60.0, 118.0, 128.0, 400.0])
def test_choice_is_the_last_candidate_that_fits(big, budget_gib):
    totals = _chain_totals(big, int(budget_gib * GiB))
    p = planner.plan(big, gpu="H200", gpu_memory_bytes=int(budget_gib * GiB))
    allowed = budget_gib * GiB * (1 - MARGIN)
    fitting = [i for i, (_, t) in enumerate(totals) if t <= allowed]
    want = fitting[-1] if fitting else 0
    assert p.choices["recompute_blocks"] == totals[want][0]
    if not fitting:  # nothing fits: every block recomputed, said
        assert any("no per-block choice fits" in w for w in p.warnings)
    if want + 1 < len(totals):
        assert totals[want + 1][1] > allowed or not fitting
    if budget_gib == 400.0:  # everything fits: every block kept
        assert all(v["kept"] == sum(v.values()) for v in p.choices["recompute_blocks"].values())


def test_choice_spends_memory_where_recompute_costs_most(big):
    """At 32K the attention block (quadratic) is kept before any GatedDeltaNet block."""
    totals = _chain_totals(big, 141 * 10**9)
    first_kept = next(b for b, _ in totals if any(v["kept"] for v in b.values()))
    assert first_kept["attention"]["kept"] == 1 and first_kept["linear_attention"]["kept"] == 0


def test_the_margin_is_what_the_choice_leaves_free(big):
    tight = resolve("qwen35_35b_128k", BIG + ["recompute.margin=0.2"], for_training=False)
    loose = planner.plan(big, gpu="H200")
    p = planner.plan(tight, gpu="H200")
    assert p.total_bytes <= p.gpu_memory_bytes * 0.8 and not p.warnings
    assert p.total_bytes < loose.total_bytes


def test_no_gpu_and_no_budget_recomputes_every_block(tmp_path):
    r = resolve("qwen35_debug_moe", ["recompute=auto", f"output_dir={tmp_path}/run"], for_training=True)
    d = r.ctx.derived["recompute"]
    assert d["blocks"] is None and "no GPU known" in d["reason"]
    from torchtitan.distributed.activation_checkpoint import FullAC

    from components.recompute.per_block import per_block_config

    assert isinstance(per_block_config(d["blocks"], r.facts.layer_mixers, r.facts.n_layers), FullAC.Config)


@pytest.mark.parametrize("argv, needle", [
    (["recompute.margin=0.7"], "recompute.margin must be in [0, 0.5)"),
    (["recompute.budget_gib=-1"], "recompute.budget_gib must be > 0"),
])
def test_bad_options_are_refused(argv, needle):
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        resolve("qwen35_debug_moe", ["recompute=auto", *argv], for_training=False)


def test_pipeline_stages_are_refused():
    with pytest.raises(UserError, match="one pipeline stage"):
        resolve("debug_moe", ["recompute=auto", "parallel.pp=2", "parallel.gpus=2", "model.n_layers=4",
                              "training.local_batch=4"], for_training=False)


def test_per_layer_policies_follow_the_counts_by_mixer():
    from components.recompute.placement import per_layer

    mixers = ("linear_attention", "linear_attention", "linear_attention", "attention") * 2
    blocks = {"attention": {"kept": 1, "partial": 0, "recomputed": 1},
              "linear_attention": {"kept": 2, "ffn_rerun": 1, "partial": 1, "recomputed": 2}}
    # kept blocks last in the stage (backward reruns them first), then the FFN-only reruns
    assert per_layer(blocks, mixers, 8) == ["full", "full", "selective", "full",
                                            "ffn", "none", "none", "none"]
    assert per_layer(None, (), 3) == ["full"] * 3


def _train(tmp_path, name, extra):
    from framework.cli import train_main

    out = tmp_path / name
    steps = [] if any(a.startswith("training.steps=") for a in extra) else ["training.steps=3"]  # each key once
    code = train_main(["recipe=qwen35_debug_moe", *steps, "checkpoint.enable=false", "training.seed=3",
                       f"output_dir={out}", *extra])
    assert code == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return out, [r["loss"] for r in recs if "loss" in r]


def test_auto_runs_its_mix_as_chosen_and_matches_full_recompute_bitwise(tmp_path, one_thread, monkeypatch):
    """A budget that keeps some blocks and recomputes others: the blocks are wrapped as chosen and
    layout.json records the choice. Recompute reruns the same ops, and every block is wrapped (kept
    ones without a checkpoint), so the initial weights and the losses equal recompute=full's exactly."""
    auto = _auto_mix(tmp_path, monkeypatch)
    _, full = _train(tmp_path, "full", ["recompute=full"])
    assert len(auto) == 3 and auto == full, (auto, full)


def _auto_mix(tmp_path, monkeypatch):
    """A budget that keeps some blocks and recomputes others: the blocks are wrapped as chosen, and
    returns the run's losses."""
    from components.recompute import per_block

    wrapped, layers = {}, {}
    real = per_block.PerBlockAC.apply

    def spy(self, model):
        real(self, model)
        wrapped.update({n: type(m).__name__ for n, m in model.get_submodule("layers").named_children()})
        layers.update(dict(model.get_submodule("layers").named_children()))

    monkeypatch.setattr(per_block.PerBlockAC, "apply", spy)
    r = resolve("qwen35_debug_moe", ["recompute=auto"], for_training=False)
    totals = _chain_totals(r, 0, run_here=True)
    i = next(k for k, (b, t) in enumerate(totals)  # a block kept, one rerunning its FFN alone, others full
             if b["attention"]["kept"] and b["linear_attention"]["ffn_rerun"] and b["linear_attention"]["recomputed"]
             and totals[k + 1][1] > t)
    budget = f"recompute.budget_gib={(totals[i][1] + totals[i + 1][1]) / 2 / (1 - MARGIN) / GiB:.6f}"  # between two
    r = resolve("qwen35_debug_moe", ["recompute=auto", budget], for_training=False)
    p = planner.plan(r, gpu="H100", gpu_memory_bytes=int(float(budget.split("=")[1]) * GiB), calibration=_here())
    blocks = p.choices["recompute_blocks"]
    kept = sum(v["kept"] for v in blocks.values())
    assert blocks == totals[i][0] and 0 < kept < r.facts.n_layers, blocks  # a mix
    out, auto = _train(tmp_path, "auto", ["recompute=auto", budget])
    derived = json.loads((out / "layout.json").read_text())["derived"]["recompute"]
    assert derived["blocks"] == blocks
    assert len(wrapped) == r.facts.n_layers and all("Checkpoint" in t for t in wrapped.values()), wrapped
    from components.recompute.per_block import Rerun

    def switch(m):  # a kept or FFN-rerun block's switchable checkpoint_fn (None: a checkpointed block)
        fn = getattr(m.checkpoint_fn, "func", None)
        return fn if isinstance(fn, Rerun) else None

    plain = [n for n, m in layers.items() if switch(m) is not None and not switch(m).rerun]
    ffn_only = [n for n in plain if switch(layers[n]._checkpoint_wrapped_module.moe).rerun]
    assert len(plain) == kept + blocks["linear_attention"]["ffn_rerun"], (plain, blocks)
    assert len(ffn_only) == blocks["linear_attention"]["ffn_rerun"] == 1, (ffn_only, blocks)
    return auto


def test_planner_counts_kept_blocks_with_the_fitted_factor(big):
    """recompute=none plans the measured saves of each kept block (layer_kinds' saved_activation_factor)
    over full recompute's peak: against the measured 107.0 GiB at 32K (one H200, 2026-11-28: lean MoE
    combine, expandable segments) it is within 4%, high."""
    p = planner.plan(replace(big), gpu="H200", recompute="none")
    assert 0 <= (p.torch_reserved_bytes / GiB - 107.0) / 107.0 < 0.04
    c = replace(Constants(), saved_activation_factor=1.0)
    low = planner.plan(big, gpu="H200", recompute="none", constants=c)
    assert low.torch_reserved_bytes < p.torch_reserved_bytes * 0.95


# ----------------------------------------------------------------------------- the recipes' default
LONG_CONTEXT = ("qwen3_30b_a3b_64k", "llama3_8b_128k", "qwen35_35b_128k", "qwen35_35b_lora_128k",
                "qwen35_122b_256k", "qwen35_397b_256k")


def _config_of(r):
    """The torchtitan activation-checkpoint config the recipe's recompute component hands the trainer."""
    from types import SimpleNamespace

    tc = SimpleNamespace(activation_checkpoint="unset")
    r.ctx.components["recompute"].apply(r.ctx.options["recompute"], tc, r.ctx)
    return tc.activation_checkpoint


def test_the_long_context_recipes_default_to_auto_and_the_debug_ones_to_selective():
    from framework.compose import recipes

    from conftest import ROOT

    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.startswith("_"))
    for name in shipped:
        cfg = recipes.load(name, [])
        want = "auto" if name in LONG_CONTEXT else "selective"
        assert str(cfg.recompute.name) == want, (name, cfg.recompute.name)
        if name in LONG_CONTEXT:
            assert "recompute auto" in str(cfg.description), name


def test_the_recipe_on_h200_chooses_per_block(capsys):
    """`gpu=H200`: the resolve of qwen35_35b_128k chooses per block (the 10 attention blocks kept, the
    last 2 GatedDeltaNet blocks kept, the other 28 fully recomputed), says so on the run's first lines,
    and the trainer gets one policy per block, the kept ones last. (Since 2026-11-28 planned with
    expandable segments and the lean MoE combine: 3 more attention blocks and 2 more GatedDeltaNet
    blocks kept than before; since 2026-11-29 its CP 4 plans the activations' CP overhead: one
    GatedDeltaNet block kept and one rerunning its MoE fewer.)"""
    from components.recompute.per_block import PerBlockAC, per_layer

    r = resolve("qwen35_35b_128k", ["preflight.gpu=H200"], for_training=False)
    assert str(r.cfg.recompute.name) == "auto"
    d = r.ctx.derived["recompute"]
    assert d["blocks"] == {"attention": {"kept": 10, "ffn_rerun": 0, "partial": 0, "recomputed": 0},
                           "linear_attention": {"kept": 2, "ffn_rerun": 0, "partial": 0, "recomputed": 28}}, d
    assert d["reason"].endswith("on H200 (preflight.gpu)") and f"of 140.0 GiB less the {MARGIN:.0%} margin" in d["reason"]
    line = next(x for x in r.data_summary.splitlines() if x.startswith("recompute per block:"))
    assert line.startswith("recompute per block: attention blocks: 10 kept; "
                           "linear_attention blocks: 2 kept, 28 recomputed ("), line
    assert "planned 129.2 GiB (torch reserved 126.7 + CUDA context and NCCL 2.5) of 140.0 GiB" in line
    policies = per_layer(d["blocks"], r.facts.layer_mixers, r.facts.n_layers)
    assert policies.count("none") == 12 and policies.count("ffn") == 0 and policies.count("full") == 28
    assert policies[-4:] == ["full", "none", "none", "none"]  # the kept ones last
    assert policies[:4] == ["full", "full", "full", "none"]  # an attention block kept where it sits
    cfg = _config_of(r)
    assert isinstance(cfg, PerBlockAC.Config) and cfg.policies == policies


def test_the_recipe_without_a_gpu_recomputes_every_block_as_before():
    """No GPU here and no `gpu=`: qwen35_35b_128k recomputes every block, the torchtitan config
    recompute=full gives (what the recipe ran before it chose auto)."""
    r = resolve("qwen35_35b_128k", [], for_training=False)
    d = r.ctx.derived["recompute"]
    assert d["blocks"] is None and "no GPU known" in d["reason"]
    assert "recompute per block: every block recomputed (no GPU known here" in r.data_summary
    full = resolve("qwen35_35b_128k", ["recompute=full"], for_training=False)
    assert "recompute per block" not in full.data_summary
    from torchtitan.distributed.activation_checkpoint import FullAC

    assert isinstance(_config_of(r), FullAC.Config) and _config_of(r) == _config_of(full)


def test_train_cfg_job_prints_the_recipes_auto(capsys):
    from framework.cli import train_main

    assert train_main(["recipe=qwen35_35b_128k", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert f"recompute:\n  name: auto\n  margin: {MARGIN}\n  budget_gib: null\n" in out


@pytest.mark.parametrize("recipe", LONG_CONTEXT)
def test_every_long_context_recipe_fits_an_h200_with_its_choice(recipe):
    """On the GPU they are laid out for (141 GB) each recipe spends some headroom (a block kept or
    recomputed selectively) and plans under the GPU's memory less the margin; no warning."""
    r = resolve(recipe, ["preflight.gpu=H200"], for_training=False)
    blocks = r.ctx.derived["recompute"]["blocks"]
    assert sum(v["kept"] + v["partial"] for v in blocks.values()) > 0, blocks
    p = planner.plan(r, gpu="H200")
    assert p.choices["recompute_blocks"] == blocks and not p.warnings
    assert p.total_bytes <= p.gpu_memory_bytes * (1 - MARGIN)


@pytest.mark.parametrize("recipe", ["qwen35_122b_256k", "qwen35_397b_256k"])
def test_the_256k_recipes_on_an_h100_recompute_every_block(recipe):
    """Nothing fits 80 GB: every block recomputed (the torchtitan config of recompute=full), said.
    (qwen35_122b_256k kept its last block until its CP 8 planned the activations' CP overhead,
    2026-11-29: 74.9 GiB with every block recomputed, above the GPU less the margin.)"""
    from torchtitan.distributed.activation_checkpoint import FullAC

    r = resolve(recipe, ["preflight.gpu=H100", "preflight.memory=off"], for_training=False)
    blocks = r.ctx.derived["recompute"]["blocks"]
    assert all(v["recomputed"] == sum(v.values()) for v in blocks.values()), blocks
    assert "even the least memory does not fit" in r.ctx.derived["recompute"]["reason"]
    assert isinstance(_config_of(r), FullAC.Config)


def test_a_recipe_with_pipeline_stages_names_another_policy():
    """The recipes' auto plans one stage: parallel.pp=2 is refused until recompute is named."""
    with pytest.raises(UserError, match="one pipeline stage"):
        resolve("qwen35_35b_128k", ["parallel.pp=2"], for_training=False)
    r = resolve("qwen35_35b_128k", ["parallel.pp=2", "recompute=full"], for_training=False)
    assert r.layout.pp == 2


def test_lora_trains_an_auto_mix_bitwise_like_full(tmp_path, one_thread):
    """qwen35_35b_lora_128k defaults to auto: with adapters on a frozen base a mix of kept blocks,
    blocks rerunning their FFN alone and fully recomputed blocks trains like recompute=full, bit for
    bit on CPU."""
    lora = ["adapter=lora", "moe.load_balance_coeff=null", "training.steps=2"]
    r = resolve("qwen35_debug_moe", ["recompute=auto", *lora], for_training=False)
    totals = _chain_totals(r, 0, run_here=True)
    i = next(k for k, (b, t) in enumerate(totals)
             if b["attention"]["kept"] and b["linear_attention"]["ffn_rerun"] and b["linear_attention"]["recomputed"]
             and totals[k + 1][1] > t)
    budget = f"recompute.budget_gib={(totals[i][1] + totals[i + 1][1]) / 2 / (1 - MARGIN) / GiB:.6f}"
    out, auto = _train(tmp_path, "lora_auto", ["recompute=auto", budget, *lora])
    assert json.loads((out / "layout.json").read_text())["derived"]["recompute"]["blocks"] == totals[i][0]
    _, full = _train(tmp_path, "lora_full", ["recompute=full", *lora])
    assert len(auto) == 2 and auto == full, (auto, full)


# ----------------------------------------------------------------------------- the stage's peak, counted
def test_a_stage_peak_is_the_saves_before_a_rerun_plus_the_rerun():
    """stage_activation_elements against a step-by-step replay of backward: the layers' saves are
    alive until backward passes them, a rerun adds its elements while its layer's backward runs."""
    import random

    from framework.contracts import stage_activation_elements

    def replay(layers):
        alive, peak = sum(s for s, _ in layers), sum(s for s, _ in layers)  # end of forward: every save
        for s, r in reversed(layers):
            peak = max(peak, alive + r)
            alive -= s
        return peak

    rng = random.Random(0)
    for _ in range(200):
        layers = [(rng.choice([1.0, rng.uniform(1, 20)]), rng.choice([0.0, rng.uniform(0, 20)]))
                  for _ in range(rng.randint(1, 12))]
        saved, peak = stage_activation_elements(layers)
        assert saved == pytest.approx(sum(s for s, _ in layers)) and peak == pytest.approx(replay(layers))
    # the last layer kept costs what rerunning it does; keeping the first costs its saves on every rerun
    K, d = 10.0, 1.0
    rerun_all = stage_activation_elements([(d, K - d)] * 4)[1]
    assert stage_activation_elements([(d, K - d)] * 3 + [(K, 0.0)])[1] == rerun_all
    assert stage_activation_elements([(K, 0.0)] + [(d, K - d)] * 3)[1] == rerun_all + K - d


def test_every_block_recomputed_plans_what_full_recompute_does(big):
    """auto's first candidate (every block recomputed) is recompute=full's plan, term for term."""
    full = planner.plan(big, gpu="H200", recompute="full")
    totals = _chain_totals(big, 0)
    assert totals[0][1] == full.total_bytes


def _saved_bytes(policies: list[str]) -> tuple[int, int, int]:
    """Bytes autograd keeps through one forward of the qwen3_5 debug MoE model under PerBlockAC with
    ``policies`` (tensors a checkpoint reruns are not kept), the part of them saved inside the MoE
    layers, and inside the GatedDeltaNet/attention mixers (parameters not counted)."""
    import torch

    from components.models import qwen3_5
    from components.recompute.per_block import PerBlockAC
    from framework import devices

    devices.install()
    cfg = qwen3_5.model_config("debug_moe")
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = {"moe": 0, "attn": 0}
    for block in model.layers.values():
        for part in inside:
            def enter(*_, part=part):
                inside[part] += 1

            def leave(*_, part=part):
                inside[part] -= 1
            getattr(block, part).register_forward_pre_hook(enter)
            getattr(block, part).register_forward_hook(leave)
    PerBlockAC(PerBlockAC.Config(policies=policies)).apply(model)
    seen: dict[int, tuple[int, str]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), next((p for p, n in inside.items() if n > 0), ""))
        return t

    tokens = torch.randint(0, 200, (1, 64))
    pos = torch.arange(64).unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions=pos, attention_masks=model.get_attention_masks(pos))
    return (sum(b for b, _ in seen.values()), sum(b for b, p in seen.values() if p == "moe"),
            sum(b for b, p in seen.values() if p == "attn"))


def test_a_block_rerunning_its_ffn_keeps_the_mixer_saves_and_drops_the_ffn_ones(one_thread):
    """Tensors counted on CPU: "ffn" keeps what the mixer saves (as "none" does) and nothing the MoE
    saves (as "full" does); "none" keeps both; "full" keeps neither (block_saves' three cases)."""
    none, none_moe, none_attn = _saved_bytes(["none"] * 4)
    ffn, ffn_moe, ffn_attn = _saved_bytes(["ffn"] * 4)
    full, full_moe, full_attn = _saved_bytes(["full"] * 4)
    assert none_moe > 0 and none_attn > 0
    assert ffn_moe == 0 and ffn_attn == pytest.approx(none_attn, rel=0.02)  # a shared storage counts once
    assert full_moe == 0 and full_attn == 0
    assert full < ffn < none  # (totals dedupe storages shared across parts, so only their order is exact)


def test_blocks_are_marked_rerun_exactly_when_their_moe_counts_twice(one_thread):
    """torchtitan's expert-bias update halves the token counts of a block marked as rerun
    (checkpoint_impl NO_REENTRANT, components/recompute/per_block.RERUNS_MARK): after one forward and
    backward, the blocks so marked are exactly those whose MoE counted every token twice, so the
    routing bias moves as under recompute=full or none (a kept block halved drifted on the GPU)."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    from components.models import qwen3_5
    from components.recompute.per_block import PerBlockAC
    from framework import devices

    devices.install()
    torch.manual_seed(0)
    model = qwen3_5.model_config("debug_moe").build()
    model.init_states()
    model.train()
    PerBlockAC(PerBlockAC.Config(policies=["none", "ffn", "full", "selective"])).apply(model)
    tokens, pos = torch.randint(0, 200, (1, 64)), torch.arange(64).unsqueeze(0)
    model(tokens, positions=pos, attention_masks=model.get_attention_masks(pos)).float().mean().backward()
    for name, block in model.layers.items():
        moe = block.moe
        counted, per_pass = int(moe.tokens_per_expert_E.sum()), 64 * int(moe.router.top_k)  # one forward
        marked = getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT
        assert counted in (per_pass, 2 * per_pass), (name, counted, per_pass)
        assert marked == (counted == 2 * per_pass), (name, marked, counted, per_pass)
    assert [getattr(b, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT for b in model.layers.values()] \
        == [False, True, True, True]


def test_per_block_refuses_a_block_without_an_ffn():
    """PerBlockAC's "ffn" policy on a block with neither `moe` nor `feed_forward`, and an unknown
    policy, are refused naming the block."""
    import torch

    from components.recompute.per_block import PerBlockAC

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "1": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"block layers\.0 has no FFN child \(moe or feed_forward\)"):
        PerBlockAC(PerBlockAC.Config(policies=["ffn", "none"])).apply(model)
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"unknown policy 'half' for block layers\.0"):
        PerBlockAC(PerBlockAC.Config(policies=["half"])).apply(model)


def test_two_ranks_with_fsdp_and_ep_train_an_auto_mix_bitwise_like_full(tmp_path):
    """Two CPU ranks (FSDP2 over dp_shard=2, experts over EP=2): a mix of a kept block, a block
    rerunning its FFN alone (its MoE, expert-parallel and sharded, inside a checkpoint) and fully
    recomputed blocks trains with the losses of recompute=full, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import read_metrics, run_cli

    ranks = ["parallel.dp_shard=2", "parallel.gpus=2"]
    r = resolve("qwen35_debug_moe", ["recompute=auto", *ranks], world_size=2, for_training=False)
    assert r.layout.ep == 2 and r.layout.dp_shard == 2
    totals = _chain_totals(r, 0, run_here=True)
    i = next(k for k, (b, t) in enumerate(totals)
             if b["attention"]["kept"] and b["linear_attention"]["ffn_rerun"] and b["linear_attention"]["recomputed"]
             and totals[k + 1][1] > t)
    budget = f"recompute.budget_gib={(totals[i][1] + totals[i + 1][1]) / 2 / (1 - MARGIN) / GiB:.6f}"
    common = ["recipe=qwen35_debug_moe", "nproc=2", *ranks, "training.steps=2", "checkpoint.enable=false",
              "training.seed=3", "logging.tensorboard=false"]
    runs = (("auto", ["recompute=auto", budget]), ("full", ["recompute=full"]))
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda x: run_cli(["train", *common, *x[1], f"output_dir={tmp_path / x[0]}"],
                                                cwd=tmp_path, timeout=400, env={"OMP_NUM_THREADS": "1"}), runs))
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    derived = json.loads((tmp_path / "auto" / "layout.json").read_text())["derived"]["recompute"]
    assert derived["blocks"] == totals[i][0]
    losses = {name: [m["loss"] for m in read_metrics(tmp_path / name) if "loss" in m] for name, _ in runs}
    assert len(losses["auto"]) == 2 and losses["auto"] == losses["full"], losses
