"""Local text sources checked before launch: which files ``data.path`` names, whether each parses,
and how many documents they hold. Standard library only (plus pyarrow for parquet), so the
launcher checks data without importing torch.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGED_CORPUS = Path(__file__).with_name("tiny_corpus.jsonl")
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


HUB_FREE_NAMES = ("packaged", "local")  # data.name values that name no HuggingFace hub dataset
BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark: some editors start a file with it; it is not part of the text


def has_bom(path: str) -> bool:
    """Whether a file starts with the UTF-8 byte-order mark (the loader then reads it as utf-8-sig)."""
    with open(path, "rb") as fh:
        return fh.read(3) == BOM


def source_kind(name: str, path: str | None) -> str:
    """Where the text comes from: ``local`` (data.path, whatever data.name), ``packaged``, or ``hub``.

    ``data.path`` wins: ``data.name`` then may only be ``packaged`` (the default) or ``local``;
    resolve refuses a hub name together with a path, and ``local`` without one.
    """
    if path is not None:
        return "local"
    if name in ("packaged", "", "tiny"):
        return "packaged"
    if name == "local":
        raise ValueError("data.name=local needs data.path")
    return "hub"


DOCUMENT_SCAN_BYTES = 256 * 2**20  # document_tokens reads sources up to this size (a planner's estimate, not a check)


@functools.lru_cache(maxsize=16)
def document_tokens(path: str) -> float | None:
    """The mean document length a token sits in, ``sum L^2 / sum L`` over the documents of a local
    jsonl / txt source (L: the byte tokenizer's tokens, the text's UTF-8 bytes plus BOS and EOS; for a
    subword tokenizer an upper bound). What a packed row of these documents attends per token, as a
    causal mask over a sequence of this length would (the planner's attention time). None: a source
    it does not read (parquet, a JSON array, more than DOCUMENT_SCAN_BYTES, unreadable)."""
    files = local_data_files(path)
    if not files or any(Path(f).suffix not in (".jsonl", ".json", ".txt") for f in files):
        return None
    try:
        if sum(os.path.getsize(f) for f in files) > DOCUMENT_SCAN_BYTES or \
                any(Path(f).suffix == ".json" and _starts_array(f) for f in files):
            return None
        total = squares = 0
        for f in files:
            with open(f, "rb") as fh:
                for raw in fh:
                    raw = raw.removeprefix(BOM)
                    if not raw.strip():
                        continue
                    text = json.loads(raw)["text"] if Path(f).suffix != ".txt" else raw.decode("utf-8").rstrip("\r\n")
                    n = len(text.encode("utf-8")) + 2
                    total, squares = total + n, squares + n * n
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return squares / total if total else None


def held_out_count(documents: int, fraction: float) -> int:
    """How many of a source's last documents validation.fraction holds out (at least one)."""
    return max(1, math.ceil(documents * fraction))


def local_data_files(path: str) -> list[str]:
    """The files a local ``data.path`` would read (empty when there are none)."""
    p = Path(path)
    if p.is_dir():
        return sorted(str(f) for f in p.rglob("*") if f.suffix in LOCAL_FORMATS and f.is_file())
    return [str(p)] if p.is_file() and p.suffix in LOCAL_FORMATS else []


@dataclass
class TextSummary:
    """What a local text source holds, counted before launch (``inspect_local``)."""

    path: str
    files: list[str]
    documents: int
    text_bytes: int | None  # UTF-8 bytes of all documents (None for parquet: not read before launch)
    with_text: int | None = None  # documents with more than whitespace (None for parquet)

    def tokens(self) -> int | None:
        """Tokens of the byte tokenizer (one per byte, plus BOS and EOS per document); for a subword
        tokenizer an upper bound (each of its tokens covers at least one byte). None: unknown (parquet)."""
        return None if self.text_bytes is None else self.text_bytes + 2 * self.documents

    def describe(self, kind: str, tokenizer: str) -> str:
        where = self.files[0] if len(self.files) == 1 else f"{self.path} ({len(self.files)} files)"
        line = f"{kind} text {where}: {self.documents:,} documents"
        if self.text_bytes is not None:
            line += f", {self.text_bytes:,} bytes"
            if tokenizer == "byte":  # one id per byte plus BOS and EOS per document
                line += f", {self.text_bytes + 2 * self.documents:,} tokens (byte tokenizer)"
        return line


def _bad(f: str, line: int | None, what: str) -> ValueError:
    return ValueError(f"{f}:{line}: {what}" if line else f"{f}: {what}")


def _inspect_json_lines(f: str) -> tuple[int, int, int]:
    docs = nbytes = with_text = 0
    with open(f, "rb") as fh:
        for i, raw in enumerate(fh, 1):
            if i == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _bad(f, i, f"not a JSON line ({getattr(e, 'msg', e)})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                if isinstance(rec, dict) and "text" in rec:
                    what = f"here 'text' is {type(rec['text']).__name__}, not a string"
                elif isinstance(rec, dict):
                    what = f"this one has no 'text' (keys: {', '.join(sorted(rec)) or 'none'})"
                else:
                    what = f"this one is a JSON {type(rec).__name__}, not an object"
                raise _bad(f, i, f"each record needs a string 'text' field; {what}")
            docs += 1
            nbytes += len(rec["text"].encode("utf-8"))
            with_text += bool(rec["text"].strip())
    return docs, nbytes, with_text


def _inspect_json_array(f: str) -> tuple[int, int, int]:
    try:
        recs = json.loads(Path(f).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f, getattr(e, "lineno", None), f"not valid JSON ({getattr(e, 'msg', e)})") from None
    docs = nbytes = with_text = 0
    for rec in recs if isinstance(recs, list) else [recs]:
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise _bad(f, None, f"record {docs + 1} needs a string 'text' field")
        docs += 1
        nbytes += len(rec["text"].encode("utf-8"))
        with_text += bool(rec["text"].strip())
    return docs, nbytes, with_text


def _inspect_txt(f: str) -> tuple[int, int, int]:
    docs = nbytes = with_text = 0
    with open(f, "rb") as fh:
        for i, raw in enumerate(fh, 1):
            if i == 1 and raw.startswith(BOM):  # the loader reads such a file as utf-8-sig
                raw = raw[len(BOM):]
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise _bad(f, i, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
            docs += 1  # the HF text loader makes one document of each line
            nbytes += len(line.encode("utf-8"))
            with_text += bool(line.strip())
    return docs, nbytes, with_text


def _inspect_parquet(f: str) -> int:
    import pyarrow.parquet as pq  # optional dependency: pyarrow (parquet files only)

    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise _bad(f, None, f"not a readable parquet file ({e})") from None
    if "text" not in pf.schema_arrow.names:
        raise _bad(f, None, f"has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    return pf.metadata.num_rows


def inspect_local(path: str) -> TextSummary:
    """Check a local ``data.path`` before launch and count what it holds; ValueError names the file and line.

    Refused: nothing there, an unsupported suffix, a folder without a readable file, mixed formats,
    an empty file, a jsonl line that is not a JSON object with a string ``text``, non-UTF-8 text,
    a parquet file without a ``text`` column, a JSON array file that starts with a byte-order mark
    (the HF loader cannot read one), text whose every document is empty or whitespace only. A
    byte-order mark at the start of a jsonl/json-lines/txt file is accepted and is not part of the
    text (the loader reads such files as utf-8-sig). Reads every jsonl/txt line once (seconds per GB).
    """
    p = Path(path)
    known = ", ".join(sorted(LOCAL_FORMATS))
    if not p.exists():
        raise ValueError(f"{path}: no such file or folder")
    if p.is_file() and p.suffix not in LOCAL_FORMATS:
        raise ValueError(f"{path}: unsupported suffix {p.suffix or '(none)'!r}; apiary reads {known}")
    files = local_data_files(path)
    if not files:
        others = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else []
        raise ValueError(f"{path}: no {known} file in this folder" + (f" ({len(others)} other files)" if others else ""))
    kinds = {LOCAL_FORMATS[Path(f).suffix] for f in files}
    if len(kinds) != 1:
        raise ValueError(f"{path}: files of several formats ({', '.join(sorted({Path(f).suffix for f in files}))}); "
                         "one folder holds one format")
    docs, nbytes, with_text = 0, 0, 0
    for f in files:
        if not os.access(f, os.R_OK):
            raise _bad(f, None, "not readable (permissions)")
        if os.path.getsize(f) == 0:
            raise _bad(f, None, "empty file")
        suffix = Path(f).suffix
        if suffix == ".parquet":
            n, b, t = _inspect_parquet(f), None, None
        elif suffix == ".txt":
            n, b, t = _inspect_txt(f)
        elif suffix == ".json" and _starts_array(f):
            if has_bom(f):
                raise _bad(f, None, "is a JSON array that starts with a UTF-8 byte-order mark, which the loader "
                           "cannot read (it reads a byte-order mark only in JSON lines); save it without the mark, "
                           "or as .jsonl (one object per line)")
            n, b, t = _inspect_json_array(f)
        else:
            n, b, t = _inspect_json_lines(f)
        if n == 0:
            raise _bad(f, None, "holds no documents (only blank lines or no rows)")
        docs += n
        nbytes = None if b is None or nbytes is None else nbytes + b
        with_text = None if b is None or with_text is None else with_text + t
    if with_text == 0:
        raise ValueError(f"{path}: all {docs:,} documents are empty or whitespace only, so there is nothing to "
                         "train on (the model would see only the begin- and end-of-document tokens)")
    return TextSummary(path=str(path), files=files, documents=docs, text_bytes=nbytes, with_text=with_text)


def _starts_array(f: str) -> bool:
    """A .json file holding one JSON array (rather than JSON lines), a byte-order mark ignored."""
    with open(f, "rb") as fh:
        head = fh.read(4096)
    return (head[len(BOM):] if head.startswith(BOM) else head).lstrip()[:1] == b"["
