"""Cost of the pre-launch data check (components/data/local_text.inspect_local) on a jsonl file.

    python benchmarks/data_check_bench.py [--mib 200]

Writes a jsonl of 400-word records to a temporary folder and prints MiB, documents, seconds, MiB/s.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from components.data.local_text import inspect_local  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=200)
    a = ap.parse_args()
    words = "the quick brown fox jumps over a lazy dog and keeps running far away".split()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.jsonl"
        with open(path, "w") as f:
            while f.tell() < a.mib * 2**20:
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(400))}) + "\n")
        size = os.path.getsize(path)
        t = time.perf_counter()
        s = inspect_local(str(path))
        dt = time.perf_counter() - t
    print(f"| {size / 2**20:.0f} MiB | {s.documents:,} documents | {dt:.2f} s | {size / dt / 2**20:.0f} MiB/s |")


if __name__ == "__main__":
    main()
