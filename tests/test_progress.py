"""The run's console (framework/report/progress.py, fed by metrics.py's JsonlLogger): plain lines with
elapsed and ETA when piped, a live line redrawn in place in a terminal (a real training inside
tmux), the third-party lines dropped at their source while other warnings still show, and the
device peaks MFU is measured against."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest
from rich.console import Console

from framework.report import progress

from conftest import ROOT


def _records():
    base = {"grad_norm": 1.5, "tokens_per_s": 2048.0, "peak_mem_bytes": 2**30, "peak_mem_kind": "cpu_max_rss"}
    # step_time_s is torchtitan's own (from its last log to this one); the ETA uses the wall clock
    return [{**base, "step": 1, "loss": 6.0, "step_time_s": 10.0},
            {**base, "step": 2, "loss": 5.5, "step_time_s": 2.5},
            {**base, "step": 3, "loss": 5.0, "step_time_s": 2.5, "val_loss": 5.25}]


def test_piped_output_is_one_plain_line_per_step_with_elapsed_and_eta(capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # a pipe stays plain even when colour is forced
    clock = iter([0.0, 10.0, 12.0, 14.0, 15.0])
    p = progress.Progress(5, clock=lambda: next(clock))
    assert not p.live_mode
    for rec in _records():
        p.log(rec)
    p.log_validation({"step": 3, "val_loss": 5.25, "val_tokens_per_s": 900.0})
    p.close()
    out = capsys.readouterr().out
    assert "\x1b" not in out
    # ETA: step 1 has only its own time (4 x 10 s); later, the wall time per step since step 1 (2 s)
    assert out.splitlines() == [
        "step     1/5  loss 6.0000  grad_norm 1.500  2,048 tok/s  peak 1.00 GiB max RSS  10.000 s/step  "
        "elapsed 0:10  ETA 0:40",
        "step     2/5  loss 5.5000  grad_norm 1.500  2,048 tok/s  peak 1.00 GiB max RSS  2.500 s/step  "
        "elapsed 0:12  ETA 0:06",
        "step     3/5  loss 5.0000  val_loss 5.2500  grad_norm 1.500  2,048 tok/s  peak 1.00 GiB max RSS  "
        "2.500 s/step  elapsed 0:14  ETA 0:04",
        "validation at step 3: val_loss 5.2500  900 tok/s  elapsed 0:15",
    ]


def test_slurm_is_plain_even_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    console = Console(file=Tty(), force_terminal=True)
    assert progress.interactive(console)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert not progress.interactive(console)


def test_live_line_redraws_in_place():
    buf, now = io.StringIO(), [0.0]
    p = progress.Progress(5, console=Console(file=buf, force_terminal=True, width=100), live=True,
                          clock=lambda: now[0])
    p.REFRESH_PER_S = 0.1  # refreshed by each record here
    for t, rec in zip((10.0, 12.0), _records()):
        now[0] = t
        p.log(rec)
    now[0] = 13.0  # between records the line counts down
    assert p.live_text() == "40%  elapsed 0:13  ETA 0:05  2,048 tok/s  loss 5.5000"
    p.close()
    out = buf.getvalue()
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert out.count("\r\x1b[2K") >= 3  # the live line is erased and redrawn in place, not appended
    lines = [ln for ln in plain.replace("\r", "\n").splitlines() if ln.strip()]
    assert [ln for ln in lines if ln.startswith("step     ")] == [
        "step     1/5  loss 6.0000  grad_norm 1.500  2,048 tok/s  peak 1.00 GiB max RSS  10.000 s/step",
        "step     2/5  loss 5.5000  grad_norm 1.500  2,048 tok/s  peak 1.00 GiB max RSS  2.500 s/step"]
    assert lines[-1] == "step 2/5 ━━━━━━━━━━────────────── 40%  elapsed 0:13  ETA 0:05  2,048 tok/s  loss 5.5000"


def test_log_filter_drops_only_torchtitan_noise(caplog):
    from framework.train import run

    log = logging.getLogger()  # torchtitan logs on the root logger
    noise = ["Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use device_name",
             "Peak flops undefined for: cpu, fallback to A100",
             "model.safetensors.index.json not found at hf_assets_path: /r/model.safetensors.index.json.",
             "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
             "ENV[TORCH_FR_BUFFER_SIZE] = 0 will be overridden to 0 based on job config"]
    real = ["ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 0 will be overridden to 3 based on job config",
            "1 CUDA memory allocation retries."]
    try:
        run.quiet_third_party(verbose=False)
        with caplog.at_level(logging.WARNING):
            for msg in noise + real:
                log.warning(msg)
        assert [r.getMessage() for r in caplog.records] == real
        caplog.clear()
        run.quiet_third_party(verbose=True)  # train -v: everything
        with caplog.at_level(logging.WARNING):
            for msg in noise:
                log.warning(msg)
        assert [r.getMessage() for r in caplog.records] == noise
    finally:
        run.quiet_third_party(verbose=True)


def test_fla_cpu_warning_is_ignored_and_others_show():
    from framework import devices

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        devices.quiet_warnings()
        warnings.warn("Triton is not supported on current platform, roll back to CPU.", stacklevel=1)
        warnings.warn("a real warning", stacklevel=1)
    assert [str(w.message) for w in seen] == ["a real warning"]


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H200", 989),
                                          ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
                                          ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA B200", 2250),
                                          ("NVIDIA L4", None), ("cpu", None)])
def test_device_peaks(name, tflops):
    from framework import devices

    got = devices.peak_flops(name)
    assert (got / 1e12 if got else None) == tflops


NOISE = ("lspci", "fallback to A100", "safetensors.index.json", "0 kernels tuned", "{'dp_replicate'",
         "TFLOPs/GPU", "Traceback", "Triton is not supported")
LIVE = re.compile(r"^step (\d)/2 \S+ +\d+%  elapsed \d+:\d\d  ETA \d+:\d\d  [\d,]+ tok/s  loss \d\.\d{4}$")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_terminal_shows_the_live_line_in_place(tmp_path):
    """A real 2-step CPU training in a tmux pane (a terminal): while it trains, the pane's last line
    is the live progress line (24 layers, so that step 2, the only step the live line is up for,
    lasts long enough to be seen: a one-process run has no closing wait after it); when it ends,
    the pane's history holds that line once (redrawn in place), the per-step lines, the summary,
    and none of the dropped noise."""
    out, session = tmp_path / "run", f"apiary-test-{tmp_path.name}"
    cmd = (f"cd {tmp_path} && env -u COLUMNS -u LINES PYTHONPATH={ROOT} {sys.executable} -m framework.cli training.steps=2 "
           f"training.seq_len=64 model.n_layers=24 logging.tensorboard=false checkpoint.enable=false output_dir={out}; "
           "echo __EXIT__$?; sleep 600")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd], check=True)
    live_seen, screen = [], ""
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            lines = [ln.rstrip() for ln in screen.splitlines() if ln.strip()]
            if "__EXIT__" in screen:
                break
            if lines and LIVE.match(lines[-1]):
                live_seen.append(lines[-1])
            time.sleep(0.25)
        history = subprocess.run(["tmux", "capture-pane", "-p", "-S", "-", "-t", session], capture_output=True,
                                 text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "__EXIT__0" in history, history[-3000:]
    assert live_seen, screen  # the live line at the bottom while training ran
    hist = [ln.rstrip() for ln in history.splitlines()]
    assert len([ln for ln in hist if LIVE.match(ln)]) == 1, history  # redrawn in place, left once at the end
    assert [ln for ln in hist if LIVE.match(ln)][0].startswith("step 2/2")
    assert [int(m.group(1)) for ln in hist if (m := re.match(r"step +(\d)/2  loss", ln))] == [1, 2]
    assert "run summary" in history and "MFU           n/a (no known peak for cpu)" in history
    assert "dp_shard 1 · cp 1" in history
    for s in NOISE:
        assert s not in history, s
    assert not (out / "comm_traces").exists()
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert not [k for k in last if k.startswith("plan_")]  # no GPU estimate next to a CPU's RSS
    assert last["tflops_per_gpu"] is None and last["mfu_pct"] is None and last["device"] == "cpu"
    s = json.loads((out / "summary.json").read_text())
    assert s["step"] == 2 and s["checkpoint"] is None and "checkpoint    none saved" in history
    assert s["tokens"] == 2 * last["tokens"] == 2 * 64 * 4  # seq 64 x local batch 4 each step
