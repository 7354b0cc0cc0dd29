"""The frozen base of an adapter run: where it comes from, its fingerprint, and the resume check.

An adapter checkpoint holds the adapters (and their optimizer state) only; the base is named by a
pointer written beside them (``BASE_FILE`` in every ``checkpoint/step-N``):

- ``hf``: the folder ``model.hf_checkpoint``, with the size, mtime and xxh3-64 checksum of each
  of its weight files and config.json;
- ``dcp``: the step folder ``checkpoint.load_path``, with the checksums of its manifest (apiary's
  atomic save) or of its files;
- ``seed``: weights initialised from ``training.seed`` (family, flavor, layers, vocabulary).

Every pointer also records a checksum of the base weights as the run holds them in memory (a sum
of squares and two position-weighted sums per tensor, float64, summed over ranks), computed after
the base is loaded. A resume compares the pointer before launch (a file changed: exit 2 naming
it) and the in-memory checksum after loading (exit 2 on a mismatch, e.g. a seed base that another
torch version initialises differently).

Hashing an HF folder reads every weight file once per launch: a file whose size and mtime are those
recorded (by this process's parent or the checkpoint's pointer) keeps its recorded checksum.
No torch at module level (the pre-launch check runs without it).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from framework.errors import UserError

BASE_FILE = "adapter_base.json"
ENV = "APIARY_ADAPTER_BASE"  # the pointer the launching process computed, for its workers
_CHUNK = 8 << 20


def _digest(path: Path) -> str:
    try:
        import xxhash  # a datasets dependency (framework/train/integrity.py uses it too)

        h = xxhash.xxh3_64()
        update, out = h.update, h.hexdigest
    except ImportError:  # pragma: no cover
        state = [0]

        def update(b):
            state[0] = zlib.crc32(b, state[0])

        def out():
            return f"crc32:{state[0]:08x}"
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            update(view[:n])
    return out()


def _files(folder: Path, names: list[str], previous: dict | None) -> dict:
    """{name: {size, mtime_ns, hash}}; a file whose size and mtime match ``previous`` keeps its hash."""
    previous = previous or {}

    def one(name):
        st = (folder / name).stat()
        old = previous.get(name)
        if old and old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns:
            return name, dict(old)
        return name, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "hash": _digest(folder / name)}

    with ThreadPoolExecutor(min(8, max(1, len(names)))) as pool:
        return dict(pool.map(one, sorted(names)))


def pointer(cfg, previous: dict | None = None) -> dict:
    """The base this recipe trains adapters on, with its fingerprint (``previous``: a pointer whose
    unchanged files need not be hashed again)."""
    prev_files = (previous or {}).get("files")
    load_path = cfg.checkpoint.get("load_path")
    if load_path:
        folder = Path(load_path).resolve()
        manifest = folder / "manifest.json"
        if manifest.is_file():  # apiary's atomic save: its checksums are the fingerprint
            files = {k: {"size": v["size"], "hash": v["hash"]} for k, v in json.loads(manifest.read_text())["files"].items()}
        else:
            files = _files(folder, [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()],
                           prev_files)
        return {"kind": "dcp", "key": "checkpoint.load_path", "path": str(folder), "files": files}
    hf = cfg.model.get("hf_checkpoint")
    if hf:
        folder = Path(hf).resolve()
        names = [p.name for p in folder.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name in (
            "config.json", "model.safetensors.index.json"))]
        return {"kind": "hf", "key": "model.hf_checkpoint", "path": str(folder), "files": _files(folder, names, prev_files)}
    m = cfg.model
    return {"kind": "seed", "key": "training.seed", "seed": int(cfg.training.seed), "family": str(m.family),
            "flavor": str(m.flavor), "n_layers": m.get("n_layers"), "vocab_size": m.get("vocab_size")}


def describe(p: dict) -> str:
    if p["kind"] == "seed":
        return f"weights initialised from training.seed={p['seed']} ({p['family']} {p['flavor']})"
    return f"{p['key']}={p['path']}"


def for_launch(cfg) -> dict | None:
    """The pointer of this launch: computed once by the launching process and handed to its workers
    (``ENV``), recomputed where that one no longer matches the recipe or the files. Under a torchrun
    that no apiary process started, global rank 0 alone hashes (and writes the pointer): None elsewhere."""
    cached = os.environ.get(ENV)
    if cached is None and os.environ.get("RANK", "0") != "0":
        return None
    previous = json.loads(cached) if cached else None
    p = pointer(cfg, previous)
    os.environ[ENV] = json.dumps(p)
    return p


# ---------------------------------------------------------------------------- resume


def _step_to_load(cfg) -> Path | None:
    """The checkpoint step a resume of ``cfg`` loads (as framework.resolve picks it), or None."""
    run = cfg.get("output_dir")
    if run is None:
        root = Path("runs") / str(cfg.recipe)
        runs = sorted((p for p in root.glob("*") if (p / "checkpoint").is_dir()), key=lambda p: p.stat().st_mtime) \
            if root.is_dir() else []
        if not runs:
            return None
        run = runs[-1]
    ck = Path(run) / "checkpoint"
    steps = {}
    for p in ck.iterdir() if ck.is_dir() else []:
        if p.name.startswith("step-") and p.name[5:].isdigit() and ((p / "manifest.json").is_file()
                                                                    or (p / ".metadata").is_file()):
            steps[int(p.name[5:])] = p
    want = cfg.checkpoint.get("load_step")
    if want is not None:
        return steps.get(int(want))
    return steps[max(steps)] if steps else None


def check_resume(cfg, now: dict) -> None:
    """A resume trains the adapters of its checkpoint on the same base: the pointer saved with the
    step it loads against ``now`` (this launch's); UserError (exit 2) naming what differs."""
    step = _step_to_load(cfg)
    saved_file = step / BASE_FILE if step is not None else None
    if saved_file is None or not saved_file.is_file():
        return  # not an adapter checkpoint: framework/resolve/resume.py refuses the change of adapter.name
    saved = json.loads(saved_file.read_text())["base"]
    where = "checkpoint.resume=true"
    fix = (f"Resume with the base it was trained on ({describe(saved)}), or start a new run on this base "
           "(its adapters start from zero).")
    if saved["kind"] != now["kind"] or saved.get("path") != now.get("path"):
        raise UserError(where, f"{step} holds adapters trained on {describe(saved)}; this launch's base is "
                        f"{describe(now)}. Adapters only mean something on the weights they were trained on.", fix)
    if saved["kind"] == "seed":
        diff = [k for k in ("seed", "family", "flavor", "n_layers", "vocab_size") if saved.get(k) != now.get(k)]
        if diff:
            raise UserError(where, f"{step} holds adapters trained on a base initialised with "
                            + ", ".join(f"{k}={saved.get(k)}" for k in diff) + "; this launch's base has "
                            + ", ".join(f"{k}={now.get(k)}" for k in diff) + ".", fix)
        return
    old, new = saved["files"], now["files"]
    for name in sorted(set(old) | set(new)):
        if name not in new:
            raise UserError(where, f"the base {describe(now)} no longer holds {name}, which the adapters in {step} "
                            "were trained on.", fix)
        if name not in old:
            raise UserError(where, f"the base {describe(now)} holds {name}, which it did not hold when the adapters "
                            f"in {step} were trained.", fix)
        if old[name]["hash"] != new[name]["hash"] or old[name]["size"] != new[name]["size"]:
            raise UserError(where, f"the base {describe(now)} has changed since the adapters in {step} were trained: "
                            f"{name} has checksum {new[name]['hash']} ({new[name]['size']:,} bytes), it had "
                            f"{old[name]['hash']} ({old[name]['size']:,} bytes).", fix)
