"""Checkpoint integrity: each step folder carries a manifest (sizes + XXH3 checksums) written last,
the folder becomes visible (renamed to step-N) only when complete, and a resume verifies the step
it loads before any worker starts. A flipped byte, a truncated or a deleted file exits 2 naming the
step, the file and checkpoint.load_step=PREVIOUS; a save killed midway is ignored."""

import json
import shutil
import time
from pathlib import Path

import pytest

from framework.train import atomic_save, integrity

from conftest import train_here

SMALL = ["recipe=debug_moe", "training.seq_len=64", "model.n_layers=1", "checkpoint.interval=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 4-step run with checkpoints at steps 2 and 4 (copied by each test)."""
    root = tmp_path_factory.mktemp("trained")
    p = train_here(["train", *SMALL, "training.steps=4", "output_dir=run"], root)
    assert p.returncode == 0, p.stderr[-3000:]
    return root / "run"


@pytest.fixture
def run(trained, workdir):
    dst = workdir / "run"
    shutil.copytree(trained, dst)
    return dst


def _snapshot(run_dir: Path) -> dict:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in (run_dir / "checkpoint").rglob("*")
            if p.is_file()}


def test_saves_are_complete_folders_with_a_manifest(trained):
    ck = trained / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-4"]  # no .partial-N left
    for step in (2, 4):
        body = json.loads((ck / f"step-{step}" / "manifest.json").read_text())
        assert body["step"] == step and body["algorithm"] == "xxh3_64"
        assert set(body["files"]) == {".metadata", "__0_0.distcp"}
        assert body["files"]["__0_0.distcp"]["size"] == (ck / f"step-{step}" / "__0_0.distcp").stat().st_size
        assert integrity.verify(ck / f"step-{step}") is None


def _resume(capsys, run_dir, *extra):
    """Two steps more than the 4 it was trained for, the schedule stretched over them (lr.total_steps)."""
    return train_here(["train", *SMALL, "training.steps=6", "lr.total_steps=6", f"output_dir={run_dir}",
                       "checkpoint.resume=true", *extra], run_dir.parent, capsys)


def _resolve_error(run_dir, *extra) -> str:
    import os

    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    os.environ.pop(integrity.VERIFIED_ENV, None)
    with pytest.raises(UserError) as e:
        resolve("debug_moe", [*SMALL[1:], "training.steps=6", f"output_dir={run_dir}", "checkpoint.resume=true",
                              *extra])
    return str(e.value)


def _refused(p, run_dir, file, what):
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    err = " ".join(p.stderr.split())
    assert "Traceback" not in p.stderr
    assert "checkpoint.resume=true: checkpoint step 4 is corrupt:" in err, err
    assert f"step-4/{file} {what}" in err, err
    assert "checkpoint.load_step=2" in err, err
    assert not (run_dir / "checkpoint" / "step-6").exists()


