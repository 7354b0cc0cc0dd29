"""Step-0 probe: the first optimizer step's forward/backward of a resolved run, dumped for
side-by-side comparison (``apiary compare``).

``probe(resolved)`` builds the run's torchtitan Trainer exactly as ``framework.train.run`` does,
loads ``checkpoint.load_path`` (the comparison's seed checkpoint), fetches the first
global batch (every gradient-accumulation micro-batch) and runs the trainer's own
``forward_backward_step`` on it, then stops before clipping and the optimizer. It returns

- ``loss``: the global average loss of that step (what metrics.jsonl logs as step 1);
- ``grad_norm``: the pre-clip total gradient norm (torchtitan's clip_grad_norm_ with
  max_norm=inf, which leaves the gradients untouched);
- ``logits``: a summary (shape, mean, std, abs max) and ``logits.pt``, the logits of the
  whole global batch in global sequence order ([sequences, seq_len, vocab], float32).
  Only where the loss primitive receives logits (not for chunked losses, which skip
  lm_head) and the run is pure data/expert parallel (no CP, TP or PP split of them);
- ``grads``: ``grads.pt``, ``{parameter name: full gradient tensor}`` (DTensors gathered
  with ``full_tensor()``), names as in the unwrapped model.

Dumps above ``max_numel`` elements (default 2**28, about 1 GiB of float32) are skipped with
a note, so a probe of a large model still reports loss and gradient norm.

Entry point (what ``apiary compare`` runs in each variant's subprocess)::

    python -m toolkit.probe --dump DIR [--train] [--max-numel N] [recipe=X] [overrides ...]

Without ``--train`` it probes (under torchrun: on every rank). With ``--train`` it first
runs ``train`` with the same arguments (framework.cli.train_main, so the recipe's launcher
and nproc apply), then probes in the same process (one rank) or under torchrun (N ranks),
after training so that the run's own metrics (peak memory above all) are not disturbed.
DIR/probe.json always says what happened, including a probe failure (``error``).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
from torchtitan.distributed import utils as dist_utils

from framework import devices
from framework.cli import train_main
from framework.compose import recipes, registry
from framework.compose.hydra_cli import ALIASES
from framework.resolve.resolver import resolve
from framework.train import process
from framework.train.build import trainer_config

DEFAULT_MAX_NUMEL = 2**28
# Wrappers that rename parameters (activation checkpointing, torch.compile, FSDP1).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


class _CaptureLogits:
    """Stands in for the trainer's loss to keep a detached copy of what it receives."""

    def __init__(self, inner):
        self.inner = inner
        self.preds = []

    def __call__(self, pred, labels, *args, **kwargs):
        p = pred.detach()
        if isinstance(p, DTensor):
            p = p.full_tensor()
        self.preds.append(p.float().cpu())
        return self.inner(pred, labels, *args, **kwargs)


