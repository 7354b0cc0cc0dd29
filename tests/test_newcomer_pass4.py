"""Newcomer pass 4 (issue 46's last condition; docs/newcomer_fourth_pass.md): what a new user on a CPU
machine met following README.md and docs/, each pinned. `train 2>&1 | head` (was: exit 1, nproc=2 a page
of tracebacks), `apiary plan gpu_memory=80` (was: 80 bytes, "OOM of 0.00 GiB", exit 0), a recipe's name
without `recipe=` (was: the parser's "missing EQUAL" under "recipe debug_moe"), `apiary logprobs` of a
publication's `latest` (was: "neither a HuggingFace model folder nor a run folder")."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from framework.errors import EXIT_BROKEN_PIPE, EXIT_PREEMPTED, UserError

from conftest import _child_env


def _read_then_close(argv: list[str], cwd, lines: int, merge_stderr: bool):
    """Start ``argv``, read ``lines`` lines of its stdout and close the pipe (`| head -N`); returns
    (exit code, what it wrote to stderr when not merged)."""
    p = subprocess.Popen(argv, cwd=cwd, env=_child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    for _ in range(lines):
        assert p.stdout.readline(), "the command ended before writing the lines a reader would read"
    p.stdout.close()
    err = b"" if merge_stderr else p.stderr.read()
    p.wait(timeout=300)
    return p.returncode, err.decode()


@pytest.mark.parametrize("merge_stderr", [True, False], ids=["2>&1 | head", "| head"])
def test_a_reader_that_leaves_a_training_run_ends_it_quietly(tmp_path, merge_stderr):
    """`train training.steps=... 2>&1 | head -3` (was: exit 1; rich's console of the progress lines said
    SystemExit(1), not the entry's own console): no traceback. Since newcomer pass 11 (#5) the run stops as on
    SIGTERM, 75 (tests/test_newcomer_pass11_io.py: its checkpoint and summary.json), and says so on stderr
    when stderr is not the closed pipe too."""
    argv = [sys.executable, "-m", "framework.cli", "train", "training.steps=40", "checkpoint.enable=false"]
    code, err = _read_then_close(argv, tmp_path, 3, merge_stderr)
    assert code == EXIT_PREEMPTED and "Traceback" not in err, (code, err)
    assert merge_stderr or ("stdout's reader left" in err and "checkpointing is off" in err), err


def test_the_supervisor_of_ranks_stops_them_when_its_output_pipe_closes(tmp_path):
    """`train nproc=2 | head -2` (was: rank 0 left, rank 1 failed in gloo with a traceback, torchrun's
    ChildFailedError after it, exit 1): the parent watches the pipe and stops torchrun and its ranks, as on SIGTERM
    (newcomer pass 11, #5: ranks that checkpoint exit 75, tests/test_newcomer_pass11_io.py); a stand-in that dies
    of the SIGTERM ends the run with 141."""
    child = tmp_path / "child.py"  # a stand-in for torchrun: one line, then busy for a minute
    child.write_text("import sys, time\nprint('step 1', flush=True)\ntime.sleep(60)\n")
    code = ("import sys\nfrom framework.launch.lifecycle import supervise\n"
            f"sys.exit(supervise([sys.executable, {str(child)!r}]))\n")
    start = time.monotonic()
    rc, err = _read_then_close([sys.executable, "-c", code], tmp_path, 1, merge_stderr=False)
    assert rc == EXIT_BROKEN_PIPE and "stdout's reader left" in err and "Traceback" not in err, (rc, err)
    assert time.monotonic() - start < 30  # not the stand-in's minute



def test_a_stop_asked_for_before_the_pipe_closes_still_checkpoints(tmp_path):
    """Ctrl-C on `train nproc=8 | tee log` ends tee too: the parent forwards the stop and, its pipe now
    closed, must still let the ranks write their checkpoint (was: killed within 0.5 s, exit 141, none)."""
    import signal

    from framework.launch.lifecycle import STATUS_ENV

    done = tmp_path / "checkpointed"
    child = tmp_path / "child.py"  # a stand-in for torchrun: on SIGTERM it takes 2 s to checkpoint, exits 75
    child.write_text("import os, signal, sys, time\n"
                     "def stop(*_):\n    time.sleep(2)\n"
                     f"    open({str(done)!r}, 'w').write('ok')\n"
                     f"    open(os.path.join(os.environ[{STATUS_ENV!r}], 'rank0'), 'w').write('{EXIT_PREEMPTED}')\n"
                     f"    sys.exit({EXIT_PREEMPTED})\n"
                     "signal.signal(signal.SIGTERM, stop)\nprint('step 1', flush=True)\ntime.sleep(60)\n")
    code = ("import sys\nfrom framework.launch.lifecycle import supervise\n"
            f"sys.exit(supervise([sys.executable, {str(child)!r}]))\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=_child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.readline()
    time.sleep(1.0)  # the parent's signal handlers are in place once its child runs
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    p.stdout.close()  # the reader (tee) is gone too
    p.wait(timeout=60)
    assert done.is_file(), p.stderr.read().decode()[-2000:]
    assert p.returncode == EXIT_PREEMPTED, p.returncode


@pytest.mark.parametrize("supervised, stopping, thread, training, exits", [
    (False, False, False, False, True),   # the main thread of a lone process: 141, as a console does
    (False, False, True, False, False),   # a transfer or notes thread: silenced, the process goes on
    (True, False, False, False, False),   # a supervised rank: silenced; the parent stops the run
    (False, True, False, False, False),   # a process stopping gracefully: its checkpoint first
    (False, False, False, True, False),   # a training loop: it stops as on SIGTERM (newcomer pass 11, #5)
])
def test_a_plain_print_into_a_closed_pipe_is_silenced_not_raised(monkeypatch, supervised, stopping, thread, training,
                                                                  exits):
    """A plain print (the sender's, the first step's notes, the publisher's) into a pipe whose reader left raised
    BrokenPipeError: a rank died alone, a transfer failed, a thread printed a traceback."""
    import threading

    from framework.launch import lifecycle, pipes

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(pipes, "silence", lambda: None)
    monkeypatch.setattr(pipes, "stop_requested", lambda: stopping)
    monkeypatch.setattr(pipes, "stop_training", lambda: training)
    if supervised:
        monkeypatch.setenv(lifecycle.STATUS_ENV, "/tmp/status")
    else:
        monkeypatch.delenv(lifecycle.STATUS_ENV, raising=False)
    out, seen = pipes._Guarded(Closed()), []

    def write():
        try:
            print("published weights step-3", file=out, flush=True)
            seen.append("went on")
        except SystemExit as e:
            seen.append(e.code)

    if thread:
        t = threading.Thread(target=write)
        t.start()
        t.join()
    else:
        write()
    assert seen == ([EXIT_BROKEN_PIPE] if exits else ["went on"]), seen

def test_a_bare_memory_number_is_not_taken_for_bytes(capsys):
    from toolkit.plan import plan_main

    # was: 80 bytes, "total 43.65 GiB of 0.00 GiB -> OOM", exit 0
    assert plan_main(["recipe=qwen35_35b_128k", "gpu_memory=80"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "gpu_memory=80: is 80 bytes" in err and "Write the unit: gpu_memory=80GiB" in err, err
    assert plan_main(["recipe=qwen35_35b_128k", "gpus_per_node=0"]) == 2
    assert "For example gpus_per_node=8." in capsys.readouterr().err  # was: gpus_per_node=32


@pytest.mark.parametrize("word,meant", [("debug_moe", "recipe=debug_moe"), ("chunked", "loss=chunked")])
def test_a_recipe_or_option_without_its_key_names_the_spelling_meant(word, meant):
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:  # `train debug_moe`, `apiary plan qwen35_35b_128k`
        resolve(None, [word], for_training=False)
    assert f"Write {meant}." in str(e.value) and "missing EQUAL" not in str(e.value), str(e.value)


def test_compare_names_a_bare_recipe_too():
    from toolkit.compare.args import parse_args

    with pytest.raises(UserError) as e:
        parse_args(["debug_moe", "loss=ce,linear_ce"])
    assert "Write recipe=debug_moe." in str(e.value), str(e.value)


@pytest.mark.parametrize("given", ["weights/latest", "weights"])
def test_logprobs_of_a_publication_names_its_latest_version(tmp_path, given):
    from toolkit.logprobs import load_model

    (tmp_path / "weights" / "step-7").mkdir(parents=True)
    (tmp_path / "weights" / "latest").write_text("step-7")
    with pytest.raises(UserError) as e:
        load_model(str(tmp_path / given), None, "cpu")
    msg = str(e.value)
    assert "`latest` names step-7" in msg and f"apiary logprobs {tmp_path / 'weights' / 'step-7'}" in msg, msg


def test_a_cp_that_does_not_divide_one_rank_says_one_rank():
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve(None, ["parallel.cp=3"], for_training=False, world_size=1)
    assert "does not divide the 1 rank left" in str(e.value), str(e.value)  # was: "the 1 ranks left"


def test_a_sequence_too_long_for_the_ranks_names_the_explicit_cp_that_fits():
    """Pass 4's #29: with too few ranks for the table's CP, "set parallel.cp explicitly" named no value (and
    read as useless on one rank); the refusal now names the CP that fits and the per-GPU sequence it
    accepts, and that override resolves."""
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve("qwen35_35b_128k", ["training.seq_len=262144"], for_training=False, world_size=2)
    msg = str(e.value)
    assert "the 2 ranks left" in msg and "set parallel.cp=2 to accept 131072 tokens per GPU" in msg, msg
    r = resolve("qwen35_35b_128k", ["training.seq_len=262144", "parallel.cp=2"], for_training=False, world_size=2)
    assert r.cfg.parallel.cp == 2
    with pytest.raises(UserError) as e:
        resolve("qwen35_35b_128k", ["training.seq_len=262144"], for_training=False, world_size=1)
    assert "the 1 rank left" in str(e.value) and "set parallel.cp=1 to accept 262144 tokens" in str(e.value)
