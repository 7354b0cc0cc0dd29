"""Regenerate components/data/tiny_corpus.jsonl: documentation strings of Python's
standard library (PSF licence), one JSON object {"text": ...} per documented object.

    python scripts/make_corpus.py [--max-bytes 600000]
"""

import argparse
import importlib
import inspect
import json
from pathlib import Path

MODULES = [
    "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "enum", "fractions", "functools", "gzip", "heapq", "hashlib",
    "html", "itertools", "json", "logging", "math", "operator", "os", "pathlib", "pickle",
    "queue", "random", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile",
    "textwrap", "threading", "time", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
]


def docs():
    for name in MODULES:
        mod = importlib.import_module(name)
        if inspect.getdoc(mod):
            yield f"Module {name}.\n\n{inspect.getdoc(mod)}"
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                yield f"{name}.{attr}\n\n{doc}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-bytes", type=int, default=600_000)
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "components/data/tiny_corpus.jsonl"))
    args = ap.parse_args()
    total = 0
    with open(args.out, "w") as f:
        for text in docs():
            line = json.dumps({"text": text}, ensure_ascii=False)
            total += len(line) + 1
            if total > args.max_bytes:
                break
            f.write(line + "\n")
    print(f"wrote {args.out} ({total} bytes)")


if __name__ == "__main__":
    main()
