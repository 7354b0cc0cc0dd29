"""The model families' contract modules size a model without torch: each flavor's architecture
table equals what torchtitan 0.3.0's own config of that flavor holds, and the facts computed from
it (parameters, experts, heads, RoPE length) equal those counted on the model built on the meta
device, with and without the recipe's n_layers / vocab_size overrides. The names a contract module
hands out from its torchtitan side exist there."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest

from components.models import common, llama3, llama3_build, qwen3, qwen3_5, qwen3_5_build, qwen3_build

from conftest import ROOT

# flavors whose meta build takes long (hundreds of layers x 128 experts): architecture checked, facts
# checked on a truncated stack
_LARGE = {"235B-A22B", "235B-A22B-yarn", "405B", "70B", "32B"}


def _meta_facts(family_name: str, flavor: str, config) -> common.ModelFacts:
    return common.facts_from_config(family_name, flavor, config)


@pytest.mark.parametrize("light, build, family_name", [(qwen3, qwen3_build, "qwen3"),
                                                       (llama3, llama3_build, "llama3")], ids=["qwen3", "llama3"])
def test_architecture_table_matches_torchtitan_and_facts_match_the_meta_model(light, build, family_name):
    assert set(light.FLAVORS) == set(build.TT_FLAVORS)
    for flavor in light.FLAVORS:
        config = build.TT_FLAVORS[flavor](attn_backend="flex")
        assert build.arch_from_config(config) == light.FLAVORS[flavor], flavor
        overrides = [dict(n_layers=2), dict(n_layers=3, vocab_size=1000)] if flavor in _LARGE else \
            [{}, dict(n_layers=3, vocab_size=1000)]
        for kw in overrides:
            built = build.model_config(flavor, **kw)
            assert light.facts(flavor, **kw) == _meta_facts(family_name, flavor, built), (flavor, kw)


def test_qwen35_facts_match_the_meta_model():
    """qwen3_5's facts (formulas) against the parameters of the model torchtitan builds."""
    import torch

    for flavor, kw in (("debug_moe", {}), ("debug_dense", {}), ("35B-A3B", dict(n_layers=4)),
                       ("27B", dict(n_layers=4, vocab_size=1024))):
        f = qwen3_5.facts(flavor, **kw)
        config = qwen3_5_build.build_config(qwen3_5.arch_of(flavor, **kw))
        with torch.device("meta"):
            model = qwen3_5_build.Qwen35TextModel(config)
        total = sum(p.numel() for p in model.parameters())
        expert = sum(p.numel() for n, p in model.named_parameters() if ".routed_experts." in n)
        n_attn = sum(1 for layer in config.layers if layer.attention is not None)
        assert (f.n_params, f.n_expert_params, f.n_attention_layers) == (total, expert, n_attn), (flavor, kw)
        assert f.n_linear_attention_layers == f.n_layers - n_attn


@pytest.mark.parametrize("light, build", [(qwen3, qwen3_build), (llama3, llama3_build), (qwen3_5, qwen3_5_build)],
                         ids=["qwen3", "llama3", "qwen3_5"])
def test_build_names_resolve_to_the_torchtitan_side(light, build):
    for name in light.BUILD_NAMES:
        assert getattr(light, name) is getattr(build, name), name
    with pytest.raises(AttributeError):
        light.no_such_name  # noqa: B018
    # every contract member is the light module's own (no torchtitan import to answer them)
    for member in ("FLAVORS", "facts", "model_kwargs", "check", "apply", "model_spec", "hf_writer", "Options",
                   "NUMERICS", "HF_MODEL_TYPES"):
        assert member in vars(light), member


def test_contract_modules_import_no_torch():
    code = ("import sys\nimport components.models.qwen3 as a, components.models.llama3 as b, "
            "components.models.qwen3_5 as c\n"
            "f = [a.facts('30B-A3B-yarn'), b.facts('8B'), c.facts('35B-A3B')]\n"
            "assert not [m for m in ('torch', 'torchtitan') if m in sys.modules], sorted(sys.modules)\n"
            "print(f[0].max_seq_len, f[1].n_params, f[2].n_linear_attention_layers)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["131072", str(llama3.facts("8B").n_params), "30"]


def test_flavor_tables_are_frozen_dataclasses():
    for light in (qwen3, llama3, qwen3_5):
        for a in light.FLAVORS.values():
            assert dataclasses.is_dataclass(a) and type(a).__dataclass_params__.frozen
    assert importlib.import_module("components.models.family").ModelFacts is common.ModelFacts
