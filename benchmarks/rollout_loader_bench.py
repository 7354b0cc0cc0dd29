"""RL rollout loader, one data-parallel rank: host memory and rows/s of reading the whole set
into dense tensors (components.data.rollouts.read_rollouts, what every rank did before) against
the index + rows built on demand (components.data.rollout_loader.RolloutRows).

    python benchmarks/rollout_loader_bench.py                       # 600 records x 4096 tokens
    python benchmarks/rollout_loader_bench.py --records 100 --tokens 512   # smoke

Writes a synthetic jsonl rollout set (random ids, masks, logprobs, ref logprobs, per-token
advantages) to --dir, then runs each variant in a fresh interpreter: "memory" is the process's
peak RSS minus the same interpreter's RSS after its imports (what holding the set costs one
rank; 8 ranks of a node pay it 8 times), "rows/s" is the rate of building packed rows of
--seq-len in stream order, "init s" the time to be ready (the whole read, or the index pass).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def write_set(path: Path, records: int, tokens: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(records):
            n = rng.randint(tokens // 2, tokens)
            p = rng.randint(1, n // 4)
            f.write(json.dumps({
                "input_ids": [rng.randrange(1, 150_000) for _ in range(n)],
                "loss_mask": [0] * p + [1] * (n - p),
                "old_logprobs": [0.0] * p + [round(-rng.random(), 4) for _ in range(n - p)],
                "ref_logprobs": [0.0] * p + [round(-rng.random(), 4) for _ in range(n - p)],
                "advantages": [round(rng.uniform(-1, 1), 4)] * n,
            }) + "\n")
    return path.stat().st_size


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(variant: str, path: str, seq_len: int, rows: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401

    from components.data.rollout_loader import RolloutRows
    from components.data.rollouts import read_rollouts

    base = _rss_mib()
    t0 = time.perf_counter()
    if variant == "whole_set":
        t = read_rollouts(path, pack_to=seq_len)
        n = t["input_ids"].shape[0]
        init = time.perf_counter() - t0
        t1 = time.perf_counter()
        for i in range(min(rows, n)):
            _ = {k: v[i].clone() for k, v in t.items() if k != "meta"}
    else:
        ds = RolloutRows(path, seq_len=seq_len, dp_rank=0, dp_world_size=1, local_batch=1, global_batch=1)
        n = ds.n
        init = time.perf_counter() - t0
        t1 = time.perf_counter()
        for i in range(min(rows, n)):
            _ = ds.row(i)
    rate = min(rows, n) / (time.perf_counter() - t1)
    return {"variant": variant, "rows": n, "init_s": init, "rows_per_s": rate, "memory_mib": _rss_mib() - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=4096, help="longest record; lengths uniform in [tokens/2, tokens]")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=64, help="rows built for the rate")
    ap.add_argument("--dir", default="/tmp/apiary_rollout_bench")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], int(a.worker[2]), int(a.worker[3]))))
        return
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rollouts_{a.records}x{a.tokens}.jsonl"
    size = path.stat().st_size if path.is_file() else write_set(path, a.records, a.tokens)
    results = []
    for variant in ("whole_set", "on_demand"):
        p = subprocess.run([sys.executable, __file__, "--worker", variant, str(path), str(a.seq_len), str(a.rows)],
                           capture_output=True, text=True, check=True)
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    table = Table(title=f"rollout loader, one rank: {a.records} records (<= {a.tokens} tokens), "
                        f"{size / 2**20:,.0f} MiB jsonl, seq_len {a.seq_len}")
    for col in ("variant", "packed rows", "init s", "rows/s", "memory MiB"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in results:
        table.add_row(r["variant"], str(r["rows"]), f"{r['init_s']:.2f}", f"{r['rows_per_s']:,.0f}",
                      f"{r['memory_mib']:,.0f}")
    Console().print(table)
    if a.out:
        Path(a.out).write_text(json.dumps({"records": a.records, "tokens": a.tokens, "seq_len": a.seq_len,
                                           "jsonl_bytes": size, "results": results}, indent=2))


if __name__ == "__main__":
    main()
