"""The planner knows no component: its modules name no registry name and no component option, and
every component's share of the estimate comes from its own ``plan_terms`` (a user's loss too).

No training and no GPU: the source is read with ``ast``; the estimates resolve recipes (seconds).
"""

import ast
import dataclasses
import re
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from framework.compose import registry
from framework.plan import planner
from framework.plan.planner import parts
from framework.plan.planner.search import candidates
from framework.resolve.resolver import resolve
from toolkit.plan import constraints

ROOT = Path(__file__).resolve().parents[1]
PLANNER = ROOT / "framework" / "plan" / "planner"
QWEN = "qwen35_35b_128k"
# registry names that are also plain words: English in the printed text ("EP 1 all-to-all over
# none"), the dtype of a GPU's peak (Hardware.bf16_dense_flops), the collective of a link's bandwidth
# (Hardware.nvlink_alltoall_bw), the data kind `text` (read_text / write_text). Allowed in text and
# identifiers, never compared or used as a key.
ENGLISH = {"none", "full", "auto", "local", "bf16", "alltoall", "text"}
# the kinds whose components the planner asks (their options are what it must not read)
PLANNED = ("loss", "state", "recompute", "moe_comm", "moe_chunk", "precision")


def _names() -> dict[str, set[str]]:
    data = yaml.safe_load((ROOT / "registry.yaml").read_text())
    return {kind: set(names) for kind, names in data.items()}


def _option_fields() -> set[str]:
    """Every option of the planned kinds' registered components (but ``name``)."""
    out = set()
    for kind in PLANNED:
        for name in _names()[kind]:
            obj = registry.resolve(kind, name)
            opts = getattr(obj, "Options", None)
            if opts is not None and dataclasses.is_dataclass(opts):
                out |= {f.name for f in dataclasses.fields(opts)}
    return out - {"name"}


def _modules():
    files = sorted(PLANNER.glob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "memory.py", "time.py", "estimate.py", "search.py"}
    return [(p, ast.parse(p.read_text())) for p in files]


def _strings(tree):
    """(node, text, where): every string constant and each literal piece of every f-string; where is
    'key' when the string is compared, subscripted or a dict key (code reading a name), else 'text'."""
    keyed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            keyed |= {id(n) for n in [node.left, *node.comparators] if isinstance(n, ast.Constant)}
            for n in node.comparators:
                if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
                    keyed |= {id(e) for e in n.elts}
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            keyed.add(id(node.slice))
        elif isinstance(node, ast.Dict):
            keyed |= {id(k) for k in node.keys if k is not None}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node, node.value, "key" if id(node) in keyed else "text"


def identifiers_naming(tree, words: set[str]):
    """(line, identifier) of every name, attribute, function or class whose _-separated parts
    include one of ``words`` (c.zero1_param_bytes, FUSED_HEAD_LOSSES-like tuples, _fp8)."""
    for node in ast.walk(tree):
        ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
            node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
        if ident and set(ident.lower().strip("_").split("_")) & words:
            yield node.lineno, ident


def test_planner_modules_name_no_component():
    names = set().union(*_names().values())
    words = names - ENGLISH
    found = []
    for path, tree in _modules():
        for node, text, where in _strings(tree):
            if text in names and (where == "key" or text not in ENGLISH):
                found.append(f"{path.name}:{node.lineno} {where} {text!r}")
            for w in words:
                if re.search(rf"(?<![\w.]){re.escape(w)}(?![\w])", text) and text not in names:
                    found.append(f"{path.name}:{node.lineno} text {text[:60]!r} names {w!r}")
        found += [f"{path.name}:{line} identifier {ident}" for line, ident in identifiers_naming(tree, words)]
    assert not found, "\n".join(found)


