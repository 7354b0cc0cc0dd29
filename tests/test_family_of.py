"""``registry.family_of``: which model family reads a config.json ``model_type``, read from the families'
declared ``HF_MODEL_TYPES`` (the model contract), so a family of a user registry is found as the
shipped ones are; a family given another family's folder is refused naming that family (issue 47).

No GPU and no torch model: a config.json alone, refused before any weight is read.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from framework import contracts
from framework.compose import registry
from framework.errors import UserError
from framework.resolve.resolver import resolve

FAMILY = '''
"""A made-up family reading config.json model_type "toyhf" (qwen3's flavors, planned only)."""

from components.models import family, qwen3

FLAVORS = qwen3.FLAVORS
HF_MODEL_TYPES = ("toyhf", "toyhf_moe")
Options = family.ModelOptions
model_kwargs, check, apply = family.family_contract(__name__)
facts = qwen3.facts


def model_spec(flavor, **kwargs):
    raise NotImplementedError("planned only")
'''


@pytest.fixture
def toy_registry(tmp_path, monkeypatch):
    """A user registry binding family ``toyhf``; the registry is restored afterwards."""
    (tmp_path / "apiary_test_toyhf_family.py").write_text(textwrap.dedent(FAMILY))
    (tmp_path / "registry.yaml").write_text(
        "model:\n  toyhf:\n    target: apiary_test_toyhf_family\n    doc: a made-up HF family\n    skill: models\n")
    monkeypatch.setitem(registry.entries(), "model", dict(registry.entries()["model"]))
    monkeypatch.setattr(registry, "_USED", list(registry._USED))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "registry.yaml"


@pytest.mark.parametrize("model_type,family", [
    ("qwen3", "qwen3"), ("qwen3_moe", "qwen3"), ("llama", "llama3"), ("qwen3_5", "qwen3_5"),
    ("qwen3_5_moe", "qwen3_5"), ("qwen3_5_moe_text", "qwen3_5"), ("gpt2", None), ("", None)])
def test_the_shipped_families_map(model_type, family):
    assert registry.family_of(model_type) == family


def test_every_declared_model_type_maps_to_its_family():
    for name in registry.names("model"):
        for mt in contracts.member(registry.resolve("model", name), "model", "HF_MODEL_TYPES"):
            assert registry.family_of(mt) == name


def test_a_user_registrys_family_is_found_by_its_declared_model_types(toy_registry):
    assert registry.family_of("toyhf") is None  # not before its registry is used
    registry.use(toy_registry)
    assert registry.family_of("toyhf") == registry.family_of("toyhf_moe") == "toyhf"
    assert registry.family_of("qwen3_moe") == "qwen3"


def test_a_folder_of_a_user_familys_model_type_is_refused_naming_that_family(toy_registry, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toyhf", "hidden_size": 64}))
    with pytest.raises(UserError) as e:  # debug_moe's family, qwen3, does not read toyhf
        resolve("debug_moe", [f"registry={toy_registry}", f"model.hf_checkpoint={folder}"], world_size=1,
                for_training=False)
    msg = " ".join(str(e.value).split())
    assert "model_type=toyhf, which model.family=qwen3 does not read" in msg, msg
    assert "Set model.family=toyhf model.flavor=" in msg, msg


def test_a_model_type_no_family_reads_lists_the_declared_ones(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 64}))
    with pytest.raises(UserError) as e:
        resolve("debug_moe", [f"model.hf_checkpoint={folder}"], world_size=1, for_training=False)
    msg = " ".join(str(e.value).split())
    assert "model_type=gpt2, which model.family=qwen3 does not read" in msg, msg
    assert "qwen3_moe" in msg and "llama" in msg, msg


def test_show_finds_the_family_through_the_registry(tmp_path, capsys):
    """`apiary show DIR` (and `apiary logprobs`) ask registry.family_of, so a folder no family reads
    is refused with the model types the registries' families declare (not a hard-coded list)."""
    from toolkit.cli import apiary_main

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 64}))
    assert apiary_main(["show", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model_type=gpt2, which no model family of the registries reads" in err, err
    assert f"The families read model_type {', '.join(registry.model_types())}." in err, err
    assert "qwen3_5_moe_text" in registry.model_types() and registry.family_of("qwen3_5_moe_text") == "qwen3_5"
