"""`apiary launch registry=FILE launcher=NAME`: the user registry is applied before the launcher's name
is checked, as `train` applies it (was: "unknown launcher" for a launcher the file binds)."""

from __future__ import annotations


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
