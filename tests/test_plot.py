"""apiary plot: runs' metrics.jsonl as one PNG of four panels (loss, grad norm, tokens/s, peak memory).

Synthetic runs with known values; what the figure holds is read back from its lines (toolkit.plot.draw
returns it) and compared with the records. Bad input stops with exit code 2 and one paragraph naming
the file (and line), before anything is drawn.
"""

import json
import struct
from pathlib import Path

import pytest

from toolkit import plot
from toolkit.cli import apiary_main


def _apiary_plot(argv: list[str]) -> int:
    return apiary_main(["plot", *argv])


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def _write(folder: Path, records: list, recipe: str | None = "debug_moe", name: str = "metrics.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if recipe:
        (folder / "config.yaml").write_text(f"recipe: {recipe}\ntraining:\n  steps: 4\n")
    (folder / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return folder


def _rec(step, loss, gn, tps, mem, kind="cpu_max_rss", **extra):
    return {"step": step, "loss": loss, "grad_norm": gn, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps,
            "peak_mem_bytes": mem, "peak_mem_kind": kind, "tflops_per_gpu": 0.1, **extra}


def test_plot_draws_each_run_from_its_metrics(tmp_path, monkeypatch, capsys):
    a = _write(tmp_path / "runs" / "debug_moe" / "20250101-120000", [
        _rec(1, 6.0, 2.0, 1000.0, 3 * 2**29),
        _rec(2, 5.5, 1.5, 1100.0, 3 * 2**29, val_loss=5.75),
        "",  # blank lines are not records
        _rec(3, 5.0, float("nan"), 1200.0, 2**31),  # a skipped step's NaN grad norm: a gap
        _rec(4, 4.5, 1.0, 1300.0, 2**31, val_loss=4.625),
    ])
    # a resume moved its earlier records aside: they are not plotted
    (a / "metrics.superseded.jsonl").write_text(json.dumps(_rec(3, 99.0, 99.0, 1.0, 1)) + "\n")
    b = _write(tmp_path / "other" / "gpu-run", [_rec(1, 7.0, 3.0, 9000.0, 2**30, "cuda_max_memory_reserved"),
                                                 _rec(2, 6.0, 2.5, 9500.0, 2**31, "cuda_max_memory_reserved")],
               recipe="qwen3_30b_a3b_64k")
    drawn = []
    monkeypatch.setattr(plot, "draw", lambda *args, _draw=plot.draw, **kw: drawn.append(_draw(*args, **kw)) or drawn[-1])
    assert _apiary_plot([str(a), str(b / "metrics.jsonl")]) == 0  # a run folder, or its metrics.jsonl
    out = a / "plot.png"
    assert f"wrote {out} (2 runs, 1200x800)" in capsys.readouterr().out
    assert _png_size(out) == (1200, 800)
    (d,) = drawn
    la, lb = "20250101-120000 (debug_moe)", "gpu-run (qwen3_30b_a3b_64k)"
    assert list(d) == ["loss (dashed: val_loss)", "grad norm", "throughput", "peak memory"]
    assert d["loss (dashed: val_loss)"] == {la: ([1, 2, 3, 4], [6.0, 5.5, 5.0, 4.5]),
                                            f"{la} val_loss": ([2, 4], [5.75, 4.625]),
                                            lb: ([1, 2], [7.0, 6.0])}
    xs, ys = d["grad norm"][la]
    assert xs == [1, 2, 3, 4] and ys[:2] == [2.0, 1.5] and ys[2] != ys[2] and ys[3] == 1.0  # NaN: a gap
    assert d["grad norm"][lb] == ([1, 2], [3.0, 2.5])
    assert d["throughput"] == {la: ([1, 2, 3, 4], [1000.0, 1100.0, 1200.0, 1300.0]), lb: ([1, 2], [9000.0, 9500.0])}
    # GiB; two kinds of peak memory: each line says which it is
    assert d["peak memory"] == {f"{la} (max RSS on CPU)": ([1, 2, 3, 4], [1.5, 1.5, 2.0, 2.0]),
                                f"{lb} (torch reserved on GPU)": ([1, 2], [1.0, 2.0])}
    panels = plot.run_panels([plot.load_run(str(a)), plot.load_run(str(b))])
    assert panels[3]["ylabel"] == "peak memory (GiB, max RSS on CPU / torch reserved on GPU)"


def test_plot_out_file_one_kind_and_a_steps_records_merged(tmp_path, monkeypatch):
    """--out FILE; a validation record of a step joins that step's training record; one memory kind
    names the axis. Two runs of the same folder name are told apart by their parent folder."""
    a = _write(tmp_path / "x" / "run", [_rec(1, 3.0, 1.0, 10.0, 2**30), {"step": 1, "val_loss": 3.5},
                                         _rec(2, 2.0, 0.5, 20.0, 2**30)], recipe=None)
    b = _write(tmp_path / "y" / "run", [_rec(1, 4.0, 1.0, 10.0, 2**30)], recipe=None)
    drawn = []
    monkeypatch.setattr(plot, "draw", lambda *args, _draw=plot.draw, **kw: drawn.append(_draw(*args, **kw)) or drawn[-1])
    out = tmp_path / "pics" / "cmp.png"
    assert _apiary_plot([str(a), str(b), "--out", str(out)]) == 0
    assert _png_size(out) == (1200, 800) and not (a / "plot.png").exists()
    (d,) = drawn
    assert d["loss (dashed: val_loss)"] == {"x/run": ([1, 2], [3.0, 2.0]), "x/run val_loss": ([1], [3.5]),
                                            "y/run": ([1], [4.0])}
    assert d["peak memory"] == {"x/run": ([1, 2], [1.0, 1.0]), "y/run": ([1], [1.0])}
    panels = plot.run_panels([plot.load_run(str(a))])
    assert panels[3]["ylabel"] == "peak memory (GiB, max RSS on CPU)"


@pytest.mark.parametrize("case, needle", [
    ("missing", "{run}: no such folder."),
    ("no_metrics", "{run}: holds no metrics.jsonl"),
    ("a_file", "{run}/config.yaml: is a file, not a run folder"),
    ("empty", "{run}/metrics.jsonl: holds no records."),
    ("corrupt", "{run}/metrics.jsonl:2: is not a JSON record"),
    ("no_step", "{run}/metrics.jsonl:1: is not a metrics record: each line is a JSON object with an integer step."),
    ("text_loss", "{run}/metrics.jsonl:1: loss='low' is not a number."),
    ("pdf", "--out {run}/plot.pdf: apiary plot writes PNG images. Name it plot.png."),
    ("twice", "apiary plot {run}: names a run given more than once"),
])
def test_plot_bad_input_exits_2_naming_the_file(tmp_path, capsys, case, needle):
    run = tmp_path / "run"
    good = _rec(1, 3.0, 1.0, 10.0, 2**30)
    args = [str(run)]
    if case == "no_metrics":
        _write(run, [], name="other.jsonl")
    elif case == "a_file":
        _write(run, [good])
        args = [str(run / "config.yaml")]
    elif case == "empty":
        _write(run, ["", "  "])
    elif case == "corrupt":
        _write(run, [good, '{"step": 2, "loss": 2.9, "grad'])  # cut short by a crash
    elif case == "no_step":
        _write(run, [{"loss": 3.0}])
    elif case == "text_loss":
        _write(run, [dict(good, loss="low")])
    elif case == "twice":
        _write(run, [good])
        args += [str(run / "metrics.jsonl")]
    elif case == "pdf":
        _write(run, [good])
        args += ["--out", str(run / "plot.pdf")]
    assert _apiary_plot(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error apiary: apiary plot ") and err.count("\n") == 1, err  # one paragraph
    assert needle.format(run=run) in err
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.pdf"))
