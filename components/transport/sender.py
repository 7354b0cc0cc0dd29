"""The sender of an in-memory transport (components/transport/vllm.py): the buckets, the engine link,
and vLLM's weight-sync protocol driven from rank 0 (CUDA IPC handles, or vLLM's trainer-side NCCL
engine)."""

from __future__ import annotations

import base64
import contextlib
import pickle
import socket
import threading
import time
from functools import cached_property

import torch
import torch.distributed as dist

from components.transport import link as link_mod
from components.transport import snapshot
from framework.errors import UserError


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class InMemorySender:
    """One per rank; rank 0 holds the buckets and the link."""

    def __init__(self, backend: str, name: str, options, settings, trainer):
        self.backend, self.name = backend, name
        self.settings = settings
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.timeout = float(options.engine_timeout)
        self.background = str(options.background).lower() != "false"
        self.skip_busy = str(options.when_busy) == "skip"  # publish.when_busy: defer a version due mid-transfer
        self.deferred: int | None = None  # the newest version deferred so (its weights are the trainer's now)
        self.to_hf = settings.convert.to_hf
        meta = snapshot.meta_state(trainer.model_parts)
        trained = next((v.dtype for v in meta.values() if v.is_floating_point()), torch.float32)
        self.plan = snapshot.plan(meta, self.to_hf, snapshot.wire_dtype(settings.dtype, trained),
                                  int(options.bucket_mb) * 2**20)
        # rank 0's GPU; without one (tests of the protocol only: check() refuses a CPU training run) the host
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        from framework.compat import plain_cuda_segments  # reason: CUDA only
        with plain_cuda_segments():  # CUDA IPC cannot export expandable-segment memory
            self.snap = snapshot.Snapshot(self.plan, device, holder=self.rank == 0)
        self.link = None
        if self.rank == 0:
            try:
                self.link = link_mod.EngineLink(settings.dir, options.engine, settings.convert.hf_config, transport=name)
            except link_mod.EngineError as e:
                raise UserError(f"publish.engine={options.engine}", f"{e}.", "Choose a free port (port 0 picks one), "
                                "or stop what listens there.") from None
            self.link.start_accepting(self.timeout)
            print(f"publish.transport={name}: {len(self.plan.buckets)} bucket(s), "
                  f"{self.plan.nbytes / 2**30:.2f} GiB of {self.plan.dtype_name} on {device}; the engine connects "
                  f"through {self.link.path}; waiting for it before the first step", flush=True)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._handles: list[str] = []
        self._nccl = None
        self._stream = None  # the transfer thread's CUDA stream (_transfer_stream)
        self._inited = False
        self.records: list[dict] = []
        self.log = settings.log  # the publication log the next metrics record reads (framework.train.publish.LOG)
        if self.link is not None:
            self._await_engine()

    def _await_engine(self) -> None:
        """Rank 0: wait (publish.engine_timeout) for the engine's hello. The sender is made at the first
        publication, so the trainer starts its first step only once the engine is up: vLLM sizes its KV
        cache from the memory it sees while it starts, and a trainer sharing the GPU (IPC) that grows its
        activations meanwhile left it none ("No available memory for the cache blocks", on an H200)."""
        try:
            hello = self.link.wait_connected()
        except link_mod.EngineError as e:
            raise UserError(f"publish.transport={self.name}", f"{e}.",
                            f"Start the generator (it loads {self.settings.dir}/latest, then connects), or raise "
                            "publish.engine_timeout; the run's checkpoints are kept.") from None
        if self.snap.device.type == "cuda":
            same_gpu_or_refuse(self.backend, str(torch.cuda.get_device_properties(self.snap.device.index).uuid), hello)

    # -- the loop's part ---------------------------------------------------------------------------
    def publish(self, trainer, version: int, defer: bool = True) -> bool:
        """Hand ``version`` (the trainer's current weights) to the engine (a collective: every rank calls it).
        With ``publish.when_busy=skip`` and the last transfer still landing, nothing moves: the version is
        deferred (False) until the next publication or ``flush``."""
        if self.skip_busy and defer and self._busy():
            self.deferred = version
            if self.rank == 0:
                self.log.put(deferred=version)
            return False
        self.deferred = None
        t0 = time.perf_counter()
        self._join()
        waited = time.perf_counter() - t0
        self.snap.fill(trainer.model_parts, self.to_hf)
        if self.rank != 0:
            return True
        # the copies are queued on the training stream behind the step that made these weights and before the
        # next one; the sender waits for them to land (the event) before the engine may read, so the training
        # thread never waits for the GPU here (a host synchronize cost a whole queued step)
        landed = self._mark_landed()
        if not self.link.connected:
            self._await_engine()
        blocked = time.perf_counter() - t0
        if self.background:
            self._thread = threading.Thread(target=self._send_guarded, args=(version, blocked, waited, landed),
                                            name="apiary-transfer", daemon=False)
            self._thread.start()
        else:
            self._send(version, blocked, waited, landed)
        return True

    def _mark_landed(self):
        """An event on the training stream behind the snapshot's copies (None off a GPU); blocking, so the
        sender thread sleeps on it rather than spinning a core for a training step."""
        if self.snap.device.type != "cuda":
            return None
        landed = torch.cuda.Event(blocking=True)
        landed.record(torch.cuda.current_stream(self.snap.device))
        return landed

    def flush(self, trainer) -> None:
        """The deferred version, now (the trainer is between steps, so its weights are still that version's):
        before the trainer waits for rollouts the engine may need, and before the run ends."""
        if self.deferred is not None:
            self.publish(trainer, self.deferred, defer=False)

    def _busy(self) -> bool:
        """Whether the last transfer is still landing, as rank 0 sees it; every rank gets rank 0's answer."""
        busy = self._thread is not None and self._thread.is_alive()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([int(busy)], device=self.snap.device)
            dist.broadcast(t, src=0)
            busy = bool(t.item())
        return busy

    def _send_guarded(self, *args) -> None:
        try:
            self._send(*args)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread at the next publication
            self._error = e

    def _send(self, version: int, blocked: float, waited: float, landed=None) -> None:
        t0 = time.perf_counter()
        if landed is not None:
            landed.synchronize()  # the snapshot's copies have landed before the engine reads them
        self.link.take_engine_s()
        with self._transfer_stream():
            if self.backend == "ipc":
                self._send_ipc(version)
            else:
                self._send_nccl(version)
        transfer = time.perf_counter() - t0
        engine = self.link.take_engine_s()
        if not self.background:
            blocked += transfer
        rec = {"version": version, "blocked_s": round(blocked, 4), "transfer_s": round(transfer, 4),
               "engine_s": round(engine, 4), "waited_s": round(waited, 4), "background": self.background}
        self.records.append(rec)
        self.log.put(blocked_s=rec["blocked_s"], transfer_s=rec["transfer_s"], engine_s=rec["engine_s"], version=version)
        print(f"published weights step-{version} -> engine ({self.name}; blocked {blocked:.3f} s, transferred in "
              f"{transfer:.3f} s, engine paused {engine:.3f} s{', in the background' if self.background else ''})",
              flush=True)

    def _transfer_stream(self):
        """The transfer's own device and CUDA stream in this thread: vLLM's NCCL sender syncs the current
        stream after it sends, which would otherwise be the training stream with the next step queued."""
        if self.snap.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.snap.device)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.snap.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def _send_ipc(self, version: int) -> None:
        if not self._handles:
            self._handles = [base64.b64encode(pickle.dumps(_ipc_handle(buf))).decode() for buf in self.snap.buffers]
        if not self._inited:
            self.link.init_weight_transfer_engine({"packed": True})
            self._inited = True
        self.link.start_weight_update()
        dtype = self.plan.dtype_name
        for b, handle in zip(self.plan.buckets, self._handles):
            self.link.update_weights({"names": b.names, "dtype_names": [dtype] * len(b.entries), "shapes": b.shapes,
                                      "ipc_handles_pickled": handle, "tensor_sizes": b.sizes})
        self.link.finish_weight_update(str(version))

    def _send_nccl(self, version: int) -> None:
        if self._nccl is None:
            from vllm.distributed.weight_transfer import nccl_engine  # reason: optional dependency
            NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine = (nccl_engine.NCCLTrainerInitInfo,
                                                                     nccl_engine.NCCLTrainerWeightTransferEngine)
            host = self.link.address[0]
            if host in ("0.0.0.0", "", "::"):
                host = socket.gethostbyname(socket.gethostname())
            workers = int(self.link.hello.get("world_size", 1))
            init = NCCLTrainerInitInfo(master_address=host, master_port=_free_port(host), world_size=1 + workers,
                                       rank=0, packed=True,
                                       packed_buffer_size_bytes=max(b.nbytes for b in self.plan.buckets))
            self._nccl = NCCLTrainerWeightTransferEngine.trainer_init(
                init, client=_Versioned(self.link, version), source=_source(self.snap))
        self._nccl.client.version = str(version)
        self._nccl.send_weights()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, link_mod.EngineError):
                raise UserError(f"publish.transport={self.name}", f"{e}.",
                                "Check the generator's log; the run's checkpoints are kept.") from e
            raise RuntimeError(f"apiary: handing weights to the engine failed: {e}") from e

    def close(self) -> None:
        try:
            self._join()
        finally:
            if self._nccl is not None:
                self._nccl.shutdown()
            if self.link is not None:
                self.link.close()


