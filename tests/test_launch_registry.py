"""`apiary launch registry=FILE launcher=NAME`: the user registry is applied before the launcher's name
is checked, as `train` applies it (was: "unknown launcher" for a launcher the file binds)."""

from __future__ import annotations

import pytest


def test_launch_finds_a_launcher_a_user_registry_binds(tmp_path, monkeypatch, capsys):
    from framework.compose import registry
    from toolkit.launch import launch_main

    (tmp_path / "reg.yaml").write_text("launcher:\n  mylocal:\n    target: components.launchers.local:LocalLauncher\n"
                                       "    doc: the local launcher under another name\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "_USED", [])
    registry.entries.cache_clear()
    try:
        assert launch_main(["launcher=mylocal", "--dry-run"]) == 2  # unknown without the file
        assert "unknown launcher 'mylocal'" in capsys.readouterr().err
        assert launch_main(["registry=reg.yaml", "launcher=mylocal", "--dry-run"]) == 0, capsys.readouterr().err
        out = capsys.readouterr()
        assert "via mylocal" in out.err and "dry run: nothing started" in out.out + out.err
    finally:
        registry.entries.cache_clear()


REG = ("launcher:\n  mylocal:\n    target: components.launchers.local:LocalLauncher\n"
       "    doc: the local launcher under another name\n")


def test_train_and_apiary_launch_call_the_one_launch(tmp_path, monkeypatch):
    """Both commands end in framework.launch.start.launch, with the recipe and Hydra overrides (apiary
    launch's shorthands expanded, its flags as keywords)."""
    from framework import cli
    from framework.launch import start
    from toolkit.launch import launch_main

    calls = []
    monkeypatch.setattr(start, "launch", lambda recipe, overrides, **kw: calls.append((recipe, overrides, kw)) or 0)
    monkeypatch.chdir(tmp_path)
    assert cli.train_main(["recipe=debug_moe", "nproc=2", "-v"]) == 0
    assert launch_main(["recipe=debug_moe", "launcher=local", "nproc=2", "--dry-run"]) == 0
    assert calls == [("debug_moe", ["launcher.nproc=2"], {"verbose": True}),
                     ("debug_moe", ["launcher=local", "launcher.nproc=2"], {"dry_run": True, "verbose": False})]


@pytest.mark.parametrize("order", ["registry_first", "launcher_first"])
def test_train_finds_a_launcher_a_user_registry_binds(tmp_path, monkeypatch, capsys, order):
    """`train registry=FILE launcher=NAME` (either order): the file is applied before the name is looked
    up, and the launch goes through that launcher."""
    from components.launchers.local import LocalLauncher
    from framework import cli
    from framework.compose import registry

    (tmp_path / "reg.yaml").write_text(REG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "_USED", [])
    started = []
    monkeypatch.setattr(LocalLauncher, "launch", staticmethod(lambda opts, argv, env: started.append(argv) or 0))
    registry.entries.cache_clear()
    args = ["registry=reg.yaml", "launcher=mylocal"]
    try:
        assert cli.train_main(["recipe=debug_moe", "launcher=mylocal", "output_dir=a"]) == 2  # unknown without it
        assert "mylocal" in capsys.readouterr().err
        code = cli.train_main(["recipe=debug_moe", *(args if order == "registry_first" else args[::-1]), "output_dir=b"])
        out = capsys.readouterr()
        assert code == 0, out.err
        assert "via mylocal" in out.out and len(started) == 1 and "launcher=mylocal" in started[0]
    finally:
        registry.entries.cache_clear()