def test_planner_modules_name_no_layer_kind():
    """Not even softmax attention: every layer kind's terms come from ModelFacts.layer_kinds."""
    from test_framework_names_no_component import LAYER_KINDS, layer_kind_mentions

    words = LAYER_KINDS | {"attention"}
    found = []
    for path, tree in _modules():
        for node, text, _ in _strings(tree):
            found += [f"{path.name}:{node.lineno} {text[:60]!r} names {w!r}" for w in words
                      if re.search(rf"(?<![\w.]){re.escape(w)}(?![\w])", text, re.IGNORECASE)]
        found += [f"{path.name}:{line} identifier {ident}" for line, ident in identifiers_naming(tree, words)]
    assert layer_kind_mentions is not None and not found, "\n".join(found)


def test_planner_modules_read_no_component_option():
    options = _option_fields()
    assert {"num_chunks", "offload", "backend", "scaling"} <= options  # the options the planner used to read
    kinds = set(_names())
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in options:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in options:
                found.append(f"{path.name}:{node.lineno} getattr(..., {node.args[1].value!r})")
        for node, text, _ in _strings(tree):
            for kind in kinds:
                for opt in options:
                    if f"{kind}.{opt}" in text:
                        found.append(f"{path.name}:{node.lineno} {text[:60]!r}")
    assert not found, "\n".join(found)


# ---- components bring their own terms --------------------------------------------------------


@pytest.fixture(scope="module")
def base():
    """Full recompute: one activation plan whatever the loss (auto would choose per loss)."""
    return resolve(QWEN, ["recompute=full"], world_size=32, for_training=False)


def test_every_registered_kind_the_planner_asks_has_plan_terms():
    for kind in ("loss", "state", "recompute", "moe_chunk", "precision"):
        assert parts.names(kind) == registry.names(kind), kind


def test_fused_head_losses_say_so_themselves(base):
    """Every policy loss plans as linear_ce (the fused LM head), because its plan_terms say so."""
    lin = planner.plan(base, loss="linear_ce")
    for loss in ("grpo", "dapo", "gspo", "cispo", "ppo", "sft"):
        p = planner.plan(base, loss=loss)
        assert p.memory_bytes == lin.memory_bytes and p.time_s == lin.time_s, loss
        assert "logits_fp32" not in p.memory_bytes and p.memory_bytes["loss_tile"] > 0


def test_the_fused_heads_buffers_follow_its_options():
    """loss.chunk_tokens, logits_dtype, dw_accum (fwdgrad) and workspace_mb (recompute paths) each
    move the estimate by the bytes they allocate (a knob the planner ignored is a silent setting)."""
    V, dim = 248_320, 2048  # Qwen3.5-35B-A3B's head, TP 1
    def loss_terms(*over):
        r = resolve(QWEN, ["model.n_layers=4", "training.seq_len=32768", "parallel.cp=1", "parallel.ep=1",
                           "parallel.dp_shard=1", "loss=linear_ce", *over], world_size=1, for_training=False)
        p = planner.plan(r)
        return p.memory_bytes["loss_tile"], p.memory_bytes.get("loss_dw_accum", 0)
    assert loss_terms() == (4096 * V * 2, V * dim * 4)
    assert loss_terms("loss.chunk_tokens=1024", "loss.dw_accum=weight") == (1024 * V * 2, V * dim * 2)
    assert loss_terms("loss.logits_dtype=float32") == (4096 * V * 4, V * dim * 4)
    assert loss_terms("loss.backend=mixed", "loss.workspace_mb=512") == (512 * 2**20, 0)


