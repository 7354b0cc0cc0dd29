"""One weight hand-off to a real vLLM engine, timed, against a folder publication of the same model.

    python benchmarks/weight_sync_bench.py --recipe qwen35_35b_128k --layers 4 --backends ipc nccl --out DIR
    python benchmarks/weight_sync_bench.py --backends ipc ipc@4096 --no-folder   # IPC with 1 GiB and 4 GiB buckets

For each backend: a vLLM engine (examples/rl_loop/vllm_generator.py --serve) starts from the folder the
trainer side published (step-0, bfloat16), links to this process, and takes ``--updates`` in-memory
updates (components/transport/vllm.py's sender, as a training run drives it): per update the time the
trainer was blocked (gather + convert + copy into the buckets), the transfer (start .. finish, in the
background of a run) and the time the engine was paused (its own measure). ``ipc``: the engine on GPU 0
beside the weights; ``nccl``: the engine on GPU 1. ``BACKEND@MiB`` sets publish.bucket_mb (default 1024).
The folder row is publish.py's foreground write of the same weights
(convert + write, what ``publish.background=false`` blocks for).

``check_same_as_folder`` (tests/gpu/test_vllm_gpu.py): after an in-memory update, the engine's greedy
tokens and their log-probs equal those of a fresh engine started from the folder of the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.transport import link as link_mod  # noqa: E402
from components.transport.sender import InMemorySender  # noqa: E402
from framework import api  # noqa: E402
from framework.resolve.resolver import resolve  # noqa: E402
from framework.train import publish, published  # noqa: E402

GENERATOR = ROOT / "examples" / "rl_loop" / "vllm_generator.py"


def build(recipe: str, overrides: list[str]):
    r = resolve(recipe, ["publish.interval=1", *overrides], world_size=1, for_training=False)
    writer = r.ctx.components["model"].hf_writer(r.ctx.options["model"], r.ctx)
    pairs = dict(o.split("=", 1) for o in overrides)
    kw = {"n_layers": int(pairs["model.n_layers"])} if "model.n_layers" in pairs else {}
    if "model.flavor" in pairs:
        kw["flavor"] = pairs["model.flavor"]
    torch.manual_seed(0)
    model = api.build_model(recipe, device="cuda", **kw)
    return model, writer


def write_folder(model, writer, directory: Path, version: int) -> float:
    """publish.py's foreground folder of the model in bfloat16; returns its seconds (convert + write)."""
    t0 = time.perf_counter()
    sd = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    tensors, hf_config = writer(sd)
    hf_config = {**hf_config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    published.write_version(directory, version, tensors, hf_config)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def start_engine(weights: Path, backend: str, gpu: int, memory: float, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(GENERATOR), "--weights", str(weights), "--backend", backend,
                             "--serve", "--memory", str(memory), "--max-len", "512"],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def sender(model, writer, weights: Path, backend: str, bucket_mb: int = 1024, timeout: float = 300):
    # the trainer's own settings type, so a field the sender reads is never missing here
    settings = publish.PublishSettings(interval=1, dir=str(weights), keep=2, background="true", convert=writer,
                                       dtype="bfloat16", log=publish.PublishLog())
    options = SimpleNamespace(engine="127.0.0.1:0", engine_timeout=timeout, background="true", bucket_mb=bucket_mb,
                              when_busy="wait")
    name = {"ipc": "vllm_ipc", "nccl": "vllm_nccl"}[backend]
    return InMemorySender(backend, name, options, settings, SimpleNamespace(model_parts=[model]))


def linked(model, writer, weights: Path, backend: str, memory: float, log: Path, bucket_mb: int = 1024,
           timeout: float = 600):
    """An engine on ``weights`` (GPU 0 for IPC, 1 for NCCL) and the sender it is linked to. The engine starts
    first: the sender waits for its hello as it is made (as the trainer does before its first step), and
    the generator waits for the link file the sender writes."""
    eng = start_engine(weights, backend, 0 if backend == "ipc" else 1, memory, log)
    try:
        return sender(model, writer, weights, backend, bucket_mb, timeout=timeout), eng
    except BaseException:
        eng.kill()
        raise


def update(s, model, version: int) -> dict:
    s.publish(SimpleNamespace(model_parts=[model]), version)
    s._join()
    return s.records[-1]


def perturb(model, scale: float = 0.02, seed: int = 1) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * scale)


