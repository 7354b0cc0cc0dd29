"""apiary compare: one seed checkpoint, variants side by side, tolerances and --check.

The paired runs are tiny (2 steps of 64 tokens) and share one seed checkpoint; the whole
file takes about two minutes on two CPU cores. recompute=selective vs full is expected to be
bitwise identical in fp32 on CPU (recompute reruns the same ops), and it is: every
difference is asserted to be exactly 0.
"""

import json
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from toolkit import compare
from toolkit import plot as plots
from toolkit.compare import TOLERANCES, classify, compare_main

TINY = ["training.steps=2", "training.seq_len=64", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def identical(tmp_path_factory):
    """recompute=selective,full from a seed the comparison creates itself."""
    out = tmp_path_factory.mktemp("cmp") / "identical"
    rc = compare_main(["recompute=selective,full", *TINY, f"output_dir={out}", "--check", "--jobs=2"])
    return rc, out, json.loads((out / "compare.json").read_text())


def test_identical_pair_is_bitwise_equal(identical):
    rc, out, res = identical
    assert rc == 0, res["check"]
    assert res["key"] == "recompute" and res["values"] == ["selective", "full"]
    assert res["tolerance"]["kind"] == "exact"
    base, var = res["variants"]
    assert base["status"] == var["status"] == "ok"
    assert base["steps"] == var["steps"] == [1, 2]
    # the shared seed: one seed checkpoint, both runs loaded it
    seed = out / "seed" / "checkpoint" / "step-0"
    assert (seed / ".metadata").is_file()
    assert base["seed"] == var["seed"] == str(seed)
    d = var["diff"]
    for key in ("loss_max_rel", "grad_norm_max_rel", "step0_loss_abs", "logits_max_abs", "logits_rel",
                "grads_max_abs", "grads_rel"):
        assert d[key] == 0.0, (key, d[key])
    assert d["grads_n_params"] > 10  # every parameter's gradient was compared
    assert var["loss"] == base["loss"] and var["grad_norm"] == base["grad_norm"]
    # the probe's step-0 loss is the training run's step-1 loss (same weights, same first batch)
    for r in (base, var):
        assert r["probe"]["step1_loss_abs_diff"] == 0.0
        assert r["probe"]["logits"]["shape"] == [4, 64, 320]  # local_batch x seq_len x vocab
        assert r["summary"]["step_time_s"] > 0 and r["summary"]["tokens_per_s"] > 0
        assert r["summary"]["peak_mem_bytes"] > 0
        assert not (Path(r["dir"]) / "checkpoint").exists()  # variant checkpoints are cleaned up
    import torch

    grads = torch.load(Path(var["dir"]) / "probe" / "grads.pt", weights_only=True)
    assert "lm_head.weight" in grads and grads["lm_head.weight"].shape == (320, 64)
    assert all(float(g.abs().sum()) > 0 for k, g in grads.items() if "lm_head" in k or "tok_embeddings" in k)
    md = (out / "compare.md").read_text()
    assert "apiary compare recompute=selective,full training.steps=2" in md
    assert "| recompute=selective | recompute=full |" in md.replace("| metric ", "")


def test_deliberate_change_fails_check_and_crash_is_reported(identical, capsys, monkeypatch):
    """lr 3e-3 vs 3e-2 from the same seed: same step 1, then apart; --check fails naming the
    variant, metric, difference and tolerance. lr=1e30 crashes at step 2 (the trainer stops on a
    non-finite loss): reported with its log tail, the other variants unaffected. compare.png holds
    the runs' own curves and their differences; the piped report has no markup and whole tables."""
    _, out, _ = identical
    seed = out / "seed" / "checkpoint" / "step-0"
    dest = out.parent / "lr"
    drawn = []  # what compare.png holds, read back from its figure (toolkit.plot.draw returns it)
    monkeypatch.setattr(plots, "draw", lambda *a, _draw=plots.draw, **k: drawn.append(_draw(*a, **k)) or drawn[-1])
    rc = compare_main(["optimizer.lr=3e-3,3e-2,1e30", *TINY, f"checkpoint.load_path={seed}",
                       f"output_dir={dest}", "--check", "--no-probe", "--jobs=2", "--json"])
    text = capsys.readouterr()
    assert rc == 1
    res = json.loads((dest / "compare.json").read_text())
    assert json.loads(text.out) == res  # --json: the same results on stdout, the tables on stderr
    base, fast, broken = res["variants"]
    assert res["tolerance"]["kind"] == "fp32"  # --check holds a deliberate change to rounding level
    assert base["seed"] == fast["seed"] == str(seed) and not (dest / "seed").exists()
    assert base["status"] == fast["status"] == "ok"
    assert base["loss"][0] == fast["loss"][0]  # step 1 precedes the first update
    assert fast["diff"]["loss_max_rel"] > 1e-2
    msgs = [f["message"] for f in res["check"]["failures"]]
    curve = [m for m in msgs if m.startswith("optimizer.lr=0.03: loss curve")]
    assert curve and "from optimizer.lr=0.003, above the fp32 tolerance 0.001" in curve[0], msgs
    assert broken["status"] == "crashed" and broken["returncode"] != 0
    assert "is not finite" in broken["log_tail"] and "Exit code 76" in broken["log_tail"]
    assert any(m.startswith("optimizer.lr=1e") and ": the run crashed" in m for m in msgs), msgs
    assert "check failed" in text.err and "optimizer.lr=0.03: loss curve" in text.err
    assert "is not finite" in text.err  # the crash's log tail is shown
    assert re.search(r"optimizer.lr=1e\+?30: crashed", (dest / "compare.md").read_text().replace("## ", ""))
    _assert_piped_report(text.err, [v["label"] for v in res["variants"]])
    _assert_compare_png(dest, res, drawn)


def _assert_piped_report(err: str, labels: list[str]):
    """Piped (not a terminal): status words plain, no markup; each table as wide as it needs."""
    assert "[green]" not in err and "[/" not in err and "\x1b[" not in err, err
    assert re.search(rf"compare {re.escape(labels[0])}: ok in [0-9.]+ s \(exit 0", err), err
    assert re.search(rf"compare {re.escape(labels[2])}: crashed in [0-9.]+ s \(exit 76", err), err
    assert "\u2026" not in err  # no cell cut with an ellipsis
    # the loss-by-step table: step, each variant, and a rel diff per variant after the baseline, on one line
    head = re.compile(r"step +┃ +" + r" +┃ +".join([re.escape(labels[0])] + [re.escape(x) + r" +┃ +rel diff"
                                                                            for x in labels[1:]]) + " +┃")
    assert head.search(err), err
    assert re.search(r"┃ metric +┃ +" + r" +┃ +".join(map(re.escape, labels)) + " +┃", err), err
    assert max(map(len, err.splitlines())) > 80  # wider than the 80 columns rich assumes for a pipe


def _assert_compare_png(dest: Path, res: dict, drawn: list[dict]):
    png = (dest / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1200, 800)
    assert res["plot"] == "compare.png" and "](compare.png)" in (dest / "compare.md").read_text()
    (d,) = drawn
    runs = []
    for v in res["variants"]:  # each variant's own metrics.jsonl, read here
        recs = [json.loads(ln) for ln in (Path(v["dir"]) / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        runs.append({r["step"]: r for r in recs})
        assert recs and [r["step"] for r in recs] == v["steps"]
    labels = [v["label"] + ("" if v["status"] == "ok" else f" ({v['status']})") for v in res["variants"]]
    for key, title in (("loss", "loss"), ("grad_norm", "grad norm")):
        for lab, recs in zip(labels, runs):
            assert d[title][lab] == (sorted(recs), [recs[s][key] for s in sorted(recs)]), (title, lab)
        diffs = {lab.split(" (identical")[0]: xy for lab, xy in d[f"{title} - baseline"].items()}
        assert list(diffs) == labels[1:]
        for lab, recs in zip(labels[1:], runs[1:]):
            steps = sorted(set(recs) & set(runs[0]))
            assert diffs[lab] == (steps, [recs[s][key] - runs[0][s][key] for s in steps]), (title, lab)
    assert d["loss - baseline"][labels[1]][1][0] == 0.0 and d["loss - baseline"][labels[1]][1][-1] != 0.0


@pytest.mark.parametrize("argv, needle", [
    ([], "no key to compare"),
    (["loss=ce,chunked", "optimizer.lr=1e-3,2e-3"], "2 keys take several values (loss, optimizer.lr)"),
    (["loss=ce,bogus"], "variant loss=bogus"),
    (["optimizer.lr=1e-3,fast"], "variant optimizer.lr=fast"),
    (["loss=ce,chunked", "--tol=close"], "unknown tolerance kind"),
    (["loss=ce,chunked", "checkpoint.resume=true"], "every variant starts fresh"),
])
def test_user_errors_stop_before_anything_runs(tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    assert compare_main([*argv, *TINY, f"output_dir={out}"]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def _variant(dtype="float32", local_batch=4, dp=1, accum=1, sharding="blocks", deterministic=False, ep=1,
             loss="ce"):
    cfg = SimpleNamespace(training=SimpleNamespace(dtype=dtype, local_batch=local_batch,
                                                   deterministic=deterministic),
                          data=SimpleNamespace(sharding=sharding), loss=SimpleNamespace(name=loss))
    dims = {"dp_shard": dp, "ep": ep, "cp": 1, "tp": 1, "pp": 1}
    r = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(dp=dp, dims=dims), grad_accum=accum,
                        facts=SimpleNamespace(num_experts=8))
    return compare.Variant(0, "v", "k=v", "0-v", [], resolved=r)


def test_tolerance_kinds():
    one, two = _variant(accum=2), _variant(dp=2)
    assert classify("moe.chunk", [one, one], accelerator=False)[0] == "exact"
    assert classify("moe.chunk", [one, one], accelerator=True)[0] == "bf16"  # GPU: not bitwise run to run
    assert classify("moe.chunk", [_variant(deterministic=True)] * 2, accelerator=True)[0] == "exact"
    assert classify("launcher.nproc", [one, two], accelerator=False)[0] == "exact"  # same 8 sequences
    kind, why = classify("launcher.nproc", [one, _variant(dp=2, ep=2)], accelerator=False)
    # the table's EP grows with the ranks: another partition, and torchtitan's experts run in bf16
    assert kind == "bf16" and "ep 1 -> 2" in why and "reorders each expert's rows" in why
    kind, why = classify("launcher.nproc", [_variant(), two], accelerator=False)
    assert kind == "any" and "global batch" in why  # 4 vs 8 sequences per step
    assert classify("launcher.nproc", [_variant(accum=4), _variant(dp=4)], accelerator=False)[0] == "bf16"
    assert classify("launcher.nproc", [one, _variant(dp=2, sharding="documents")], False)[0] == "any"
    assert classify("loss", [_variant(dtype="bfloat16")] * 2, accelerator=False)[0] == "bf16"
    assert classify("loss.num_chunks", [one, one], accelerator=False)[0] == "bf16"  # MoE: bf16 experts
    dense = _variant()
    dense.resolved.facts.num_experts = 0
    assert classify("loss.num_chunks", [dense, dense], accelerator=False)[0] == "fp32"
    assert classify("parallel.ep", [one, one], accelerator=False)[0] == "bf16"
    assert classify("optimizer.lr", [one, one], accelerator=False)[0] == "any"
    # another objective is a deliberate change; another kernel of the same one is not
    assert classify("loss", [_variant(loss="ce"), _variant(loss="linear_ce")], False)[0] == "bf16"
    assert classify("loss", [_variant(loss="ce"), _variant(loss="sft")], False)[0] == "bf16"
    kind, why = classify("loss", [_variant(loss="grpo"), _variant(loss="dapo")], False)
    assert kind == "any" and "dapo, grpo" in why
    assert classify("loss", [_variant(loss="ce"), _variant(loss="ppo")], False)[0] == "any"
    assert classify("loss.eps", [_variant(loss="grpo")] * 2, False)[0] == "any"
    assert classify("loss.temperature", [_variant(loss="grpo")] * 2, False)[0] == "any"
    assert classify("loss.entropy_coef", [_variant(loss="dapo")] * 2, False)[0] == "any"
    assert classify("loss.backend", [_variant(loss="grpo")] * 2, False)[0] == "bf16"
    assert classify("loss.z_loss", [_variant(loss="linear_ce")] * 2, False)[0] == "any"
    assert TOLERANCES["exact"].step0 == 0.0 and TOLERANCES["any"].step0 is None


def test_check_names_variant_metric_difference_and_tolerance():
    base = {"label": "loss=ce", "status": "ok", "steps": [1, 2], "loss": [5.0, 4.0], "grad_norm": [1.0, 1.0]}
    var = {"label": "loss=fast", "status": "ok", "steps": [1, 2], "loss": [5.0, 4.1], "grad_norm": [1.0, 1.0],
           "probe": None}
    var["diff"] = compare.differences(dict(base, probe=None), var)
    assert var["diff"]["loss_max_rel"] == pytest.approx(0.025)
    (v,) = compare.check(base, var, TOLERANCES["fp32"])
    assert v["message"] == ("loss=fast: loss curve (max rel over steps) differs by 2.500e-02 from loss=ce, "
                            "above the fp32 tolerance 0.001")
    assert compare.check(base, var, TOLERANCES["bf16"]) == []  # 2.5e-2 is within bf16's 5e-2 for curves
    assert compare.check(base, var, TOLERANCES["any"]) == []
    crashed = dict(var, status="crashed", returncode=1, log="w.log")
    assert compare.check(base, crashed, TOLERANCES["any"])[0]["metric"] == "run"


def test_tokens_per_s_ranks_variants_as_step_time_does():
    """Two steady steps each: a median of per-step tokens/s (the mean of 1/t) ranked these two opposite to
    their median step times (2.15 s vs 1.70 s, yet 1131 vs 591 tok/s); now tokens per step / median step time."""
    from toolkit.compare.running import summarize

    def recs(times, tokens=1000.0):
        return [{"step": i + 1, "loss": 1.0, "step_time_s": t, "tokens_per_s": tokens / t,
                 "tokens_per_s_per_gpu": tokens / t, "tflops_per_gpu": 2 * tokens / t} for i, t in enumerate([9, 9, 9, *times])]

    slow, fast = summarize(recs([0.5, 3.8])), summarize(recs([1.6, 1.8]))
    assert slow["step_time_s"] == pytest.approx(2.15) and fast["step_time_s"] == pytest.approx(1.7)
    assert slow["tokens_per_s"] == pytest.approx(1000 / 2.15) and fast["tokens_per_s"] == pytest.approx(1000 / 1.7)
    assert slow["tokens_per_s"] < fast["tokens_per_s"] and slow["tflops_per_gpu"] < fast["tflops_per_gpu"]


def test_another_data_parallel_size_holds_the_later_losses_to_the_norms_rounding(tmp_path, monkeypatch):
    """nproc=1,2 at one global batch: gradients bitwise, the grad norm summed over other shards; with clipping on,
    that norm scales each update, so the loss curve after step 1 moved by ~1e-7 and `--check` failed the exact
    curve (newcomer pass 6, compare.md's measured row). Without clipping the curve stays exact."""
    from toolkit.compare.args import parse_args
    from toolkit.compare.running import plan

    monkeypatch.chdir(tmp_path)
    argv = ["nproc=1,2", "training.global_batch=8", "parallel.ep=1", "training.steps=4", "training.seq_len=64", "--check"]
    p = plan(parse_args(argv))
    t = p.tolerance
    assert t.kind == "exact" and t.step0 == 0.0 and t.curve == 1e-5 and t.grad_norm == 1e-5
    assert "the clipping it sets moves the later steps' losses" in p.kind_reason
    t = plan(parse_args([*argv, "training.max_norm=inf"])).tolerance
    assert t.curve == 0.0 and t.grad_norm == 1e-5