USER_LOSS = '''
from dataclasses import dataclass

from framework.contracts import PlanTerms, Term

GIB = 2**30


class ScaledLoss:
    """A user's loss: planned with a scratch buffer of `scratch_gib` GiB and a slow loss layer."""

    @dataclass
    class Options:
        name: str = "scaled_user_loss"
        scratch_gib: float = 3.0

    NUMERICS = {"": "any"}
    NEEDS_DATA = ("text",)

    @staticmethod
    def check(opts, ctx):
        if opts.scratch_gib < 0:
            raise ValueError("loss.scratch_gib must be >= 0")

    @staticmethod
    def apply(opts, tc, ctx):
        raise NotImplementedError("planned only")

    @staticmethod
    def plan_terms(opts, ctx):
        gib = opts.scratch_gib if opts is not None else ScaledLoss.Options().scratch_gib
        return PlanTerms(memory=[Term("user_scratch", gib, GIB, "loss", f"{gib:g} GiB of scratch")],
                         time_factor={"lm_head": 3.0}, facts={"objective": "scaled_user"})


class NoTerms:
    @dataclass
    class Options:
        name: str = "user_loss_without_terms"
'''


@pytest.fixture
def user_registry(tmp_path, monkeypatch):
    """A user registry file + module beside it; the registry is restored afterwards."""
    (tmp_path / "apiary_test_user_losses.py").write_text(textwrap.dedent(USER_LOSS))
    (tmp_path / "registry.yaml").write_text(
        "loss:\n"
        "  scaled_user_loss:\n    target: apiary_test_user_losses:ScaledLoss\n    doc: a user's loss\n"
        "  user_loss_without_terms:\n    target: apiary_test_user_losses:NoTerms\n    doc: no plan_terms\n")
    monkeypatch.setitem(registry.entries(), "loss", dict(registry.entries()["loss"]))
    monkeypatch.setattr(registry, "_USED", list(registry._USED))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "registry.yaml"


def test_user_loss_plan_terms_change_the_estimate(base, user_registry):
    ce = planner.plan(base, loss="ce")
    r = resolve(QWEN, [f"registry={user_registry}", "loss=scaled_user_loss", "loss.scratch_gib=5", "recompute=full"],
                world_size=32, for_training=False)
    p = planner.plan(r)
    assert p.choices["loss"] == "scaled_user_loss" and not p.warnings
    # the recipe's options reach plan_terms: 5 GiB, in place of ce's logits terms
    assert p.memory_bytes["user_scratch"] == 5 * 2**30
    assert "logits_fp32" not in p.memory_bytes
    assert p.memory_bytes["parameters"] == ce.memory_bytes["parameters"]
    # its time factor replaces ce's on the loss layer only
    c = planner.Constants()
    assert p.time_s["compute_lm_head"] == pytest.approx(ce.time_s["compute_lm_head"] / c.loss_time_factor["ce"] * 3.0)
    assert p.time_s["compute_dense"] == ce.time_s["compute_dense"]
    # asked by name (as --search does), it plans its defaults
    assert planner.plan(base, loss="scaled_user_loss").memory_bytes["user_scratch"] == 3 * 2**30
    # a registered loss without plan_terms is planned as the defaults' loss, with the warning of an unknown name
    q = planner.plan(r, loss="user_loss_without_terms")
    assert q.memory_bytes == ce.memory_bytes
    assert "loss 'user_loss_without_terms' is unknown to the planner; estimated as ce (materialised logits)." \
        in q.warnings


def test_unknown_names_plan_as_the_defaults_with_warnings(base):
    p = planner.plan(base, loss="nope", state="nada", recompute="never", moe_chunk="chunk9")
    ref = planner.plan(base, loss="ce", state="fsdp2", recompute="selective", moe_chunk="none")
    assert p.memory_bytes == ref.memory_bytes and p.time_s == ref.time_s
    assert p.warnings == ["recompute 'never' is unknown to the planner; estimated as selective.",
                          "moe_chunk 'chunk9' is unknown to the planner; estimated as none.",
                          "state 'nada' is unknown to the planner; estimated as fsdp2.",
                          "loss 'nope' is unknown to the planner; estimated as ce (materialised logits)."]


def test_search_varies_the_loss_among_those_with_the_recipes_objective(base):
    names = candidates(base, planner.Constants())
    assert names["loss"] == ["ce", "chunked", "linear_ce"]
    assert names["state"] == registry.names("state") and names["recompute"] == registry.names("recompute")
    rl = resolve("debug_grpo", [], world_size=1, for_training=False)
    assert candidates(rl, planner.Constants())["loss"] == ["grpo"]


