"""Weight publication: the trainer's current weights as a HuggingFace folder for an RL generator.

``publish.interval=N`` (docs/skills/publish.md): the weights the run starts from (version
``step - 1`` of the first step, 0 for a fresh run) and then every N applied steps are written as
``DIR/step-V`` (``publish.dir``, default ``OUTPUT_DIR/weights``; the folder's layout and its atomic
writes: framework/train/published.py), a folder that transformers'
``AutoModelForCausalLM.from_pretrained``, vLLM and SGLang load as is: ``model.safetensors`` (or
shards of at most ``SHARD_BYTES`` with ``model.safetensors.index.json``), ``config.json``,
``generation_config.json``, the tokenizer files when ``data.tokenizer`` is an HF folder, and
``apiary_version.json`` (``{"version", "step", "run"}``).

Atomicity: a version is written to ``DIR/.step-V.tmp``, every file fsync'ed, then renamed to
``DIR/step-V``; only then is ``DIR/latest`` (a text file holding ``step-V``) replaced through a
temporary file and ``os.replace``. A reader that reads ``latest`` and then the folder it names
never sees a partial version. The newest ``publish.keep`` versions stay (never the one ``latest``
names is deleted); a deleted version is renamed aside first, so ``step-V`` is there whole or not
at all. Only folders publication wrote are pruned or replaced: a ``step-V`` folder without an
``apiary_version.json`` of version V (a checkpoint, anything a user put there) is never counted as a
version, deleted or written over; publishing over one stops the run with a UserError naming it
(framework/resolve/outputs.py refuses a publish.dir that overlaps the checkpoint folder or data.path before
launch).

What a version holds is a ``contracts.PublishedForm``: by default the model family's whole HF folder
(its ``hf_writer``); an adapter component may offer its own (``published_form``: a LoRA run's
adapters alone, in PEFT's files), with the state-dict keys to gather and the file names to write.

Getting the weights: the model is sharded (FSDP2 DTensors, expert parallel), so every rank calls
``publish`` (a collective): each model part's ``state_dict()`` (the checkpoint's names), each
DTensor all-gathered (``full_tensor``) in turn and copied to rank 0's host, and the model family's
``hf_writer`` (framework/contracts/protocols.py ``ModelFamily``) converts them to HF names and config.json.

Blocking: training waits for the gather (and, writing in the foreground, the conversion and the
write). ``publish.background``: ``true`` converts and writes in a background thread once the
tensors are on the host (copies, never the live parameters); ``auto`` does so for models above
``BACKGROUND_PARAMS`` parameters or once the last write took more than ``BACKGROUND_SHARE`` of the
mean step time; ``false`` never. A publication first waits for the previous background write;
``close()`` joins it; an error in a background write is raised at the next publication or at close.
Each publication logs one line on rank 0 and its times go to the next metrics record
(``publish/blocked_s``, ``publish/write_s``, ``publish/version``).

"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from framework import contracts
from framework.errors import UserError
from framework.train.published import prune, write_version

BACKGROUND_PARAMS = 1_000_000_000  # auto: larger models always write in the background
BACKGROUND_SHARE = 0.10  # auto: background once a write took more than this share of the mean step time


@dataclass
class PublishSettings:
    """What ``framework.train.build`` hands the trainer (``ApiaryTrainer.Config.publish``)."""

    interval: int  # publish every N applied steps (> 0)
    dir: str  # where step-V folders and `latest` go
    keep: int  # versions kept
    background: str  # auto | true | false
    convert: Callable[[dict], tuple[dict, dict]]  # the family's hf_writer: state dict -> (HF tensors, config.json)
    run: str = ""  # the run's output_dir (apiary_version.json)
    tokenizer_dir: str | None = None  # an HF tokenizer folder whose files are copied into each version
    n_params: int = 0  # the model's parameters (auto: background above BACKGROUND_PARAMS)
    dtype: str | None = None  # publish.dtype: floating tensors cast to it (on their device, before the copy)
    transport: Any = None  # the publish.transport component (contracts.Transport); None or IN_MEMORY False: folders
    transport_options: Any = None  # its options (the publish section)
    log: Any = None  # where a sender puts its times for the next metrics record: LOG (set below)
    form: Any = None  # contracts.PublishedForm: what a version holds (None: the family's whole folder from convert)


def settings(cfg, ctx, facts) -> PublishSettings | None:
    """PublishSettings of a resolved recipe (None when publish.interval is 0)."""
    p = cfg.publish
    if p.interval <= 0:
        return None
    out = Path(cfg.output_dir).absolute()
    tok = cfg.data.tokenizer
    tok_dir = str(tok) if tok and Path(str(tok)).is_dir() else None
    convert = ctx.components["model"].hf_writer(ctx.options["model"], ctx)
    adapter = ctx.components.get("adapter")
    of_adapter = contracts.member(adapter, "adapter", "published_form") if adapter is not None else None
    form = of_adapter(ctx.options["adapter"], ctx) if of_adapter is not None else None
    form = form if form is not None else contracts.PublishedForm(convert=convert)
    return PublishSettings(form=form,
                           interval=int(p.interval), dir=str(Path(p.dir).absolute() if p.dir is not None else out / "weights"),
                           keep=int(p.keep), background=str(p.background).lower(), convert=convert,
                           run=str(out), tokenizer_dir=tok_dir, n_params=int(facts.n_params or 0),
                           dtype=None if p.dtype is None else str(p.dtype),
                           transport=ctx.components.get("transport"), transport_options=ctx.options.get("transport"))


class PublishLog:
    """The last publications' times for the next metrics record (``publish/`` keys, rank 0)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rec: dict = {}

    def put(self, **kw) -> None:
        with self._lock:
            self._rec.update(kw)

    def take(self) -> dict:
        with self._lock:
            rec, self._rec = self._rec, {}
        return rec


