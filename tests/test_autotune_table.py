"""Recorded autotuning winners (framework/train/autotune_table.py): Triton's own Autotuner.run, with its
benchmark and launch replaced by recorded timings (nothing compiles or runs on CPU), tunes only a
table's configs; `apiary autotune-table` writes that table from Triton's disk-cache entries."""

from __future__ import annotations

import json

import pytest

from framework.train import autotune_table

from conftest import run_cli

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
torch = pytest.importorskip("torch")

TIMES = {16: 3.0, 32: 1.0, 64: 1.01, 128: 5.0}  # recorded medians (ms): 32 wins, 64 within 2%


@triton.jit
def _toy_kernel(x, N, BLOCK: tl.constexpr):
    pass


def _tuner(monkeypatch):
    tuner = triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in TIMES], key=["N"])(_toy_kernel)
    benched, launched = [], []
    monkeypatch.setattr(tuner, "_bench", lambda *a, config, **k: benched.append(config.kwargs["BLOCK"])
                        or [TIMES[config.kwargs["BLOCK"]]], raising=False)
    monkeypatch.setattr(tuner.fn, "run", lambda *a, **k: launched.append(k["BLOCK"]), raising=False)
    monkeypatch.setattr(tuner, "cache_results", False)
    return tuner, benched, launched


def _name(block: int) -> str:
    return str(triton.Config({"BLOCK": block}))


@pytest.fixture
def table_off():
    yield
    autotune_table.install("all")


def test_an_exact_key_tunes_only_its_recorded_winners(monkeypatch, table_off):
    key = json.dumps([128, "torch.float32"])  # N, then the dtype of each tensor argument (Triton's key)
    autotune_table.install("recorded", {"_toy_kernel": {key: [_name(64), _name(32)]}})
    tuner, benched, launched = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 128)
    assert sorted(benched) == [32, 64] and launched == [32]


def test_one_recorded_winner_is_launched_without_benchmarking(monkeypatch, table_off):
    key = json.dumps([128, "torch.float32"])
    autotune_table.install("recorded", {"_toy_kernel": {key: [_name(64)]}})
    tuner, benched, launched = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 128)
    assert benched == [] and launched == [64]


def test_an_unrecorded_key_tunes_the_union_of_winners_or_everything(monkeypatch, table_off):
    two = {json.dumps([128, "torch.float32"]): [_name(32)], json.dumps([256, "torch.float32"]): [_name(64)]}
    autotune_table.install("recorded", {"_toy_kernel": two})
    tuner, benched, launched = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 512)  # another shape: the kernel's winners elsewhere, benchmarked
    assert sorted(benched) == [32, 64] and launched == [32]
    one = {json.dumps([128, "torch.float32"]): [_name(64)]}
    autotune_table.install("recorded", {"_toy_kernel": one})
    tuner, benched, launched = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 512)  # a single winner from another shape is not trusted: all configs
    assert sorted(benched) == sorted(TIMES) and launched == [32]


def test_stale_entries_and_all_mode_tune_every_config(monkeypatch, table_off):
    key = json.dumps([128, "torch.float32"])
    autotune_table.install("recorded", {"_toy_kernel": {key: [str(triton.Config({"BLOCK": 8}))]}})  # not listed any more
    tuner, benched, _ = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 128)
    assert sorted(benched) == sorted(TIMES)
    autotune_table.install("all")
    tuner, benched, _ = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 128)
    assert sorted(benched) == sorted(TIMES)
    with pytest.raises(ValueError, match="recorded or all"):
        autotune_table.install("some")


def _cache_entry(root, kernel, key, timings, sub="ab"):
    d = root / "triton" / sub
    d.mkdir(parents=True, exist_ok=True)
    rows = [(triton.Config({"BLOCK": b}).__dict__, [t, t * 0.9, t * 1.1]) for b, t in timings.items()]
    (d / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": rows}))


def test_export_keeps_configs_within_two_percent_and_the_full_tuning(tmp_path):
    _cache_entry(tmp_path, "_toy_kernel", [128, "torch.float32"], TIMES, "a1")
    _cache_entry(tmp_path, "_toy_kernel", [128, "torch.float32"], {128: 0.5}, "a2")  # a pruned tuning: ignored
    _cache_entry(tmp_path, "other", [7], {16: 2.0, 32: float("inf")}, "b1")  # a config that did not fit
    kernels = autotune_table.export(tmp_path)
    assert kernels == {"_toy_kernel": {json.dumps([128, "torch.float32"]): [_name(32), _name(64)]},
                       "other": {json.dumps([7]): [_name(16)]}}


def test_the_exported_table_is_what_training_reads(tmp_path, monkeypatch, table_off):
    _cache_entry(tmp_path / "kc", "_toy_kernel", [128, "torch.float32"], TIMES)
    out = tmp_path / "tables" / "sm90.json"
    res = run_cli(["apiary", "autotune-table", str(tmp_path / "kc"), "--out", str(out)], cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "_toy_kernel" in res.stdout
    table = autotune_table.load("sm90", tables=out.parent)
    autotune_table.install("recorded", table)
    tuner, benched, launched = _tuner(monkeypatch)
    tuner.run(torch.zeros(4), 128)
    assert sorted(benched) == [32, 64] and launched == [32]


def test_autotune_table_refuses_a_cache_without_results(tmp_path):
    (tmp_path / "empty").mkdir()
    res = run_cli(["apiary", "autotune-table", str(tmp_path / "empty"), "--out", str(tmp_path / "t.json")],
                  cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "holds no Triton autotuning results" in res.stderr
    assert "training.autotune_configs=all" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "t.json").exists()


def test_an_unreadable_shipped_table_tunes_everything_with_a_warning(tmp_path, caplog):
    (tmp_path / "sm90.json").write_text("{not json")
    assert autotune_table.load("sm90", tables=tmp_path) == {}
    assert "unreadable" in caplog.text
    assert autotune_table.load(None) == {} and autotune_table.load("sm12", tables=tmp_path) == {}


def test_an_unknown_autotune_configs_value_is_refused_before_launch(tmp_path):
    res = run_cli(["train", "recipe=debug_moe", "training.autotune_configs=fast"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "training.autotune_configs=fast" in res.stderr
    assert "recorded, all" in res.stderr and not (tmp_path / "runs").exists()


def test_the_shipped_hopper_table_names_kernels_that_exist_and_parses_as_configs():
    table = autotune_table.load("sm90")
    assert len(table) >= 10  # recorded on one H200 (docs/skills/autotune_table.md)
    import importlib.util
    import pathlib
    import re

    fla = importlib.util.find_spec("fla")
    roots = [pathlib.Path(fla.origin).parent] if fla else []
    roots.append(pathlib.Path(autotune_table.__file__).parents[1] / "components")
    defined = {m for r in roots for f in r.rglob("*.py") for m in re.findall(r"^def (\w+)\(", f.read_text(), re.M)}
    for name, keys in table.items():
        if fla:
            assert name in defined, f"{name} is in framework/train/autotune_tables/sm90.json but no kernel defines it"
        for key, configs in keys.items():
            assert isinstance(json.loads(key), list) and 1 <= len(configs) <= autotune_table.MAX_KEEP
            assert all("num_warps: " in c and "num_stages: " in c for c in configs)


def test_autotune_table_refuses_a_folder_that_is_not_there(tmp_path):
    res = run_cli(["apiary", "autotune-table", str(tmp_path / "nope"), "--out", str(tmp_path / "t.json")],
                  cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "is not a folder" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "t.json").exists()