def test_flipped_byte_is_refused_and_load_step_resumes_the_previous_step(run, capsys):
    f = run / "checkpoint" / "step-4" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the tensor data
    f.write_bytes(bytes(data))
    before = _snapshot(run)
    p = _resume(capsys, run)
    _refused(p, run, "__0_0.distcp", "has checksum")
    assert _snapshot(run) == before  # nothing already saved is lost or changed
    # the fix the message names: resume from step 2; step 4 is trained again and replaces the bad copy
    p = _resume(capsys, run, "checkpoint.load_step=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step     3/6" in p.stdout
    assert "checkpoint step-4 replaces the step-4 saved before it" in p.stdout  # said, not silent
    for step in (2, 4, 6):
        assert integrity.verify(run / "checkpoint" / f"step-{step}") is None
    assert not list((run / "checkpoint").glob(".partial-*"))


@pytest.mark.parametrize("damage, file, what", [
    ("truncate", "__0_0.distcp", "has "),
    ("delete", "__0_0.distcp", "is missing"),
    ("delete", ".metadata", "is missing"),
    ("extra", "__9_0.distcp", "is not in the manifest"),
])
def test_truncated_deleted_or_extra_file_is_refused(run, damage, file, what):
    f = run / "checkpoint" / "step-4" / file
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
        what = "has "  # "... has N bytes, the manifest says M (truncated or overwritten)"
    elif damage == "delete":
        f.unlink()
    else:
        f.write_bytes(b"x")
    before = _snapshot(run)
    err = _resolve_error(run)  # the launching process's check, in-process (the CLI path: the flipped byte)
    assert f"checkpoint step 4 is corrupt: {run / 'checkpoint' / 'step-4' / file} {what}" in err, err
    assert "checkpoint.load_step=2" in err
    if damage == "truncate":
        assert "truncated or overwritten" in err
    assert _snapshot(run) == before


def test_a_step_folder_copied_over_another_is_refused(run):
    """step-2 copied onto step-4: every file matches the copied manifest, but it holds step 2 (was:
    "step-4 verified ... training from step 5" on step 2's weights and data position)."""
    ck = run / "checkpoint"
    shutil.rmtree(ck / "step-4")
    shutil.copytree(ck / "step-2", ck / "step-4")
    before = _snapshot(run)
    err = " ".join(_resolve_error(run, "lr.total_steps=6").split())
    assert f"{ck / 'step-4'} holds the checkpoint of step 2, not step 4" in err, err
    assert "copied or renamed from step-2" in err and "checkpoint.load_step=2" in err, err
    assert _snapshot(run) == before  # everything saved is kept
    err = " ".join(_resolve_error(run, "lr.total_steps=6", "checkpoint.load_step=4").split())
    assert "holds the checkpoint of step 2, not step 4" in err, err


def test_save_killed_midway_is_ignored_and_cleaned_by_the_next_save(run, capsys):
    ck = run / "checkpoint"
    # a save of step 6 killed after writing its data: it never got its manifest nor its name
    shutil.copytree(ck / "step-4", ck / ".partial-6")
    (ck / ".partial-6" / "manifest.json").unlink()
    from framework.resolve.outputs import checkpoint_steps

    assert checkpoint_steps(run) == [2, 4]
    assert integrity.check_resume(run, None, "checkpoint.resume=true") == 4
    p = _resume(capsys, run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step     5/6" in p.stdout
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-2]["step"] == 5 and records[-1]["step"] == 6  # resumed from step 4
    assert not (ck / ".partial-6").exists()  # the next save removed the dead partial
    assert integrity.verify(ck / "step-6") is None and (ck / "step-6" / "manifest.json").is_file()


def test_a_crash_inside_the_save_leaves_the_previous_steps_intact(tmp_path):
    """The atomic save itself: the writer dies after some files; nothing named step-N appears."""
    from torchtitan.components.checkpoint import AsyncMode

    ck = tmp_path / "checkpoint"
    (ck / "step-2").mkdir(parents=True)
    (ck / "step-2" / "a.distcp").write_bytes(b"good")
    integrity.write_manifest(ck / "step-2", 2, integrity.entries(ck / "step-2", ["a.distcp"]))

    class Crash(Exception):
        pass

    def dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        Path(checkpoint_id, "a.distcp").write_bytes(b"half")
        if state_dict.get("crash"):
            raise Crash
        Path(checkpoint_id, ".metadata").write_bytes(b"meta")

    fake = type("Ckpt", (), {})()
    fake.dcp_save = dcp_save
    atomic = atomic_save.install_atomic_save(fake)
    with pytest.raises(Crash):
        fake.dcp_save({"crash": True}, str(ck / "step-4"), AsyncMode.DISABLED)
    atomic.finish()
    assert integrity.complete_steps(ck) == [2] and (ck / ".partial-4").is_dir()
    assert integrity.verify(ck / "step-2") is None
    fake.dcp_save({}, str(ck / "step-4"), AsyncMode.DISABLED)  # the next save completes and tidies up
    assert not (ck / "step-4").exists()  # written, but visible only once its checksums are in
    atomic.finish()
    assert integrity.complete_steps(ck) == [2, 4] and not (ck / ".partial-4").exists()
    assert not list((ck / "step-4").glob("manifest.json.rank*"))
    assert set(json.loads((ck / "step-4" / "manifest.json").read_text())["files"]) == {"a.distcp", ".metadata"}


def test_a_half_written_step_of_an_older_version_is_refused_not_overwritten(run):
    """step-N without .metadata or manifest (an older apiary killed mid-save): kept, and named."""
    half = run / "checkpoint" / "step-6"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half")
    err = _resolve_error(run)
    assert f"{half} is incomplete or corrupt" in err and "checkpoint.load_step=4" in err
    assert (half / "__0_0.distcp").read_bytes() == b"half"


def test_load_step_must_name_a_complete_step(run):
    err = _resolve_error(run, "checkpoint.load_step=3")
    assert "checkpoint.load_step=3" in err and "complete steps: 2, 4" in err


def test_corrupt_load_path_is_refused(run):
    step = run / "checkpoint" / "step-2"
    (step / "__0_0.distcp").write_bytes(b"")
    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve("debug_moe", [f"checkpoint.load_path={step}", f"output_dir={run.parent / 'fresh'}"])
    assert f"checkpoint.load_path={step}" in str(e.value) and "the checkpoint is corrupt" in str(e.value)


def test_checksum_algorithms_agree_on_the_bytes(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(256)) * 40000)  # 10 MB: more than one read block
    import zlib

    import xxhash

    assert integrity.file_digest(f, "crc32") == f"{zlib.crc32(f.read_bytes()):08x}"
    assert integrity.file_digest(f, "xxh3_64") == xxhash.xxh3_64(f.read_bytes()).hexdigest()


