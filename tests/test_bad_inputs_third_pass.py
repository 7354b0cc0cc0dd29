"""Bad input, third pass (docs/reliability.md, "Bad input, third pass"): recipes and user registries
that used to end in a traceback or a silence, Hydra's `+` idioms, paths, values accepted silently.
Each refusal exits 2 with one paragraph naming the key or the file, before any worker starts, and
writes nothing. In process, through ``train_main`` (the console entry's function).
"""

import textwrap

import pytest

from framework.cli import train_main


@pytest.fixture(autouse=True)
def package_registry_after():
    """User registry files merged in-process are forgotten after each test."""
    from framework import registry

    yield
    registry.entries.cache_clear()
    registry._USED.clear()


def _refused(code, err, workdir, *needles):
    err = " ".join(err.split())
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err, err
    assert "error apiary:" in err, err
    err = err[err.index("error apiary:"):]
    assert err.count("error apiary:") == 1, err  # one paragraph
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()  # nothing started, nothing written
    assert not (workdir / "out").exists()


USER_MODULES = {
    "my_boom.py": '''
        from dataclasses import dataclass


        class Boom:
            @dataclass(kw_only=True)
            class Options:
                name: str = "boom"

            @staticmethod
            def check(options, ctx):
                raise KeyError("vocab")

            @staticmethod
            def apply(options, tc, ctx):
                pass
        ''',
    "my_exiting.py": "import sys\nsys.exit(3)\n",
}


@pytest.fixture
def files(workdir, monkeypatch):
    for name, text in USER_MODULES.items():
        (workdir / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(workdir))
    (workdir / "boom.yaml").write_text("loss:\n  boom:\n    target: my_boom:Boom\n")
    (workdir / "quits.yaml").write_text("loss:\n  quits:\n    target: my_exiting:X\n")
    (workdir / "listed.yaml").write_text("loss:\n  - a\n  - b\n")
    (workdir / "self.yaml").write_text("defaults:\n  - self\n  - _self_\n")
    (workdir / "ping.yaml").write_text("defaults:\n  - pong\n  - _self_\n")
    (workdir / "pong.yaml").write_text("defaults:\n  - ping\n  - _self_\n")
    (workdir / "mine.yml").write_text("defaults:\n  - debug_moe\n  - _self_\n")
    (workdir / "far.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\nloss:\n  num_chunks: 4\n")
    (workdir / "chunked.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\n"
                                          "loss:\n  name: chunked\n  num_chunks: 4\n")
    (workdir / "child.yaml").write_text("defaults:\n  - chunked\n  - _self_\ntraining:\n  steps: 3\n")
    return workdir


@pytest.mark.parametrize("argv,needles", [
    # recipes and user registries (were: RecursionError, AttributeError, a KeyError traceback, exit 3 silent)
    (["recipe=self.yaml"], ["self.yaml: its `defaults:` list extends itself (self -> self)"]),
    (["recipe=ping.yaml"], ["extends itself (ping -> pong -> ping)"]),
    (["registry=listed.yaml"], ["listed.yaml, loss must map each name to {target: module:attr", "not a list"]),
    (["registry=boom.yaml", "loss=boom"], ["loss=boom: loss 'boom' (bound by", "boom.yaml) raised KeyError: 'vocab'",
                                           "my_boom.py:12, in check"]),
    (["registry=quits.yaml", "loss=quits"], ["importing my_exiting:X", "called sys.exit(3)",
                                             "if __name__ == \"__main__\":"]),
    (["recipe=./mine.yml"], ["recipe=./mine.yml", "only files named *.yaml", "mv mine.yml mine.yaml"]),
    (["recipe=./mine.yaml"], ["no recipe file at mine.yaml", "There is mine.yml"]),
    # Hydra's '+': a group every recipe has, a key only another option of the group declares, a typo
    (["+loss=chunked"], ["override +loss=chunked", "every recipe already chooses a loss",
                         "Choose the option without '+': loss=chunked."]),
    (["++loss=chunked"], ["Choose the option without '+': loss=chunked."]),
    (["+loss.num_chunks=4"], ["loss.num_chunks is an option of loss=chunked: write loss=chunked loss.num_chunks=4."]),
    (["+training.stpes=4"], ["Did you mean 'training.steps'? Write training.steps=4."]),
    # a recipe that sets another option's key without choosing it: name the two forms, not the same key
    (["recipe=far.yaml"], ["sets 'loss.num_chunks', an option of loss=chunked", "`loss: {name: chunked, ...}`",
                           "`override /loss: chunked` in the `defaults:` list"]),
    (["recipe=chunked.yaml", "loss=ce"], ["sets 'loss.num_chunks', an option of loss=chunked"]),
])
def test_bad_input_is_refused_before_launch(files, capsys, argv, needles):
    code = train_main(argv)
    _refused(code, capsys.readouterr().err, files, *needles)


def test_plus_on_a_key_the_recipe_has_sets_it(workdir, capsys):
    """`+key=v` on a key the recipe has: set, as `key=v` (was refused: Hydra's '+' only adds)."""
    assert train_main(["+training.steps=5", "+model.n_layers=1", "--cfg", "job"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "steps: 5" in out and "n_layers: 1" in out


def test_a_recipe_section_that_names_its_component_chooses_it(files, capsys):
    """`loss: {name: chunked, num_chunks: 4}` in a recipe (or one it extends) chooses loss=chunked, as
    `override /loss: chunked` would; a group on the command line still wins."""
    for recipe in ("chunked.yaml", "child.yaml"):
        assert train_main([f"recipe={recipe}", "--cfg", "job"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "name: chunked" in out and "num_chunks: 4" in out, out
    assert train_main(["recipe=chunked.yaml", "loss.num_chunks=2", "--cfg", "job"]) == 0
    assert "num_chunks: 2" in capsys.readouterr().out
