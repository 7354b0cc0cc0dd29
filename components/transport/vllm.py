"""In-memory weight hand-off to a vLLM engine: CUDA IPC on the same GPU, NCCL to other GPUs.

``publish.transport=vllm_ipc|vllm_nccl`` (docs/skills/transport.md, docs/rl.md). The first
publication of a run is still a folder (the generator starts its engine from it); every later one
goes in memory:

1. every rank takes part in ``Snapshot.fill`` (components/transport/snapshot.py): the sharded model
   gathered layer by layer, converted to the published folder's names on rank 0's GPU, cast to the
   wire dtype (``publish.dtype``) and copied into buckets allocated once (the training loop waits
   for this part only: ``publish/blocked_s``);
2. rank 0 then drives vLLM's weight-sync protocol over the engine link (components/transport/link.py)
   in a background thread (``publish.background=false``: in the loop): ``start_weight_update``,
   one ``update_weights`` per bucket, ``finish_weight_update(version)``. IPC passes each bucket's
   CUDA IPC handle (vLLM's packed format; the engine copies the tensors out and loads them); NCCL
   runs vLLM's trainer-side NCCL engine (``NCCLTrainerWeightTransferEngine``), which broadcasts the
   buckets from rank 0 to the engine's workers while they receive. The engine is paused from start to
   finish (``publish/engine_s``).

A publication waits for the previous transfer to land before it overwrites the buckets, so at most
one version is in flight, and versions arrive in order.
"""

from __future__ import annotations

import base64
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from components.transport import link as link_mod
from components.transport import snapshot
from framework.contracts import PlanTerms, Term
from framework.errors import UserError


@dataclass(kw_only=True)
class PublishOptions:
    """The recipe's ``publish:`` section as the ``transport`` kind reads it. Its keys, types,
    defaults and docs are framework/schema.py's PublishConfig (contracts.make_options)."""


def _vllm_or_refuse(name: str) -> None:
    try:
        import vllm  # noqa: F401  reason: optional dependency (pip install -e '.[vllm]')
        from vllm.distributed.weight_transfer import base  # noqa: F401
    except ImportError as e:
        raise UserError(f"publish.transport={name}", f"needs vLLM, which is not importable here ({e}).",
                        "Install it with pip install -e '.[vllm]' (docs/install.md), or publish folders with "
                        "publish.transport=hf_folder.") from None


def _port_free_or_refuse(address: str) -> None:
    """A fixed ``publish.engine`` port that something else holds: refused before launch."""
    host, port = link_mod.parse_address(address)
    if port == 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise UserError(f"publish.engine={address}", f"rank 0 cannot listen there for the engine ({e}).",
                        "Choose a free port, or port 0 (a free one, written to engine_link.json).") from None


class _InMemory:
    Options = PublishOptions
    IN_MEMORY = True
    BACKEND = ""
    NUMERICS = {"": "exact"}  # the trained weights are the same; only how they reach the engine differs
    SKILL = "transport"

    @classmethod
    def check(cls, options, ctx=None) -> None:
        name = cls.NAME
        try:
            link_mod.parse_address(options.engine)
        except ValueError as e:
            raise UserError(f"publish.engine={options.engine}", f"{e}.",
                            "The trainer's rank 0 listens there for the generator's engine.") from None
        if options.bucket_mb <= 0:
            raise UserError(f"publish.bucket_mb={options.bucket_mb}", "must be > 0 (MiB per transfer bucket).",
                            "For example publish.bucket_mb=1024.")
        if options.engine_timeout <= 0:
            raise UserError(f"publish.engine_timeout={options.engine_timeout}", "must be > 0 seconds.",
                            "For example publish.engine_timeout=600.")
        # checked where the ranks start: a job rendered here for a cluster (launcher=slurm) is checked on its nodes
        if ctx is not None and ctx.for_training and str(ctx.cfg.launcher.name) == "local":
            _port_free_or_refuse(options.engine)
            _vllm_or_refuse(name)
            if not torch.cuda.is_available():
                raise UserError(f"publish.transport={name}", "hands weights to a vLLM engine on a GPU, and this "
                                "machine has none.", "Use publish.transport=hf_folder (the default) on CPU.")

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        return None

    @classmethod
    def plan_terms(cls, options, ctx) -> PlanTerms:
        """Rank 0's buckets: the model once in the wire dtype (publish.dtype, else the trained fp32);
        NCCL adds vLLM's two send buffers of one bucket each."""
        p = ctx.cfg.publish
        wire = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(p.dtype), 4) if p.dtype else 4
        n = float(ctx.facts.n_params or 0)
        terms = [Term("transfer_buckets", n, wire, "buffers",
                      f"{n:,.0f} params x {wire} B ({p.dtype or 'float32'}), rank 0: the hand-off's buckets")]
        if cls.BACKEND == "nccl":
            bucket = min(n * wire, float(p.bucket_mb) * 2**20)
            terms.append(Term("transfer_send_buffers", 2, bucket, "buffers",
                              f"2 x one bucket ({bucket / 2**30:.2f} GiB), vLLM's NCCL sender"))
        return PlanTerms(memory=terms, notes=[f"publish.transport={cls.NAME}: rank 0 holds the weights once more "
                                              "for the engine"])

    @classmethod
    def sender(cls, options, settings, trainer):
        return InMemorySender(cls.BACKEND, cls.NAME, options, settings, trainer)


class VllmIPC(_InMemory):
    """CUDA IPC to a vLLM engine on the trainer's rank-0 GPU (colocated)."""

    NAME = "vllm_ipc"
    BACKEND = "ipc"


class VllmNCCL(_InMemory):
    """NCCL broadcast from the trainer's rank 0 to a vLLM engine on other GPUs."""

    NAME = "vllm_nccl"
    BACKEND = "nccl"


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
                  f"through {self.link.path}", flush=True)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._handles: list[str] = []
        self._nccl = None
        self._inited = False
        self.records: list[dict] = []
        self.log = settings.log  # the publication log the next metrics record reads (framework.publish.LOG)

    # -- the loop's part ---------------------------------------------------------------------------
    def publish(self, trainer, version: int) -> None:
        t0 = time.perf_counter()
        self._join()
        waited = time.perf_counter() - t0
        self.snap.fill(trainer.model_parts, self.to_hf)
        if self.rank != 0:
            return
        if self.snap.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the copies have landed before the engine reads them
        if not self.link.connected:
            try:
                hello = self.link.wait_connected()
            except link_mod.EngineError as e:
                raise UserError(f"publish.transport={self.name}", f"{e}.",
                                f"Start the generator (it loads {self.settings.dir}/latest, then connects), or raise "
                                "publish.engine_timeout; the run's checkpoints are kept.") from None
            if self.snap.device.type == "cuda":
                same_gpu_or_refuse(self.backend, str(torch.cuda.get_device_properties(self.snap.device.index).uuid),
                                   hello)
        blocked = time.perf_counter() - t0
        if self.background:
            self._thread = threading.Thread(target=self._send_guarded, args=(version, blocked, waited),
                                            name="apiary-transfer", daemon=False)
            self._thread.start()
        else:
            self._send(version, blocked, waited)

    def _send_guarded(self, *args) -> None:
        try:
            self._send(*args)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread at the next publication
            self._error = e

    def _send(self, version: int, blocked: float, waited: float) -> None:
        t0 = time.perf_counter()
        self.link.take_engine_s()
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