def test_ranks_writing_their_parts_at_once_each_keep_their_own(tmp_path, monkeypatch):
    """Every rank hashes its share and writes manifest.json.rankR at the same time, in the same
    folder: each part goes through its own temporary file, so a rank lagging between writing and
    renaming its part neither loses it nor takes another rank's."""
    import threading

    folder = tmp_path / ".partial-4"
    folder.mkdir()
    files = ["__0_0.distcp", "__1_0.distcp", ".metadata"]
    for i, name in enumerate(files):
        (folder / name).write_bytes(bytes([i]) * (100 + i))
    replace, gate, first = integrity.os.replace, threading.Event(), []

    def lagging_replace(src, dst):  # the first rename (rank 1's part) waits until rank 0's is done
        if not first:
            first.append(src)
            assert gate.wait(30)
        return replace(src, dst)

    monkeypatch.setattr(integrity.os, "replace", lagging_replace)
    r1 = atomic_save._Pending(4, folder, tmp_path / "step-4", sorted(files), 1, 2, 0.0)
    while not first:
        time.sleep(0.01)
    r0 = atomic_save._Pending(4, folder, tmp_path / "step-4", sorted(files), 0, 2, 0.0)
    r0.thread.join(30)
    gate.set()
    r1.thread.join(30)
    assert r0.error is None and r1.error is None, (r0.error, r1.error)
    assert r0.ready()
    r0.finish()
    assert integrity.verify(tmp_path / "step-4") is None
    body = json.loads((tmp_path / "step-4" / "manifest.json").read_text())
    assert sorted(body["files"]) == sorted(files)


def _failing_rank_worker(rank: int, port: int, out: str) -> None:
    """Two gloo ranks save once; rank 1's hashing fails. Rank 0 records what its close did."""
    import io
    import os
    import sys

    import torch.distributed as dist
    from torchtitan.components.checkpoint import AsyncMode

    from framework.train import atomic_save, integrity

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ck = Path(out) / "checkpoint"

    def dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        Path(checkpoint_id, f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
        if rank == 0:
            Path(checkpoint_id, ".metadata").write_bytes(b"meta")

    fake = type("Ckpt", (), {})()
    fake.dcp_save = dcp_save
    atomic = atomic_save.AtomicSaves(fake, wait_s=60)
    if rank == 1:
        def broken(folder, files, *a, **k):
            raise OSError(28, "No space left on device")

        integrity.entries = broken
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        fake.dcp_save({}, str(ck / "step-2"), AsyncMode.DISABLED)
        t0 = time.monotonic()
        atomic.finish()  # the trainer's close
        seconds = time.monotonic() - t0
    finally:
        text, sys.stderr = sys.stderr.getvalue(), err
    Path(out, f"rank{rank}.json").write_text(json.dumps({"stderr": text, "seconds": seconds}))
    dist.destroy_process_group()


def test_a_rank_that_cannot_hash_its_share_is_reported_and_not_waited_for(tmp_path):
    """Rank 1's checksums fail (disk full): it says so, and rank 0's close reports rank 1's error
    at once and leaves the step invisible, instead of waiting for a part that cannot come."""
    from conftest import free_port, spawn_ranks

    spawn_ranks(_failing_rank_worker, 2, free_port(), str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert "rank 1 could not compute its checksums" in r1["stderr"] and "No space left" in r1["stderr"]
    assert "checkpoint step 2: rank 1 could not compute its checksums" in r0["stderr"], r0["stderr"]
    assert "No space left on device" in r0["stderr"] and "stays incomplete" in r0["stderr"]
    assert r0["seconds"] < 30  # not the 60 s wait for a part
    ck = tmp_path / "checkpoint"
    assert integrity.complete_steps(ck) == [] and (ck / ".partial-2").is_dir()