def _first_step(trainer, dump: Path, rank: int, max_numel: int, n_params: int) -> dict:
    """Forward/backward of the first global batch; write this rank's pieces under ``dump``."""
    pd = trainer.parallel_dims
    notes: list[str] = []
    batch_degree, batch_rank = 1, 0
    if pd.dp_enabled:
        mesh = pd.get_mesh("batch")
        batch_degree, batch_rank = mesh.size(), mesh.get_local_rank()

    # Which parts of the step can be dumped.
    chunked = isinstance(trainer.loss_fn, ChunkedLossWrapper)
    logits_ok = not chunked and not pd.pp_enabled and not pd.cp_enabled and not pd.tp_enabled
    if chunked:
        notes.append("logits: the loss primitive takes hidden states and runs lm_head itself (no logits)")
    elif not logits_ok:
        notes.append("logits: not collected when CP, TP or PP split them")
    vocab = int(getattr(trainer.model_config, "vocab_size", 0) or 0)
    local_logits = trainer.config.training.local_batch_size * trainer.config.training.seq_len * vocab
    if logits_ok and vocab and local_logits * batch_degree * trainer.gradient_accumulation_steps > max_numel:
        logits_ok = False
        notes.append(f"logits: more than --max-numel={max_numel} elements; not dumped")
    capture = None
    if logits_ok:
        capture = _CaptureLogits(trainer.loss_fn)
        trainer.loss_fn = capture

    # The first half of Trainer.train_step: fetch every micro-batch, count tokens, fwd/bwd.
    trainer.optimizers.zero_grad(set_to_none=True)
    trainer.begin_step()  # the per-step sums forward_backward_step adds to (policy losses' metrics)
    data_iterator = trainer.batch_generator(trainer.dataloader)
    groups = []
    local_valid = torch.tensor(0, dtype=torch.int64)
    for _ in range(trainer.gradient_accumulation_steps):
        mbs = []
        for _ in range(trainer.num_pipeline_parallel_microbatches):
            input_dict, labels = next(data_iterator)
            local_valid += (labels != IGNORE_INDEX).sum()
            mbs.append((input_dict, labels))
        groups.append(mbs)
    if pd.dp_enabled:
        global_valid = dist_utils.dist_sum_tensor(local_valid.to(trainer.device), pd.get_mesh("batch"))
    else:
        global_valid = local_valid.to(trainer.device)

    acc = None
    for mbs in groups:
        dicts, labs = [], []
        for input_dict, labels in mbs:
            dicts.append({k: (v.to(trainer.device) if isinstance(v, torch.Tensor) else v)
                          for k, v in input_dict.items()})
            labs.append(labels.to(trainer.device))
        loss = trainer.forward_backward_step(
            input_dict=dicts if pd.pp_enabled else dicts[0],
            labels=labs if pd.pp_enabled else labs[0],
            global_valid_tokens=global_valid,
        ).detach()
        acc = loss.clone() if acc is None else acc + loss
    if capture is not None:
        trainer.loss_fn = capture.inner

    # The step's global average loss, as Trainer.train_step logs it.
    if pd.pp_enabled:
        mine = acc if trainer.pp_has_last_stage else torch.full_like(acc, -float("inf"))
        if pd.dp_cp_enabled:
            mine = dist_utils.dist_sum_tensor(mine, pd.get_optional_mesh("loss")) if trainer.pp_has_last_stage \
                else mine
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
        global_loss = float(mine.reshape(-1)[0].item())
    elif pd.dp_cp_enabled:
        global_loss = float(dist_utils.dist_sum(acc, pd.get_optional_mesh("loss")))
    else:
        global_loss = float(acc.item())

    params = [p for m in trainer.model_parts for p in m.parameters()]
    grad_norm = float(dist_utils.clip_grad_norm_(
        params, float("inf"), foreach=True, pp_mesh=pd.get_optional_mesh("pp"), ep_enabled=pd.ep_enabled,
    ).item())

    # Gradients: gathered full tensors; the rank at coordinate 0 of a DTensor's mesh keeps it.
    grads_ok = n_params <= max_numel  # the same decision on every rank (collectives follow)
    if not grads_ok:
        notes.append(f"grads: {n_params:,} parameters exceed --max-numel={max_numel}; not dumped")
    piece: dict[str, torch.Tensor] = {}
    if grads_ok:
        for m in trainer.model_parts:
            for name, p in m.named_parameters():
                g = p.grad
                if g is None:
                    continue
                if isinstance(g, DTensor):
                    full = g.full_tensor()
                    coord = g.device_mesh.get_coordinate()
                    if coord is None or any(c != 0 for c in coord):
                        continue
                else:
                    full = g
                piece[clean_name(name)] = full.detach().cpu().clone()
        torch.save(piece, dump / f"grads.rank{rank}.pt")
    if capture is not None:
        blocks = {m * batch_degree + batch_rank: t for m, t in enumerate(capture.preds)}
        torch.save(blocks, dump / f"logits.rank{rank}.pt")
    return {"loss": global_loss, "grad_norm": grad_norm, "notes": notes, "grads_ok": grads_ok,
            "logits_ok": capture is not None, "microbatches": len(groups), "batch_degree": batch_degree}


def _merge(dump: Path, world: int, res: dict) -> dict:
    """Rank 0: merge the per-rank pieces into grads.pt / logits.pt and summarise them."""
    out = {k: res[k] for k in ("loss", "grad_norm", "microbatches", "notes")}
    out["grads"] = out["logits"] = None
    if res["grads_ok"]:
        grads: dict[str, torch.Tensor] = {}
        for r in range(world):
            f = dump / f"grads.rank{r}.pt"
            if f.is_file():
                for k, v in torch.load(f, weights_only=True).items():
                    grads.setdefault(k, v)
                f.unlink()
        torch.save(grads, dump / "grads.pt")
        out["grads"] = {"file": "grads.pt", "n_tensors": len(grads),
                        "numel": int(sum(v.numel() for v in grads.values()))}
    if res["logits_ok"]:
        blocks: dict[int, torch.Tensor] = {}
        for r in range(world):
            f = dump / f"logits.rank{r}.pt"
            if f.is_file():
                blocks.update(torch.load(f, weights_only=True))
                f.unlink()
        logits = torch.cat([blocks[i] for i in sorted(blocks)], dim=0)
        torch.save(logits, dump / "logits.pt")
        out["logits"] = {"file": "logits.pt", "shape": list(logits.shape), "mean": float(logits.mean()),
                         "std": float(logits.std()), "abs_max": float(logits.abs().max())}
    return out


