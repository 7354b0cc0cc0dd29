"""A model family with a new kind of layer, from a user registry file: the planner counts the layer
kind's terms (memory, FLOPs, recompute, CP) through ``ModelFacts.layer_kinds`` and its calibrated
constants through the family's ``PLAN_CONSTANTS``, and nothing in framework/ names it
(docs/architecture.md, "Adding a model family with a new layer kind", is this file's family).

No GPU and no training: recipes are resolved for planning only (seconds).
"""

import textwrap

import pytest

from framework.compose import registry
from framework.errors import UserError
from framework.plan import planner
from framework.resolve.resolver import resolve

# the family module of docs/architecture.md's worked example (test_the_architecture_page_shows_this_family checks
# that the document shows this text)
FAMILY = '''
"""A made-up family: qwen3's sizes, every block a "toy_mixer" (a made-up token mixer) + qwen3's FFN."""

import dataclasses

from components.models import family, layer_kinds, qwen3
from framework.contracts import LayerShape, LayerTerms, PlanConstant, Term

FLAVORS = qwen3.FLAVORS
Options = family.ModelOptions
model_kwargs, check, apply = family.family_contract(__name__)
PLAN_CONSTANTS = {
    **layer_kinds.PLAN_CONSTANTS,  # the FFN kinds' (selective_keep of moe and mlp)
    "toy_mixer_saved": PlanConstant(6.0, "activation elements per token a toy_mixer layer saves, per model dim"),
    "toy_mixer_flops": PlanConstant(64.0, "toy_mixer FLOPs per token, per model dim, fwd + bwd"),
    "toy_mixer_keep": PlanConstant(0.25, "fraction of its saves selective recompute keeps"),
    "eff_toy_mixer": PlanConstant(0.2, "achieved/peak FLOPs of the toy_mixer kernel"),
}


@dataclasses.dataclass(frozen=True)
class ToyMixer:
    layers: int
    dim: int
    name: str = "toy_mixer"

    def plan_terms(self, s: LayerShape) -> LayerTerms:
        c = s.constants
        state = [Term("cp_toy_state", s.micro_batch * s.cp * self.dim, 4.0, "buffers", "one fp32 state per rank")]
        return LayerTerms(name=self.name, role="mixer", layers=self.layers,
                          saved_per_token=c.toy_mixer_saved * self.dim, partial_keep=c.toy_mixer_keep,
                          flops_per_token=c.toy_mixer_flops * self.dim, flops_how="toy_mixer_flops x dim",
                          efficiency=c.eff_toy_mixer, forward_flops_per_token=c.toy_mixer_flops * self.dim / 3,
                          cp_comm_bytes=(s.cp - 1) * s.micro_batch * self.dim * 4,
                          cp_memory=state if s.cp > 1 else [])


def facts(flavor, **kwargs):
    f = qwen3.facts(flavor, **kwargs)
    ffn = [k for k in f.layer_kinds if isinstance(k, (layer_kinds.MoE, layer_kinds.MLP))]
    return dataclasses.replace(f, family="toy", layer_kinds=(ToyMixer(f.n_layers, f.dim), *ffn),
                               layer_mixers=("toy_mixer",) * f.n_layers)


def model_spec(flavor, **kwargs):
    raise NotImplementedError("planned only")
'''


@pytest.fixture
def toy_registry(tmp_path, monkeypatch):
    """The family module and a registry file beside it; the registry is restored afterwards."""
    (tmp_path / "apiary_test_toy_family.py").write_text(textwrap.dedent(FAMILY))
    (tmp_path / "registry.yaml").write_text(
        "model:\n  toy:\n    target: apiary_test_toy_family\n    doc: a made-up layer kind\n    skill: models\n")
    monkeypatch.setitem(registry.entries(), "model", dict(registry.entries()["model"]))
    monkeypatch.setattr(registry, "_USED", list(registry._USED))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "registry.yaml"


def _plan(reg, *over, calibration=None, world_size=1):
    r = resolve("debug_moe", [f"registry={reg}", "model.family=toy", *over], world_size=world_size,
                for_training=False)
    return r, planner.plan(r, calibration=calibration)


