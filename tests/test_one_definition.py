"""One definition and one default per key: a key of a section the framework's schema types
(framework/compose/schema.py) is not declared again by a component's Options of that section; no
``_CHOICES`` table (fixed choices are ``Literal`` in the components' Options, ``one_of`` in the
schema, whose OmegaConf 2.3 structured configs take no ``Literal``); the default recipe's name is
written once; the components' ``check()`` does not rerun their Options' ``__post_init__``."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework import contracts
from framework.compose import registry, schema
from framework.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def _sources(*tops: str):
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _declared_keys(options_cls: type) -> set[str]:
    """Keys a component's Options (and its bases outside framework/compose/schema.py) declare themselves."""
    out: set[str] = set()
    for klass in options_cls.__mro__:
        if klass.__module__ != schema.__name__:
            out |= set(vars(klass).get("__annotations__", {}))
    return out


def _entries():
    for kind in contracts.KINDS:
        for name in registry.names(kind):
            yield kind, name


@pytest.mark.parametrize("kind,name", list(_entries()))
def test_no_key_is_declared_by_the_schema_and_by_a_component(kind, name):
    section = contracts.SELECT[kind][0]
    typed = typing.get_type_hints(schema.RecipeConfig)[section]
    comp = registry.resolve(kind, name)
    if not dataclasses.is_dataclass(typed):  # a component group: its Options are the one definition
        assert typed is typing.Any
        return
    keys = {f.name for f in dataclasses.fields(typed)}
    assert _declared_keys(comp.Options) & keys == set(), \
        f"{kind}={name}: {comp.Options.__qualname__} declares keys of schema.{typed.__name__} again"
    # ... and it reads every one of them: resolve builds the Options over the schema's section
    opts = contracts.make_options(comp, OmegaConf.structured(schema.RecipeConfig)[section]) \
        if kind != "moe_comm" or name != "deepep" else None
    if opts is not None:
        assert isinstance(opts, comp.Options)
        assert {f.name for f in dataclasses.fields(opts)} >= keys


def test_the_declared_keys_reader_sees_a_repeated_key():
    """The check above is not vacuous: an Options that repeats a schema key is caught."""

    @dataclasses.dataclass(kw_only=True)
    class Repeats:
        flavor: str = "x"

    assert _declared_keys(Repeats) & {f.name for f in dataclasses.fields(schema.ModelConfig)} == {"flavor"}


def _model_section(**kw):
    cfg = OmegaConf.merge(OmegaConf.structured(schema.RecipeConfig),
                          {"model": {"family": "qwen3", "flavor": "tiny_moe", **kw}})
    return cfg["model"]


def test_shared_section_options_keep_their_value_checks():
    """The model family's Options check the schema's model keys as resolve builds them, from a typed
    recipe and from one read back untyped (a run's resolved file)."""
    comp = registry.resolve("model", "qwen3")
    assert contracts.make_options(comp, _model_section()).flavor == "tiny_moe"
    with pytest.raises(ValueError, match="model.n_layers must be >= 1, got 0"):
        contracts.make_options(comp, _model_section(n_layers=0))
    with pytest.raises(ValueError, match="model.attn_backend=sdpa is not an attention backend"):
        contracts.make_options(comp, _model_section(attn_backend="sdpa"))
    untyped = OmegaConf.create({"model": OmegaConf.to_container(_model_section(n_layers=0))})
    with pytest.raises(ValueError, match="model.n_layers must be >= 1"):
        contracts.make_options(comp, untyped["model"])
    opts = contracts.make_options(comp, OmegaConf.create({"model": {"family": "qwen3", "flavor": "f"}})["model"])
    assert opts.attn_backend == schema.ModelConfig.attn_backend  # the schema's default, the only one


def test_moe_comm_options_run_their_check_as_they_are_built():
    """DeepEP's Options (a subclass of the moe: section's) still check the package when built."""
    try:
        import deep_ep  # noqa: F401  # reason: optional dependency (CUDA builds only)
        pytest.skip("deep_ep is installed here")
    except ImportError:
        pass
    cfg = OmegaConf.merge(OmegaConf.structured(schema.RecipeConfig), {"moe": {"comm": "deepep"}})
    with pytest.raises(UserError, match="deep_ep package is not installed"):
        contracts.make_options(registry.resolve("moe_comm", "deepep"), cfg["moe"])


def test_no_choices_table_remains():
    bad = []
    for path, tree in _sources("framework", "components"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id.endswith("_CHOICES"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.id}")
    assert bad == [], "a *_CHOICES table (use Literal in Options, schema.one_of in the schema):\n" + "\n".join(bad)


def test_schema_choices_are_refused_outside_their_set():
    """Every ``one_of`` key of the schema is checked by resolve (its default is among its choices)."""
    from framework.resolve import values

    keys = schema.choices()
    assert {"optimizer.name", "lr.decay_type", "preflight.memory", "training.autotune_configs",
            "parallel.cp_load_balancer"} <= set(keys)
    base = OmegaConf.structured(schema.RecipeConfig)
    for key, names in keys.items():
        assert OmegaConf.select(base, key) in names
        cfg = OmegaConf.structured(schema.RecipeConfig)
        OmegaConf.update(cfg, key, "bogus")
        with pytest.raises(UserError) as e:
            values.check_values(cfg)
        assert e.value.where == f"{key}=bogus" and f"valid: {', '.join(names)}" in e.value.reason


def test_the_default_recipe_is_named_once():
    hits = []
    for path, tree in _sources("framework", "toolkit"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == schema.DEFAULT_RECIPE:
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert hits == [f"framework/compose/schema.py:{_line_of('DEFAULT_RECIPE = ')}"], hits
    assert schema.RecipeConfig.recipe == schema.DEFAULT_RECIPE


def _line_of(text: str) -> int:
    lines = (ROOT / "framework" / "compose" / "schema.py").read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if ln.startswith(text))


def test_no_check_reruns_post_init():
    """A component's check() does not call its Options' __post_init__ again (the value checks run
    once, as resolve builds the Options; a test of them then fails when they are gutted)."""
    bad = []
    for path, tree in _sources("components"):
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "check":
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr == "__post_init__":
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == [], "check() reruns __post_init__:\n" + "\n".join(bad)
