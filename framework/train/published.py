"""A published weight version on disk: ``DIR/step-V`` with its files and ``apiary_version.json``,
``DIR/latest``, and the pruning of old versions; every write atomic (framework/train/publish.py
describes the layout and what publishes it). Shared by publication, `apiary export` and the checks
of publish.dir before launch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from framework import contracts
from framework.errors import UserError

SHARD_BYTES = 5 * 2**30  # one safetensors file up to this size; larger models are sharded (HF's index)
LATEST = "latest"
VERSION_FILE = "apiary_version.json"


# files of an HF tokenizer folder a generator reads (copied beside the weights)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


def read_latest(directory) -> Path | None:
    """The folder ``DIR/latest`` names (None before the first publication)."""
    f = Path(directory) / LATEST
    try:
        name = f.read_text().strip()
    except FileNotFoundError:
        return None
    return Path(directory) / name if name else None


def is_published(folder) -> bool:
    """Whether ``folder`` (``DIR/step-V``) is a version publication wrote: a folder holding an
    ``apiary_version.json`` whose version is V. Anything else in DIR is not publication's to touch."""
    folder = Path(folder)
    v = folder.name[len("step-"):] if folder.name.startswith("step-") else ""
    if not (v.isdigit() and folder.is_dir()):
        return False
    try:
        body = json.loads((folder / VERSION_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("version") == int(v) and not isinstance(body.get("version"), bool)


def versions(directory) -> list[int]:
    """The complete versions in ``directory`` (step-V folders publication wrote), oldest first."""
    d = Path(directory)
    out = []
    for p in d.glob("step-*") if d.is_dir() else []:
        if is_published(p):
            out.append(int(p.name[len("step-"):]))
    return sorted(out)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _shards(tensors: dict) -> list[dict]:
    """Tensors in order, split into groups of at most SHARD_BYTES (one group when smaller)."""
    groups, cur, size = [], {}, 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if cur and size + n > SHARD_BYTES:
            groups.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += n
    groups.append(cur)
    return groups


def add_hf_extras(folder: Path, hf_config: dict, tokenizer_dir: str | None) -> list[str]:
    """What a loader reads beside the weights: the tokenizer files of ``tokenizer_dir`` (an HF
    tokenizer folder) and generation_config.json (the folder's own, else one from config.json's
    token ids); every file readable as the umask allows (safetensors writes 0600). The names copied."""
    folder = Path(folder)
    copied = []
    if tokenizer_dir is not None:
        for f in (*TOKENIZER_FILES, "generation_config.json"):
            if (Path(tokenizer_dir) / f).is_file():
                shutil.copyfile(Path(tokenizer_dir) / f, folder / f)
                copied.append(f)
    if not (folder / "generation_config.json").is_file():
        gen = {"_from_model_config": True}
        gen.update({k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config})
        _write_json(folder / "generation_config.json", gen)
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)
    return copied


def write_version(directory, version: int, tensors: dict, hf_config: dict, *, run: str = "",
                  tokenizer_dir: str | None = None, form: contracts.PublishedForm | None = None) -> Path:
    """Write one version as ``DIR/step-V`` (aside, fsync'ed, renamed) and point ``DIR/latest`` at it:
    the tensors and config in ``form``'s file names (default: an HF model folder)."""
    form = form if form is not None else contracts.PublishedForm(convert=None)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    name = f"step-{version}"
    tmp, final = d / f".{name}.tmp", d / name
    if (final.exists() or final.is_symlink()) and not is_published(final):
        raise UserError(f"publish.dir={d}", f"{final} exists and publication did not write it (it holds no "
                        f"{VERSION_FILE} of version {version}: a checkpoint, or another program's folder); it is "
                        f"left untouched and version {version} is not published.", "Point publish.dir at a folder "
                        "of its own (left out it is OUTPUT_DIR/weights), or move that folder aside, then resume.")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    groups = _shards(tensors) if form.shardable else [tensors]
    if len(groups) == 1:
        save_file(groups[0], str(tmp / f"{form.weights}.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, g in enumerate(groups):
            fname = f"{form.weights}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(g, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in g})
            total += sum(v.numel() * v.element_size() for v in g.values())
        _write_json(tmp / f"{form.weights}.safetensors.index.json", {"metadata": {"total_size": total},
                                                                      "weight_map": weight_map})
    _write_json(tmp / form.config, hf_config)
    if form.loader_files:
        add_hf_extras(tmp, hf_config, tokenizer_dir)
    _write_json(tmp / VERSION_FILE, {"version": version, "step": version, "run": run})
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)
    if final.exists():  # the same version again (a resumed run): the new one replaces it
        old = d / f".{name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(d)
    point_latest(d, name)
    return final


def point_latest(directory: Path, name: str) -> None:
    """``DIR/latest`` := name, atomically (a temporary file replaced over it)."""
    tmp = directory / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    _fsync_dir(directory)


def prune(directory, keep: int, *, newer_than: int | None = None) -> list[int]:
    """Delete all but the newest ``keep`` versions (never the one ``latest`` names); with
    ``newer_than``, first every version above it (an earlier run's, past the step a resume loaded).
    Only versions publication wrote (``versions``) are counted or deleted: any other folder stays."""
    d = Path(directory)
    latest = read_latest(d)
    protect = latest.name if latest is not None else None
    have = versions(d)
    drop = [v for v in have if newer_than is not None and v > newer_than]
    rest = [v for v in have if v not in drop]
    drop += rest[:-keep] if len(rest) > keep else []
    dropped = []
    for v in drop:
        name = f"step-{v}"
        if name == protect:
            continue
        aside = d / f".{name}.del"
        os.rename(d / name, aside)  # step-V disappears whole; then the files go
        shutil.rmtree(aside, ignore_errors=True)
        dropped.append(v)
    return dropped