def test_the_planner_counts_the_new_kinds_flops(toy_registry):
    r, p = _plan(toy_registry)
    f = r.facts
    assert [k.name for k in f.layer_kinds] == ["toy_mixer", "moe"] and not p.warnings
    assert p.time_s["compute_toy_mixer"] > 0
    assert not any(k.startswith("compute_") and "attention" in k for k in p.time_s)
    # its FLOPs and its efficiency are its own, calibrated by name
    double = _plan(toy_registry, calibration={"toy_mixer_flops": 128.0})[1]
    assert double.time_s["compute_toy_mixer"] == pytest.approx(2 * p.time_s["compute_toy_mixer"])
    assert double.time_s["compute_dense"] == p.time_s["compute_dense"]
    slow = _plan(toy_registry, calibration={"eff_toy_mixer": 0.1})[1]
    assert slow.time_s["compute_toy_mixer"] == pytest.approx(2 * p.time_s["compute_toy_mixer"])
    assert any("toy_mixer" in a and "toy_mixer_flops x dim" in a for a in p.assumptions)


def test_the_planner_counts_the_new_kinds_saved_activations(toy_registry):
    over = ("recompute=selective",)
    r, p = _plan(toy_registry, *over)
    more = _plan(toy_registry, *over, calibration={"toy_mixer_saved": 10.0})[1]
    f, tokens = r.facts, r.cfg.training.local_batch * r.cfg.training.seq_len
    # selective keeps toy_mixer_keep of the 4 x dim more elements per token in every layer, bf16
    extra = tokens * f.n_layers * 4.0 * f.dim * 0.25 * 2
    assert more.memory_bytes["activations"] - p.memory_bytes["activations"] == pytest.approx(extra, abs=2)
    keep_all = _plan(toy_registry, *over, calibration={"toy_mixer_keep": 1.0})[1]
    assert keep_all.memory_bytes["activations"] > p.memory_bytes["activations"]
    # recompute=none keeps every block whole: the saves of both kinds, and no factor (none declared)
    none = _plan(toy_registry, "recompute=none")[1]
    sel_all = _plan(toy_registry, *over, calibration={"toy_mixer_keep": 1.0, "selective_keep.moe": 1.0})[1]
    assert none.memory_bytes["activations"] == sel_all.memory_bytes["activations"]


def test_recompute_auto_and_cp_treat_the_new_kind_as_a_block_mixer(toy_registry):
    r, p = _plan(toy_registry, "recompute=auto", "recompute.budget_gib=0.02")
    blocks = p.choices["recompute_blocks"]
    assert set(blocks) == {"toy_mixer"} and sum(blocks["toy_mixer"].values()) == r.facts.n_layers, blocks
    cp = _plan(toy_registry, "parallel.cp=2", "training.local_batch=1", world_size=2)
    assert cp[1].memory_bytes["cp_toy_state"] == 1 * 2 * cp[0].facts.dim * 4
    assert cp[1].time_s["exposed_cp"] > 0


def test_a_constant_declared_twice_with_another_value_is_refused(toy_registry, tmp_path):
    """Two components declaring one planner constant with different values: one paragraph naming both."""
    (tmp_path / "apiary_test_toy_family2.py").write_text(textwrap.dedent(FAMILY).replace(
        '"toy_mixer_keep": PlanConstant(0.25,', '"toy_mixer_keep": PlanConstant(0.5,'))
    with open(toy_registry, "a") as f:
        f.write("  toy2:\n    target: apiary_test_toy_family2\n    doc: the same constant, another value\n"
                "    skill: models\n")
    with pytest.raises(UserError) as e:
        _plan(toy_registry)
    msg = str(e.value)
    assert "model toy2" in msg and "'toy_mixer_keep'" in msg and "model toy declares too" in msg
    assert "Rename the constant" in msg


def test_the_architecture_page_shows_this_family():
    from conftest import ROOT

    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "## Adding a model family with a new layer kind" in doc
    start = doc.index("# user module: apiary_test_toy_family.py")
    shown = doc[start:doc.index("```", start)]
    assert shown.split("\n", 1)[1].strip() == textwrap.dedent(FAMILY).strip()