def prompts(n: int = 4, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


def check_same_as_folder(recipe: str, overrides: list[str], backend: str, out: Path, memory: float = 0.15) -> dict:
    """In-memory update vs a fresh engine from the folder of the same weights: greedy tokens and log-probs."""
    out.mkdir(parents=True, exist_ok=True)
    model, writer = build(recipe, overrides)
    w1, w2 = out / f"weights_{backend}", out / f"folder_{backend}"
    write_folder(model, writer, w1, 0)
    s, eng = linked(model, writer, w1, backend, memory, out / f"engine_{backend}.log")
    try:
        p = prompts()
        before = s.link.probe(p, 16)
        perturb(model)
        rec = update(s, model, 1)
        after = s.link.probe(p, 16)
        write_folder(model, writer, w2, 1)
        ref_link = link_mod.EngineLink(w2, "127.0.0.1:0", writer.hf_config, transport="hf_folder")
        ref = start_engine(w2, "ipc", 0, memory, out / f"engine_{backend}_folder.log")
        try:
            ref_link.accept(300)
            folder = ref_link.probe(p, 16)
        finally:
            ref_link.close()
            ref.wait(60)
    finally:
        s.close()
        eng.wait(60)
    diff = max(abs(a - b) for x, y in zip(after["logprobs"], folder["logprobs"]) for a, b in zip(x, y))
    return {"before": before, "after": after, "folder": folder, "record": rec, "max_logprob_diff": diff}


def bench(recipe: str, overrides: list[str], backends: list[str], updates: int, out: Path, memory: float,
          folder_row: bool = True) -> list:
    out.mkdir(parents=True, exist_ok=True)
    model, writer = build(recipe, overrides)
    rows = []
    w = out / "weights"
    folder_s = [write_folder(model, writer, w, 0)]  # the engine starts from it
    if folder_row:
        folder_s.append(write_folder(model, writer, out / "weights_again", 0))
        nbytes = sum(f.stat().st_size for f in (w / "step-0").glob("*.safetensors"))
        rows.append({"how": "folder (publish.background=false)", "GB": nbytes / 1e9, "blocked_s": min(folder_s),
                     "transfer_s": None, "engine_s": None})
    for spec in backends:
        backend, _, mb = spec.partition("@")
        s, eng = linked(model, writer, w, backend, memory, out / f"bench_engine_{backend}.log", int(mb or 1024))
        recs = []
        try:
            for v in range(1, updates + 1):
                perturb(model, 1e-3, seed=v)
                recs.append(update(s, model, v))
        except Exception as e:  # noqa: BLE001 - one backend's failure is a row, the next still runs
            rows.append({"how": f"vllm_{spec}", "error": f"{type(e).__name__}: {e}"})
        finally:
            s.close()
            eng.wait(120)
        if recs:
            steady = recs[1:] or recs  # the first update also opens the transfer (IPC handles, NCCL group)
            rows.append({"how": f"vllm_{spec}", "GB": s.plan.nbytes / 1e9, "buckets": len(s.plan.buckets),
                         "blocked_s": statistics.median(r["blocked_s"] for r in steady),
                         "transfer_s": statistics.median(r["transfer_s"] for r in steady),
                         "engine_s": statistics.median(r["engine_s"] for r in steady),
                         "first": recs[0], "all": recs})
    return rows


def _f(x) -> str:
    return f"{x:.3f}" if x is not None else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="qwen35_35b_128k")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backends", nargs="+", default=["ipc", "nccl"])
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--memory", type=float, default=0.25)
    p.add_argument("--out", type=Path, default=Path("bench_out/weight_sync"))
    p.add_argument("--no-folder", action="store_true", help="leave out the folder row (its second write)")
    a = p.parse_args(argv)
    rows = bench(a.recipe, [f"model.n_layers={a.layers}", "data.tokenizer=byte", "training.seq_len=4096",
                            "parallel.cp=1", "parallel.ep=1", "parallel.dp_shard=1"], a.backends, a.updates, a.out,
                 a.memory, not a.no_folder)
    (a.out / "weight_sync.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{a.recipe} x {a.layers} layers, bfloat16; medians of updates 2..{a.updates}")
    print(f"{'how':34s} {'GB':>6s} {'blocked s':>10s} {'transfer s':>11s} {'engine paused s':>16s} {'total s':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['how']:34s} {r['error']}")
            continue
        total = r["blocked_s"] + (r["transfer_s"] or 0.0)
        print(f"{r['how']:34s} {r['GB']:6.2f} {_f(r['blocked_s']):>10s} {_f(r['transfer_s']):>11s} "
              f"{_f(r['engine_s']):>16s} {total:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
