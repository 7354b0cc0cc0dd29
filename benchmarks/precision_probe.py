"""Where two precisions part: the first step of one run, module by module.

    python benchmarks/precision_probe.py DIR TAG recipe=X [overrides ...]   # one variant -> DIR/TAG.pt
    python benchmarks/precision_probe.py --compare DIR BASE TAG [TAG ...]  # table against BASE

Each variant builds the run's trainer as ``train`` does (same seed, same data), records every
parameter's sum and norm after initialisation, hooks every module to keep a strided sample
(4096 values) of its first forward output, its input's norm and the dtypes, runs the first
step's forward and backward (toolkit.probe), and keeps every parameter's gradient norm.
``--compare`` prints, in the order modules first ran, the relative error of each module's
output sample against BASE's and the ratio of its gradient norms, and lists the parameters whose
initial values differ: the first module far from BASE is where the precisions part.

Environment (one variant): PROBE_IMPORT_TE=1 imports TransformerEngine before building;
PROBE_TE_NOFP8=1 runs precision.backend=te's linears with TE's FP8 autocast off (TE's module in
the compute dtype); PROBE_HOOKS=blocks hooks only the embedding, the blocks and
the final norm (outside torch.compile's per-block regions); PROBE_RNG=1 records the CUDA and CPU
generators' states at each stage of the trainer's build (seeding, parallelize, initialisation)
and before each parameter's initialisation, with the parameter's sum after it; PROBE_RESEED=1
seeds torch again (training.seed) right before the model's initialisation.
Gradient norms are taken before the probe's clip_grad_norm_ (a NaN total norm would scale every
gradient to NaN).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

SAMPLE = 4096


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _rng_state() -> tuple:
    cpu = hashlib.sha1(torch.random.get_rng_state().numpy().tobytes()).hexdigest()[:12]
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return (cpu, None)
    cuda = torch.cuda.get_rng_state()
    return (cpu, tuple(int(x) for x in cuda.view(torch.int64).tolist()))  # (seed, offset)


def _trace_rng(log: list) -> None:
    """Wrap the trainer's build stages and torchtitan's per-parameter init to log RNG states."""
    import torchtitan.trainer as tt_trainer
    from torchtitan.protocols import model as tt_model
    from torchtitan.protocols import module as tt_module

    def wrap(owner, attr, stage):
        inner = getattr(owner, attr)

        def wrapped(*a, **k):
            log.append((f"before {stage}", _rng_state()))
            out = inner(*a, **k)
            log.append((f"after {stage}", _rng_state()))
            return out
        setattr(owner, attr, wrapped)

    wrap(tt_trainer.dist_utils, "set_determinism", "set_determinism")
    wrap(tt_model.BaseModel, "init_weights", "init_weights")
    wrap(torch.nn.Module, "to_empty", "to_empty")
    init_param = tt_module.Module._init_param

    def traced(self, name, param):
        before = _rng_state()
        init_param(self, name, param)
        log.append((f"init {type(self).__name__}.{name} {tuple(param.shape)}", before,
                    float(_full(param.detach()).double().sum())))
    tt_module.Module._init_param = traced


def record(out: Path, tag: str, args: list[str]) -> None:
    if os.environ.get("PROBE_IMPORT_TE"):
        import transformer_engine.pytorch  # noqa: F401
    if os.environ.get("PROBE_TE_NOFP8"):
        from components.precision import te as te_mod

        te_mod.fp8_autocast = lambda recipe: contextlib.nullcontext()
    from framework import devices
    from framework.train import process

    devices.install()
    rng_log: list = []
    if os.environ.get("PROBE_RNG"):
        _trace_rng(rng_log)
    if os.environ.get("PROBE_RESEED"):
        from torchtitan.protocols import model as tt_model

        init_weights = tt_model.BaseModel.init_weights

        def reseeded(self, **k):
            torch.manual_seed(r.cfg.training.seed)
            return init_weights(self, **k)
        tt_model.BaseModel.init_weights = reseeded
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config
    from toolkit import probe as P

    recipe, overrides = P._probe_args(args, out / tag)
    process.single_process_env()
    r = resolve(recipe, overrides)
    trainer = trainer_config(r).build()
    trainer.checkpointer.load(step=-1)
    model = trainer.model_parts[0]
    params = {}
    for n, p in model.named_parameters():
        t = _full(p.detach()).double()
        params[P.clean_name(n)] = (float(t.sum()), float(t.norm()))
    acts: dict[str, dict] = {}

    def hook(name):
        def h(mod, inp, output):
            o = _first_tensor(output)
            if name in acts or o is None:
                return
            i = _first_tensor(inp)
            f = _full(o.detach()).reshape(-1)
            step = max(1, f.numel() // SAMPLE)
            acts[name] = {"order": len(acts), "type": type(mod).__name__, "dtype": str(o.dtype),
                          "shape": list(o.shape), "norm": float(f.double().norm()),
                          "finite": bool(torch.isfinite(f).all()),
                          "in_norm": float(_full(i.detach()).double().norm()) if i is not None else None,
                          "in_dtype": str(i.dtype) if i is not None else None,
                          "autocast": torch.is_autocast_enabled("cuda") if torch.cuda.is_available() else None,
                          "sample": f[::step][:SAMPLE].float().cpu()}
        return h

    blocks_only = os.environ.get("PROBE_HOOKS") == "blocks"
    for n, m in model.named_modules():
        name = P.clean_name(n) or "<model>"
        if not blocks_only or re.fullmatch(r"layers\.\d+|norm|tok_embeddings", name):
            m.register_forward_hook(hook(name))
    grads = {}
    clip = P.dist_utils.clip_grad_norm_

    def grads_then_clip(*a, **k):
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[P.clean_name(n)] = float(_full(p.grad.detach()).double().norm())
        return clip(*a, **k)
    P.dist_utils.clip_grad_norm_ = grads_then_clip
    res = P._first_step(trainer, out / tag, 0, 0, int(r.facts.n_params))
    nonfinite = [k for k, g in grads.items() if not math.isfinite(g)]
    if nonfinite:
        print(f"{tag}: {len(nonfinite)} of {len(grads)} gradients not finite, first {nonfinite[:8]}")
    torch.save({"rng": rng_log, "loss": res["loss"], "grad_norm": res["grad_norm"], "params": params, "acts": acts,
                "grads": grads}, out / f"{tag}.pt")
    print(f"{tag}: loss {res['loss']:.4f} grad_norm {res['grad_norm']:.3f} modules {len(acts)}")
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def compare_rng(b: dict, v: dict) -> None:
    """The first RNG-log entry where the variant parts from the base (PROBE_RNG=1 runs)."""
    if not b.get("rng") or not v.get("rng"):
        return
    print(f"RNG log: {len(v['rng'])} entries vs {len(b['rng'])}")
    for i, (x, y) in enumerate(zip(v["rng"], b["rng"])):
        if x != y and x[0] != "before set_determinism":  # an unseeded process before
            print(f"  first difference at entry {i}: {x} vs {y}")
            for e in v["rng"][max(0, i - 3):i + 3]:
                print(f"   variant {e}")
            for e in b["rng"][max(0, i - 3):i + 3]:
                print(f"   base    {e}")
            return
    print("  no difference")


def compare(out: Path, base: str, tags: list[str]) -> None:
    b = torch.load(out / f"{base}.pt", weights_only=False)
    for tag in tags:
        v = torch.load(out / f"{tag}.pt", weights_only=False)
        compare_rng(b, v)
        print(f"\n== {tag} vs {base}: loss {v['loss']:.4f} vs {b['loss']:.4f}, grad_norm "
              f"{v['grad_norm']:.3f} vs {b['grad_norm']:.3f}")
        diff = [k for k in b["params"] if k in v["params"] and b["params"][k] != v["params"][k]]
        only = sorted(set(b["params"]) ^ set(v["params"]))
        print(f"initial parameters: {len(b['params']) - len(diff)} identical, {len(diff)} differ "
              f"{diff[:6]}, {len(only)} in one only {only[:6]}")
        print(f"{'#':>4} {'module':<44} {'type':<18} {'dtype':<15} {'out rel err':>11} {'norm ratio':>10} "
              f"{'in ratio':>9} autocast")
        for name, a in sorted(v["acts"].items(), key=lambda kv: kv[1]["order"]):
            ref = b["acts"].get(name)
            if ref is None or ref["sample"].shape != a["sample"].shape:
                print(f"{a['order']:>4} {name:<44} {a['type']:<18} {a['dtype']:<15} {'(no match)':>11}")
                continue
            err = float((a["sample"] - ref["sample"]).norm() / ref["sample"].norm().clamp_min(1e-30))
            nr = a["norm"] / ref["norm"] if ref["norm"] else float("nan")
            ir = (a["in_norm"] / ref["in_norm"]) if a["in_norm"] and ref["in_norm"] else float("nan")
            print(f"{a['order']:>4} {name:<44} {a['type']:<18} {a['dtype']:<15} {err:>11.4f} {nr:>10.4f} "
                  f"{ir:>9.4f} {a['autocast']}" + ("" if a.get("finite", True) else " NOT FINITE"))
        worst = sorted(((abs(v["grads"][k] / b["grads"][k] - 1), k) for k in b["grads"]
                        if k in v["grads"] and b["grads"][k]), reverse=True)[:12]
        print("largest gradient-norm ratios: " + ", ".join(f"{k} {v['grads'][k] / b['grads'][k]:.3f}"
                                                          for _, k in worst))


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        record(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