def probe(resolved, dump_dir: str | os.PathLike | None = None, max_numel: int = DEFAULT_MAX_NUMEL) -> dict:
    """Probe the first step of ``resolved`` (see the module docstring); returns the summary on
    rank 0 (other ranks: {}) and writes DIR/probe.json, DIR/grads.pt, DIR/logits.pt."""
    devices.install()
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # one process, maybe after a run in this process:
        os.environ.pop("MASTER_PORT", None)  # single_process_env picks a fresh one
    process.single_process_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    dump = Path(dump_dir) if dump_dir is not None else Path(resolved.cfg.output_dir)
    dump.mkdir(parents=True, exist_ok=True)
    if not devices.has_accelerator():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    trainer = None
    try:
        trainer = trainer_config(resolved).build()
        trainer.checkpointer.load(step=-1)
        res = _first_step(trainer, dump, rank, max_numel, int(resolved.facts.n_params))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        out: dict = {}
        if rank == 0:
            out = _merge(dump, world, res)
            out.update(world_size=world, dims=dict(resolved.layout.dims),
                       load_path=resolved.cfg.checkpoint.load_path, dtype=resolved.cfg.training.dtype)
            (dump / "probe.json").write_text(json.dumps(out, indent=2))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- entry point
def _parse(argv: list[str]):
    dump, max_numel, train, rest = None, DEFAULT_MAX_NUMEL, False, []
    it = iter(argv)
    for a in it:
        if a == "--dump":
            dump = next(it)
        elif a.startswith("--dump="):
            dump = a.split("=", 1)[1]
        elif a == "--max-numel":
            max_numel = int(next(it))
        elif a.startswith("--max-numel="):
            max_numel = int(a.split("=", 1)[1])
        elif a == "--train":
            train = True
        else:
            rest.append(a)
    if dump is None:
        raise SystemExit("usage: python -m toolkit.probe --dump DIR [--train] [--max-numel N] "
                         "[recipe=X] [overrides ...]")
    return Path(dump).resolve(), max_numel, train, rest


def _probe_args(rest: list[str], dump: Path):
    """Recipe and overrides for the probe's own trainer: same run, dump folder as output_dir."""
    overrides = []
    recipe, rest = recipes.split_recipe(rest)
    for a in rest:
        key, sep, val = a.partition("=")
        if key in ("output_dir", "checkpoint.resume", "checkpoint.create_seed"):
            continue
        else:
            overrides.append(f"{ALIASES.get(key, key)}{sep}{val}" if sep else a)
    return recipe, overrides + [f"output_dir={dump}"]


def _write_error(dump: Path, msg: str) -> None:
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "probe.json").write_text(json.dumps({"error": msg}, indent=2))


_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT")


def clean_env() -> dict:
    """This process's environment without a torch.distributed world (for child launches)."""
    return {k: v for k, v in os.environ.items() if k not in _RANK_ENV and not k.startswith("TORCHELASTIC_")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dump, max_numel, train, rest = _parse(argv)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if train:
        rc = train_main(rest)
        if rc != 0:
            return rc
        sys.stdout.flush()
        gc.collect()  # the training run's trainer, before a second one is built here
        if devices.has_accelerator():
            torch.cuda.empty_cache()
    recipe, overrides = _probe_args(rest, dump)
    try:
        if not under_torchrun:  # a one-rank run in this process left its world behind
            for k in _RANK_ENV:
                os.environ.pop(k, None)
        r = resolve(recipe, overrides)
        if r.layout.world_size > 1 and not under_torchrun:
            if not registry.resolve("launcher", str(r.cfg.launcher.name)).RUNS_HERE:
                _write_error(dump, f"probe skipped: it runs on this machine only (launcher {r.cfg.launcher.name})")
                return 0
            torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
            cmd = [torchrun, "--standalone", f"--nproc_per_node={r.layout.world_size}", "-m", "toolkit.probe",
                   f"--dump={dump}", f"--max-numel={max_numel}", *rest]
            prc = subprocess.call(cmd, env=clean_env())
            if prc != 0 and not (dump / "probe.json").is_file():
                _write_error(dump, f"probe under torchrun exited with {prc}")
            return 0 if train else prc
        probe(r, dump, max_numel)
        return 0
    except Exception as e:  # a probe failure must not hide a finished training run
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        print(msg, file=sys.stderr)
        if int(os.environ.get("RANK", "0")) == 0:
            _write_error(dump, msg)
        return 0 if train else 1


if __name__ == "__main__":
    sys.exit(main())