LOG = PublishLog()


def _with_log(s: PublishSettings) -> PublishSettings:
    return s if s.log is not None else dataclasses.replace(s, log=LOG)


class Publisher:
    """Publishes the trainer's weights (see the module docstring). Every rank holds one; only
    rank 0 converts and writes."""

    def __init__(self, settings: PublishSettings, trainer: Any = None):
        self.s = _with_log(settings)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.dir = Path(settings.dir)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_version: int | None = None
        self._last_write_s = 0.0
        self._step_times: list[float] = []
        self._mark: float | None = None  # when the last step ended (step time = between two maybe_publish calls)
        self._first = True
        self._sender = None  # an in-memory transport's sender (publish.transport), made at its first version
        self.records: list[dict] = []  # rank 0: one per publication (version, blocked_s, write_s, background)
        self._pinned: dict[str, torch.Tensor] = {}  # rank 0 on CUDA: the host copies (pinned: ~20 GB/s, not ~3)
        self._waited = self._gathered = 0.0  # the last publication: waiting for the previous write; gathering
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for junk in list(self.dir.glob(".step-*.tmp")) + list(self.dir.glob(".step-*.del")) + \
                    list(self.dir.glob(".step-*.old")):  # a write an earlier run did not finish
                shutil.rmtree(junk, ignore_errors=True)

    # -- when -----------------------------------------------------------------------------------
    def maybe_publish(self, trainer, step: int) -> None:
        """After step ``step`` was applied: publish when it is a multiple of the interval."""
        now = time.perf_counter()
        if self._mark is not None:
            self._step_times.append(now - self._mark)
        if step % self.s.interval == 0:
            self.publish(trainer, step)
        self._mark = time.perf_counter()

    def _background(self) -> bool:
        if self.s.background in ("true", "false"):
            return self.s.background == "true"
        if self.s.n_params > BACKGROUND_PARAMS:
            return True
        if not self._step_times or not self._last_write_s:
            return False
        mean = sum(self._step_times[-50:]) / len(self._step_times[-50:])
        return self._last_write_s > BACKGROUND_SHARE * mean

    # -- what -----------------------------------------------------------------------------------
    def publish(self, trainer, version: int, initial: bool = False) -> None:
        """Publish the current weights as ``version`` (a collective: every rank calls it)."""
        if version == self._last_version:
            return
        if not initial and self._in_memory():  # every version after the first goes to the engine in memory
            if self._sender is None:
                self._join()
                self._sender = self.s.transport.sender(self.s.transport_options, self.s, trainer)
            self._sender.publish(trainer, version)
            self._last_version = version
            return
        t0 = time.perf_counter()
        self._join()  # the previous background write lands first (bounded host memory, ordered versions)
        self._waited = time.perf_counter() - t0
        sd = self._gather(trainer)
        background = self._background()
        if self.rank != 0:
            self._last_version = version
            return
        if background:
            sd = _detach_from(sd, trainer.model_parts)  # never write the live parameters from another thread
        blocked = time.perf_counter() - t0
        self._gathered = blocked - self._waited
        stale = version if (initial and self._first) else None  # a resume: drop versions past this one
        self._first = False
        if background:
            self._thread = threading.Thread(target=self._write_guarded, name="apiary-publish",
                                            args=(version, sd, blocked, True, stale), daemon=False)
            self._thread.start()
        else:
            self._write(version, sd, blocked, False, stale)
        self._last_version = version
        if initial and self._in_memory() and self._sender is None:  # the link file, for the engine that loads it
            self._join()
            self._sender = self.s.transport.sender(self.s.transport_options, self.s, trainer)

    def _gather(self, trainer) -> dict:
        """Full tensors of every model part on rank 0's host (an empty dict elsewhere). The modules'
        own ``state_dict()`` (as torchtitan's checkpointer reads it: its hooks give the canonical
        names, e.g. a fused QKV split into wq/wk/wv, which ``get_model_state_dict`` cannot map back
        to parameters), each DTensor all-gathered in turn, so at most one full tensor is on a device."""
        sd: dict = {}
        cast = getattr(torch, self.s.dtype) if self.s.dtype else None
        copied_async = False
        select = self.s.form.select if self.s.form is not None else None
        for part in trainer.model_parts:
            for k, v in part.state_dict().items():
                if select is not None and not select(k):
                    continue
                if isinstance(v, DTensor):
                    v = v.full_tensor()
                if self.rank == 0 and isinstance(v, torch.Tensor):
                    v = v.detach()
                    if cast is not None and v.is_floating_point() and not k.endswith("expert_bias_E"):
                        v = v.to(cast)
                    if v.device.type == "cuda":  # into a pinned host buffer kept across publications
                        buf = self._pinned.get(k)
                        if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                            buf = self._pinned[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                        buf.copy_(v, non_blocking=True)
                        sd[k], copied_async = buf, True
                    else:
                        sd[k] = v.to("cpu")
        if copied_async:
            torch.cuda.current_stream().synchronize()
        return sd

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread at the next call
            self._error = e

    def _write(self, version: int, sd: dict, blocked: float, background: bool, stale: int | None) -> None:
        t0 = time.perf_counter()
        form = self.s.form if self.s.form is not None else contracts.PublishedForm(convert=self.s.convert)
        tensors, hf_config = form.convert(sd)
        del sd
        if self.s.dtype and form.loader_files:  # a model folder's config.json names its dtype
            hf_config = {**hf_config, "torch_dtype": self.s.dtype, "dtype": self.s.dtype}
        path = write_version(self.dir, version, tensors, hf_config, run=self.s.run, tokenizer_dir=self.s.tokenizer_dir,
                             form=form)
        prune(self.dir, self.s.keep, newer_than=stale)
        write_s = time.perf_counter() - t0
        if not background:
            blocked += write_s
        self._last_write_s = write_s
        rec = {"version": version, "blocked_s": round(blocked, 4), "write_s": round(write_s, 4),
               "waited_s": round(self._waited, 4), "gather_s": round(self._gathered, 4), "background": background}
        self.records.append(rec)
        LOG.put(blocked_s=rec["blocked_s"], write_s=rec["write_s"], version=version)
        print(f"published {form.describe} {path.name} -> {self.dir} (blocked {blocked:.2f} s: waited {self._waited:.2f} s for "
              f"the previous write, gathered in {self._gathered:.2f} s; written in {write_s:.2f} s"
              f"{', in the background' if background else ''})", flush=True)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, UserError):
                raise e
            raise RuntimeError(f"apiary: publishing weights to {self.dir} failed: {e}") from e

    def _in_memory(self) -> bool:
        t = self.s.transport
        return t is not None and bool(t.IN_MEMORY)

    def flush(self, trainer) -> None:
        """An in-memory version deferred while the last transfer landed (``publish.when_busy=skip``) goes
        now (every rank calls it, between steps)."""
        if self._sender is not None:
            self._sender.flush(trainer)

    def close(self) -> None:
        """Wait for a background write or transfer to land (and raise its error, if any)."""
        try:
            self._join()
        finally:
            if self._sender is not None:
                sender, self._sender = self._sender, None
                sender.close()


def _detach_from(sd: dict, parts) -> dict:
    """``sd`` with every tensor that shares storage with the model (an unsharded CPU model's state
    dict holds the parameters themselves) replaced by a copy."""
    live = set()
    for part in parts:
        for t in (*part.parameters(), *part.buffers()):
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.device.type == "cpu":
                live.add(local.untyped_storage().data_ptr())
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in live:
            v = v.detach().clone()
        out[k] = v
    return out
