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
one version is in flight, and versions arrive in order. This module holds the components (imported
by every `--cfg job`, so torch-free); the sender that moves the weights is components/transport/sender.py.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from components.transport import link as link_mod
from framework.contracts import PlanTerms, Term
from framework.errors import UserError


@dataclass(kw_only=True)
class PublishOptions:
    """The recipe's ``publish:`` section as the ``transport`` kind reads it. Its keys, types,
    defaults and docs are framework/compose/schema.py's PublishConfig (contracts.make_options)."""


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


def _trains_routing_bias(ctx) -> bool:
    """The run trains the MoE routing bias (auxiliary-loss-free balancing) of a model with experts; an adapter run's
    bias is the base's, frozen."""
    cfg = ctx.cfg
    if cfg.moe.load_balance_coeff is None or str(cfg.adapter.name or "none") != "none":
        return False
    return bool(ctx.facts is not None and ctx.facts.num_experts)


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
        if not math.isfinite(options.engine_timeout) or options.engine_timeout <= 0:
            raise UserError(f"publish.engine_timeout={options.engine_timeout}", "must be a finite number > 0 (seconds).",
                            "For example publish.engine_timeout=600.")
        if ctx is not None and options.interval > 0 and _trains_routing_bias(ctx):
            ctx.summary.append(f"publish: the MoE routing bias that moe.load_balance_coeff trains is not part of the HF "
                               f"format, so {name} hands the engine the weights without it and the engine may route "
                               "some tokens differently; train with moe.load_balance_coeff=null for routing that matches")
        # checked where the ranks start: a job rendered here for a cluster (launcher=slurm) is checked on its nodes;
        # a run that publishes nothing (publish.interval=0, e.g. `apiary warmup` of a loop's recipe) starts no link
        if ctx is not None and ctx.for_training and str(ctx.cfg.launcher.name) == "local" and options.interval > 0:
            _port_free_or_refuse(options.engine)
            _vllm_or_refuse(name)
            import torch  # reason: the trainer's device, asked only when a local run starts

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
        from components.transport.sender import InMemorySender  # reason: torch, once a run publishes in memory

        return InMemorySender(cls.BACKEND, cls.NAME, options, settings, trainer)


class VllmIPC(_InMemory):
    """CUDA IPC to a vLLM engine on the trainer's rank-0 GPU (colocated)."""

    NAME = "vllm_ipc"
    BACKEND = "ipc"


class VllmNCCL(_InMemory):
    """NCCL broadcast from the trainer's rank 0 to a vLLM engine on other GPUs."""

    NAME = "vllm_nccl"
    BACKEND = "nccl"


