"""Cost of checkpoint integrity: the manifest's checksums at save and their verification at resume,
against the DCP save and load they guard. One process (one rank's share of a checkpoint).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/checkpoint_bench.py --mb 384 --repeat 3

It builds a state of float32 tensors (--mb in all, shaped like a model plus AdamW's two moments),
then per repeat: a plain ``dcp.save`` into step-N (the baseline), the same save through apiary's
atomic save (write aside; the checksums run in a background thread: framework/train/integrity.py), the
wait for those checksums and the rename (in training this overlaps the next steps), a
``dcp.load`` of it and ``integrity.verify`` of it. ``os.sync()`` before each timed save. Prints
medians and the checksum cost as a share of the save / load,
plus the raw speed of the candidate checksums on the same bytes. Files are read back from the page
cache as they would be right after a save; --dir puts them on another filesystem.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from framework.train import atomic_save, integrity


def make_state(mb: int) -> dict:
    per = max(1, mb // 3)  # parameters, exp_avg, exp_avg_sq
    n_tensors = 24
    numel = per * 2**20 // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    state = {}
    for part in ("model", "exp_avg", "exp_avg_sq"):
        state[part] = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n_tensors)}
    return state


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=384, help="state size in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")  # DCP's "no process group" notices: one process is the point here
    from torchtitan.components.checkpoint import AsyncMode

    state = make_state(a.mb)
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    root = Path(tempfile.mkdtemp(prefix="ckbench-", dir=a.dir))

    inner = []

    class Ckpt:  # the one method of torchtitan's CheckpointManager the atomic save wraps
        def dcp_save(self, sd, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
            inner.append(timed(lambda: dcp.save(sd, checkpoint_id=checkpoint_id)))

    atomic = Ckpt()
    saves = atomic_save.install_atomic_save(atomic)
    rows = {k: [] for k in ("save", "save_atomic", "overhead", "finish", "hash_at_save", "load", "verify")}
    try:
        dcp.save(state, checkpoint_id=str(root / "warmup"))  # first-call costs (imports, planner caches)
        shutil.rmtree(root / "warmup")
        for r in range(a.repeat):
            plain, ck = root / f"plain/step-{r}", root / "checkpoint"
            os.sync()  # each timed save starts with no dirty pages of the previous one
            rows["save"].append(timed(lambda: dcp.save(state, checkpoint_id=str(plain))))
            os.sync()
            rows["save_atomic"].append(timed(lambda: atomic.dcp_save(state, str(ck / f"step-{r}"),
                                                                     AsyncMode.DISABLED)))
            rows["overhead"].append(rows["save_atomic"][-1] - inner[-1])  # same call: no disk noise
            rows["finish"].append(timed(saves.finish))  # waits for the background checksums, renames
            body = __import__("json").loads((ck / f"step-{r}" / integrity.MANIFEST).read_text())
            rows["hash_at_save"].append(body["hash_s"])
            target = {p: {k: torch.empty_like(t) for k, t in part.items()} for p, part in state.items()}
            rows["load"].append(timed(lambda: dcp.load(target, checkpoint_id=str(ck / f"step-{r}"))))
            rows["verify"].append(timed(lambda: integrity.verify(ck / f"step-{r}", threads=1)))
            assert integrity.verify(ck / f"step-{r}") is None
            shutil.rmtree(plain)
        med = {k: statistics.median(v) for k, v in rows.items()}
        gb = nbytes / 1e9
        print(f"state {nbytes / 2**20:,.0f} MiB float32, {a.repeat} repeats (medians), "
              f"{os.cpu_count()} CPUs, checksum {integrity.ALGORITHM}, files under {root}")
        print(f"| {'phase':<34} | {'seconds':>8} | {'GB/s':>6} | {'share':>18} |")
        print(f"|{'-' * 36}|{'-' * 10}|{'-' * 8}|{'-' * 20}|")
        def line(name, s, share=""):
            print(f"| {name:<34} | {s:8.3f} | {gb / max(s, 1e-9):6.2f} | {share:>18} |")
        line("dcp.save (baseline)", med["save"])
        line("checksums at save (background)", med["hash_at_save"],
             f"{100 * med['hash_at_save'] / med['save']:.1f}% of the save")
        line("atomic save (blocks training)", med["save_atomic"])
        line("  of which not dcp.save", med["overhead"], f"{100 * med['overhead'] / med['save']:.1f}% of the save")
        line("  + background checksums, rename", med["finish"], "overlaps training")
        line("dcp.load (resume)", med["load"])
        line("verify at resume (1 thread)", med["verify"], f"{100 * med['verify'] / med['load']:.1f}% of the load")
        # the candidate checksums on the same bytes, from memory
        blob = (ck / "step-0" / "__0_0.distcp").read_bytes()
        print()
        print(f"| {'checksum (in memory, 1 core)':<34} | {'GB/s':>6} |")
        print(f"|{'-' * 36}|{'-' * 8}|")
        import xxhash

        for name, fn in (("xxh3_64 (used)", lambda: xxhash.xxh3_64(blob).digest()),
                         ("zlib.crc32", lambda: zlib.crc32(blob)), ("zlib.adler32", lambda: zlib.adler32(blob)),
                         ("hashlib.blake2b", lambda: hashlib.blake2b(blob).digest()),
                         ("hashlib.sha256", lambda: hashlib.sha256(blob).digest())):
            s = min(timed(fn) for _ in range(2))
            print(f"| {name:<34} | {len(blob) / s / 1e9:6.2f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