def same_gpu_or_refuse(backend: str, trainer_uuid: str, hello: dict) -> None:
    """CUDA IPC shares memory on one GPU: an IPC engine whose GPUs (its hello's ``gpu_uuids``) do not
    include rank 0's is refused before any transfer (it could not open a handle)."""
    if backend == "ipc" and trainer_uuid not in (hello.get("gpu_uuids") or []):
        raise UserError("publish.transport=vllm_ipc", f"the engine runs on GPU(s) {hello.get('gpu_uuids')}, not on the "
                        f"trainer's rank-0 GPU {trainer_uuid}, and CUDA IPC shares memory within one GPU.",
                        "Start the generator on the trainer's GPU (CUDA_VISIBLE_DEVICES), or hand weights to an "
                        "engine on other GPUs with publish.transport=vllm_nccl (generator --backend nccl).")


def _ipc_handle(buf: torch.Tensor) -> dict:
    """{GPU uuid: torch's CUDA IPC rebuild arguments} of a bucket (what vLLM's packed consumer opens);
    for a host bucket (protocol tests without a GPU) its address, which no engine can open."""
    if buf.device.type != "cuda":
        return {"host": (buf.data_ptr(), buf.numel())}
    from torch.multiprocessing.reductions import reduce_tensor  # reason: CUDA buckets only
    _, args = reduce_tensor(buf)
    return {str(torch.cuda.get_device_properties(buf.device.index).uuid): args}


class _Versioned:
    """The link, with the version ``finish_weight_update`` reports filled in (vLLM's NCCL trainer
    engine finishes without one)."""

    def __init__(self, link, version):
        self.link, self.version = link, str(version)

    def init_weight_transfer_engine(self, init_info):
        self.link.init_weight_transfer_engine(init_info)

    def start_weight_update(self):
        self.link.start_weight_update()

    def update_weights(self, update_info):
        self.link.update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        self.link.finish_weight_update(weight_version or self.version)


def _source(snap):
    """vLLM's ``WeightSource`` over the snapshot: every tensor, in the plan's order (rank 0 holds all)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource  # reason: optional dependency

    class SnapshotSource(WeightSource):
        @cached_property
        def metadata(self):
            return [ParamMeta(e.name, snap.plan.dtype, e.shape) for e in snap.plan.entries()]

        def iter_full(self):
            for i in range(len(snap.plan.buckets)):
                yield from snap.tensors(i)

    return SnapshotSource()


