"""The atomic save: torchtitan's checkpointer writes each step into ``checkpoint/.partial-N``; every
rank hashes its share of the files in a background thread, global rank 0 merges them into the
manifest and renames the folder to ``step-N`` once every share arrived (framework/train/integrity.py
describes the manifest and its verification).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from framework import compat
from framework.resolve import disk
from framework.train import disk_full, integrity


# -- the atomic save -----------------------------------------------------------------------
def _cpu_group():
    """A gloo group for the barriers (the default group when it is gloo)."""
    import torch.distributed as dist  # reason: start-up time (the CLI reads manifests without torch)

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if "gloo" in str(dist.get_backend()):
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


class _Pending:
    """One save written into .partial-N whose checksums are being computed in the background."""

    def __init__(self, step: int, tmp: Path, final: Path, files: list[str], rank: int, world: int, save_s: float,
                 model_only: bool = False, keep: int = 0):
        self.step, self.tmp, self.final, self.rank, self.world, self.save_s = step, tmp, final, rank, world, save_s
        self.model_only, self.keep = model_only, keep
        self.error: BaseException | None = None
        self.thread = __import__("threading").Thread(target=self._hash, args=(files,), daemon=True,
                                                     name=f"apiary-manifest-{step}")
        self.thread.start()

    def _hash(self, files: list[str]) -> None:
        try:
            t = time.perf_counter()
            mine = integrity.entries(self.tmp, files[self.rank::self.world])
            self._write_part({"files": mine, "hash_s": time.perf_counter() - t})
        except BaseException as e:  # reported by finish() on rank 0; the step then stays invisible
            self.error = e
            if self.rank != 0:  # tell rank 0 (waiting for this part) that it will not come
                print(f"apiary: checkpoint step {self.step}: rank {self.rank} could not compute its checksums "
                      f"({e!r}); the step stays incomplete in {self.tmp}", file=sys.stderr, flush=True)
                try:
                    self._write_part({"error": repr(e)})
                except BaseException:  # the folder itself is gone or unwritable: rank 0 times out
                    pass

    def _write_part(self, body: dict) -> None:
        part = self.tmp / f"{integrity.MANIFEST}.rank{self.rank}"
        tmp = self.tmp / f"{integrity.MANIFEST}.rank{self.rank}.tmp"  # one per rank: the ranks write at the same time
        tmp.write_text(json.dumps(body))
        os.replace(tmp, part)  # a part appears whole

    def parts(self) -> list[Path]:
        return [self.tmp / f"{integrity.MANIFEST}.rank{r}" for r in range(self.world)]

    def ready(self) -> bool:
        if self.rank != 0:
            return not self.thread.is_alive()
        return all(p.is_file() for p in self.parts())

    def finish(self) -> bool:
        """Rank 0: merge the ranks' parts into manifest.json, rename .partial-N to step-N (True once
        renamed; other ranks: whether their share was hashed), then delete the complete steps before it
        beyond ``keep`` (checkpoint.keep_latest_k, counting this one: integrity.prune)."""
        if self.rank != 0:
            return self.error is None
        if self.error is not None:
            print(f"apiary: checkpoint step {self.step}: computing its manifest failed ({self.error}); the step "
                  f"stays incomplete in {self.tmp}", file=sys.stderr, flush=True)
            return False
        merged, hash_s = {}, 0.0
        for r, p in enumerate(self.parts()):
            body = json.loads(p.read_text())
            if "error" in body:
                print(f"apiary: checkpoint step {self.step}: rank {r} could not compute its checksums "
                      f"({body['error']}); the step stays incomplete in {self.tmp}", file=sys.stderr, flush=True)
                return False
            merged.update(body["files"])
            hash_s = max(hash_s, body["hash_s"])
        integrity.write_manifest(self.tmp, self.step, merged, model_only=self.model_only, save_s=self.save_s,
                                 hash_s=hash_s)
        for p in self.parts():
            p.unlink()
        aside = self.final.parent / f"{integrity.PARTIAL}replaced-{self.step}"
        if self.final.exists():  # re-saving a step (e.g. after checkpoint.load_step): replace it whole
            os.rename(self.final, aside)
            print(f"checkpoint step-{self.step} replaces the step-{self.step} saved before it (this run went on "
                  "from an earlier step)", flush=True)
        os.rename(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        shutil.rmtree(aside, ignore_errors=True)
        integrity.prune(self.final.parent, self.step, self.keep)  # only now: the newest complete step stays
        return True


class AtomicSaves:
    """Wraps a torchtitan CheckpointManager (on the instance): ``dcp_save`` writes into
    ``.partial-N``; each rank then hashes its share of the files in a background thread (the
    training goes on) and leaves ``manifest.json.rankR``; global rank 0 merges the parts into
    ``manifest.json`` and renames the folder to ``step-N`` at the first ``save()`` call (torchtitan
    calls it at every step boundary) after all parts are there, and at the latest in ``finish()``
    (the trainer's close). No collective is involved after the save's own barrier, so a rank that
    stops early never blocks the others. A rank whose hashing fails says so and leaves an error
    part instead, so rank 0 names that rank and its error at once and the step stays invisible.
    Every rank must construct this, in the same order. ``keep``: checkpoint.keep_latest_k, applied here
    once a step is complete (torchtitan's own purge, which ran before the rename, is given 0)."""

    def __init__(self, checkpointer, before_save=None, wait_s: float = 600.0, keep: int = 0):
        self.ck, self.before_save, self.wait_s, self.keep = checkpointer, before_save, wait_s, keep
        import torch.distributed as dist  # reason: start-up time (the CLI reads manifests without torch)

        self.group = _cpu_group()
        self.rank = dist.get_rank() if self.group is not None else 0
        self.world = dist.get_world_size() if self.group is not None else 1
        self.pending: list[_Pending] = []
        self.landed: set[int] = set()  # steps finish() renamed to step-N (rank 0), or hashed its share (others)
        self._dcp_save, self._save = compat.wrap_checkpoint_saves(checkpointer, self.dcp_save, self.save)
        checkpointer._apiary_atomic = self

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist  # reason: start-up time (the CLI reads manifests without torch)

            dist.barrier(group=self.group)

    def poll(self, wait: bool = False) -> None:
        """Finish the pending saves that are ready, in step order (``wait``: all of them, or give up
        after ``wait_s`` and leave the step incomplete)."""
        deadline = time.monotonic() + self.wait_s
        while self.pending:
            head = self.pending[0]
            if wait:
                head.thread.join(max(0.0, deadline - time.monotonic()))
                while not head.ready() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if not head.ready():
                if wait:
                    print(f"apiary: checkpoint step {head.step}: not every rank's checksums arrived in "
                          f"{self.wait_s:.0f} s; the step stays incomplete in {head.tmp}", file=sys.stderr, flush=True)
                    self.pending.clear()
                return
            if head.finish():
                self.landed.add(head.step)
            self.pending.pop(0)

    def save(self, curr_step, last_step=False):
        self.poll()
        return self._save(curr_step, last_step=last_step)

    def finish(self) -> None:
        self.poll(wait=True)

    def complete(self, step: int) -> bool:
        """Every rank, together (a stop after a save: nothing may claim the step before it is
        visible): wait for the pending saves to become step-N now, rather than at the next step
        boundary, and return on every rank whether ``step`` did (rank 0's answer, all-reduced)."""
        self.finish()
        ok = step in self.landed
        if self.group is not None:
            import torch  # reason: start-up time (the CLI reads manifests without torch)
            import torch.distributed as dist  # reason: as above

            t = torch.tensor([int(ok)], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            ok = bool(t.item())
        return ok

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        from torchtitan.components.checkpoint import TRAIN_STATE, AsyncMode  # reason: start-up time of the CLI (~0.4s)

        if self.before_save is not None:
            self.before_save()
        m = integrity.STEP_RE.fullmatch(Path(checkpoint_id).name)
        if async_mode != AsyncMode.DISABLED or m is None:  # apiary saves synchronously to step-N
            return self._dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step, final = int(m.group(1)), Path(checkpoint_id)
        tmp = final.parent / f"{integrity.PARTIAL}{step}"
        if self.rank == 0:
            busy = {p.tmp for p in self.pending}
            for stale in final.parent.glob(f"{integrity.PARTIAL}*"):  # saves killed midway: never visible, now gone
                if stale not in busy:
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        self._barrier()
        t0 = time.perf_counter()
        try:
            result = self._dcp_save(state_dict, str(tmp), async_mode, enable_garbage_collection, to_hf)
        except BaseException as e:  # DCP raises on every rank (its all-reduce of the ranks' write results)
            full = None if disk.stops_here(e) else disk.full_errno(e)
            if full is None and (disk.stops_here(e) or not disk.nearly_full(tmp)):
                raise
            written, room = disk_full.folder_bytes(tmp), disk.room_text(final.parent.parent, has="had")  # before any removal
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # room for the earlier save's manifest and the summary
            try:
                self.finish()  # an earlier save still being hashed becomes step-N, if its manifest fits
            except Exception:
                pass
            removed = [f"checkpoint/{tmp.name}"]
            if self.rank == 0:  # what stayed incomplete: never visible to a resume
                removed += [r for r in disk_full.drop_partials(final.parent) if r not in removed]
            raise disk_full.error(final.parent.parent, step=step, saving=step, written=written, removed=removed,
                                  err=full, room=room) from None
        self._barrier()  # every rank's files (and DCP's .metadata) are written
        self.pending.append(_Pending(step, tmp, final, integrity.list_files(tmp), self.rank, self.world,
                                     time.perf_counter() - t0, model_only=TRAIN_STATE not in state_dict,
                                     keep=self.keep))
        return result


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def complete_save(checkpointer, step: int) -> bool | None:
    """After a save of ``step`` (every rank): whether it is now complete as ``step-N`` (waits for its
    manifest and rename); None for a checkpointer without apiary's atomic save."""
    atomic = getattr(checkpointer, "_apiary_atomic", None)
    return None if atomic is None else atomic.complete(step)


def install_atomic_save(checkpointer, before_save=None, keep: int = 0) -> AtomicSaves:
    existing = getattr(checkpointer, "_apiary_atomic", None)
    return existing if existing is not None else AtomicSaves(checkpointer, before_save, keep=keep)