def test_plan_constraints_take_their_verdict_from_layout_derive(base):
    assert not any("VIOLATED" in v for v in constraints(base.layout, base.facts, base.cfg).values())
    for dims, bad in ((dict(pp=3, dp_shard=8), "pp"), (dict(ep=3), "ep"), (dict(cp=3, dp_shard=8), "cp"),
                      (dict(dp_shard=4), "dp_shard")):
        rows = constraints(replace(base.layout, **dims), base.facts, base.cfg)
        assert [k for k, v in rows.items() if "VIOLATED" in v] == [bad], dims


def test_components_constants_live_in_the_components_and_calibrate_by_name(base):
    """The planner's Constants hold none of a component's numbers as fields; it gathers every
    registered component's PLAN_CONSTANTS, and calibration by name reaches them as before."""
    from dataclasses import fields

    from components.losses import linear_ce
    from components.models import layer_kinds
    from components.state import zero1

    own = {f.name for f in fields(planner.Constants)}
    for moved in ("zero1_param_bytes", "fsdp2_param_bytes", "loss_time_factor", "ep_overlap", "gdn_chunk",
                  "selective_keep", "saved_activation_factor", "selective_recompute_fraction", "eff_attention"):
        assert moved not in own, moved
    c = planner.Constants()
    assert c.zero1_param_bytes == zero1.PLAN_CONSTANTS["zero1_param_bytes"].value == 2.0
    assert c.gdn_chunk == layer_kinds.PLAN_CONSTANTS["gdn_chunk"].value
    assert c.loss_time_factor == {"ce": 1.65, "chunked": 1.70, "linear_ce": 1.13}  # each loss's entry, merged
    assert planner.Constants.doc("zero1_overlap").startswith("fraction of ZeRO-1")
    assert replace(c, zero1_param_bytes=4.0).zero1_param_bytes == 4.0
    with pytest.raises(TypeError, match="no_such"):
        planner.Constants(no_such=1)
    lin = planner.plan(base, loss="linear_ce")
    slow = planner.plan(base, loss="linear_ce", calibration={"loss_time_factor.linear_ce": 2.5})
    assert slow.time_s["compute_lm_head"] == pytest.approx(lin.time_s["compute_lm_head"] * 2.5 / 1.13)
    assert linear_ce.PLAN_CONSTANTS["loss_time_factor"].value == {"linear_ce": 1.13}  # the default is not changed
    z = planner.plan(base, state="zero1")
    z4 = planner.plan(base, state="zero1", calibration={"zero1_param_bytes": 4})
    assert z4.memory_bytes["parameters"] == 2 * z.memory_bytes["parameters"]
    with pytest.raises(planner.UserError, match="unknown planner constant.*zero1_param_bytes"):
        planner.plan(base, calibration={"zero1_param_byte": 4})


def test_selective_reruns_each_mixer_kinds_partial_rerun_of_its_own_part():
    """recompute=selective reruns what each mixer kind declares (LayerTerms.partial_rerun): the GatedDeltaNet
    kernels (off torchtitan's save list) as full recompute does, none of attention's (flex/SDPA saved)."""
    plans = {r: planner.plan(resolve(QWEN, ["training.seq_len=32768", f"recompute={r}"], world_size=32,
                                     for_training=False)) for r in ("none", "selective", "full")}
    t = {r: p.time_s for r, p in plans.items()}
    assert t["selective"]["compute_linear_attention"] == pytest.approx(t["full"]["compute_linear_attention"])
    assert t["none"]["compute_linear_attention"] < t["selective"]["compute_linear_attention"]
    assert t["selective"]["compute_attention"] == pytest.approx(t["none"]["compute_attention"])
    assert t["selective"]["compute_attention"] < t["full"]["compute_attention"]
