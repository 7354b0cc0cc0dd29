"""The generator side of a live GRPO loop with vLLM as the engine and weights handed over in memory
(docs/rl.md, "vLLM in the loop").

The trainer runs with ``publish.transport=vllm_ipc`` (this engine on the trainer's GPU) or
``vllm_nccl`` (this engine on another GPU: start it with ``CUDA_VISIBLE_DEVICES`` naming that one).
This script loads the first version the trainer published as a folder (``WEIGHTS/latest``), starts
vLLM on it with a weight-transfer engine of the same backend, connects to the trainer through
``WEIGHTS/engine_link.json`` (components/transport/link.py describes the protocol; this file needs
only vLLM and the standard library), and then loops: apply the weight updates the trainer sent
(vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``; the version each
finish names is what the next records carry as ``policy_version``), sample a shard, write it.

Each shard: ``--prompts`` random byte prompts, ``--group`` completions each, sampled by vLLM at
``--temperature`` with the sampled tokens' log-probs (``old_logprobs``) and, with ``--routing``, the
experts each MoE layer routed each token to (``routed_experts``, for ``moe.routing_replay=true``).
The reward (the toy task of generator.py): the fraction of completion tokens that are lowercase
ASCII letters; advantages are normalised within each group (GRPO).

    CUDA_VISIBLE_DEVICES=0 python examples/rl_loop/vllm_generator.py --weights live/weights --out live/rollouts

``--serve`` only applies updates and answers probes (greedy tokens and their log-probs for given
prompts: tests/gpu/test_vllm_gpu.py, benchmarks/weight_sync_bench.py), writing no shards.

A LoRA run (``adapter=lora``, ``publish.transport=hf_folder``) publishes its adapters alone, as PEFT's
folder naming the base: the engine starts on that base with LoRA enabled, and each new version is
loaded as a LoRA adapter (vLLM's ``LoRARequest``, a new id per version) between shards; there is no
link. ``--probe-out FILE`` writes the greedy probe of the latest version (whole model or adapters) and
exits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shards.py beside this file
from shards import adapter_base, add_task_args, grpo_advantages, latest, reward, version_of, write_shard  # noqa: E402

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles arrive pickled (base64)



def wait_for(what, timeout: float, every: float = 0.1):
    end = time.time() + timeout
    while time.time() < end:
        got = what()
        if got:
            return got
        time.sleep(every)
    return None


class Engine:
    """A vLLM engine that takes weight updates over the trainer's link."""

    def __init__(self, folder: Path, backend: str | None, *, routing: bool, memory: float, max_len: int, seed: int,
                 eager: bool = True, gdn_prefill: str = "triton", log: Path | None = None):
        from vllm import LLM  # reason: imported after the environment is set

        base = adapter_base(folder)  # a LoRA run's version: adapters for this base
        kw = {"weight_transfer_config": {"backend": backend}} if backend and base is None else {}
        if base is not None:
            kw.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank(folder))
        model = base if base is not None else folder
        self.llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=eager,
                       gpu_memory_utilization=memory, max_model_len=max_len, seed=seed,
                       logprobs_mode="processed_logprobs", enable_return_routed_experts=routing,
                       gdn_prefill_backend=gdn_prefill, **kw)
        self.config = json.loads((model / "config.json").read_text())
        self.conn = None
        self.closed = False  # the trainer closed the link (its run ended): no more versions come
        self.updates: list[dict] = []  # per applied update: version, seconds paused
        self.log = log  # each update is appended here as it lands (a killed generator keeps the ones before)
        if log is not None:
            log.write_text("")
        self.lora = None  # the LoRARequest of the adapters in use
        self.version = version_of(folder)
        if base is not None:
            self.use_adapters(folder)

    def use_adapters(self, folder: Path) -> None:
        """Sample with the adapters of ``folder`` from now on (vLLM loads them at the next generate)."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        version = version_of(folder)
        request = LoRARequest(f"step-{version}", version + 1, str(folder))
        # loaded now, so its time is the update's (it would otherwise load inside the next generate); the
        # adapters in use before are dropped once the new ones are in
        self.llm.llm_engine.add_lora(request)
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
        self.version, self.lora = version, request
        self.applied({"version": version, "paused_s": time.perf_counter() - t0, "adapters": True})

    def applied(self, update: dict) -> None:
        """One update landed: kept, appended to the log file, and said on the console."""
        self.updates.append(update)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps(update) + "\n")
        what = "adapters" if update.get("adapters") else "weights"
        print(f"vllm_generator: version {update['version']} {what} applied, engine paused {update['paused_s']:.3f} s",
              flush=True)

    def poll_adapters(self, weights: Path) -> bool:
        """Take the newest published adapters when they are newer than those in use."""
        folder = latest(weights)
        if self.lora is None or folder is None or not (folder / "adapter_config.json").is_file():
            return False
        try:
            v = version_of(folder)
        except (OSError, ValueError, KeyError):  # pruned or replaced while read: the next poll takes it
            return False
        if v <= self.version:
            return False
        self.use_adapters(folder)
        return True

    # -- the link ------------------------------------------------------------------------------------
    def connect(self, weights: Path, timeout: float) -> None:
        import torch

        f = weights / "engine_link.json"
        info = wait_for(lambda: json.loads(f.read_text()) if f.is_file() else None, timeout)
        if info is None:
            raise SystemExit(f"vllm_generator: no {f} after {timeout:.0f} s (is the trainer's "
                             "publish.transport vllm_ipc or vllm_nccl?)")
        self.conn = Client((info["host"], info["port"]), authkey=bytes.fromhex(info["authkey"]))
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        self.conn.send({"hello": 1, "gpu_uuids": uuids, "world_size": 1, "hf_config": self.config})
        answer = self.conn.recv()
        if "error" in answer:
            raise SystemExit(f"vllm_generator: the trainer refused this engine: {answer['error']}")

    def serve(self, block: bool) -> bool:
        """Handle the trainer's requests: when one is waiting (or ``block``), until an update has been
        finished (or a probe answered). False once the trainer closed the link."""
        if self.conn is None:  # no link (a LoRA run's adapters arrive as folders), or the trainer closed it
            return not self.closed
        if not (block or self.conn.poll(0)):
            return True
        paused_at = None
        while True:
            try:
                method, arg = self.conn.recv()
            except (EOFError, OSError):
                self.conn, self.closed = None, True
                return False
            if method == "close":
                self.conn.close()
                self.conn, self.closed = None, True
                return False
            t0 = time.perf_counter()
            try:
                if method == "init_weight_transfer_engine":
                    self.llm.init_weight_transfer_engine({"init_info": arg})
                elif method == "start_weight_update":
                    paused_at = t0
                    self.llm.start_weight_update()
                elif method == "update_weights":
                    self.llm.update_weights({"update_info": arg})
                elif method == "finish_weight_update":
                    self.llm.finish_weight_update(weight_version=arg)
                    self.llm.reset_prefix_cache()
                    self.version = int(arg) if arg is not None else self.version + 1
                elif method == "probe":
                    self.conn.send(("ok", self.probe(**arg)))
                    return True
                else:
                    raise ValueError(f"unknown request {method!r}")
            except Exception as e:  # noqa: BLE001 - the trainer gets the message, the engine stays up
                self.conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            self.conn.send(("ok", time.perf_counter() - t0))
            if method == "finish_weight_update":
                self.applied({"version": self.version, "paused_s": time.perf_counter() - paused_at})
                return True
            if method == "init_weight_transfer_engine":
                return True

    # -- sampling --------------------------------------------------------------------------------------
    def probe(self, prompts: list[list[int]], tokens: int) -> dict:
        """Greedy continuations of ``prompts`` and their tokens' log-probs (deterministic)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, logprobs=0,
                            detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=self.lora)
        return {"version": self.version,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                             for o in outs]}

    def score(self, seqs: list[list[int]], adapters: bool = True) -> list[list[float]]:
        """Teacher-forced log-probs of every token of ``seqs`` after the first (the prompt log-probs),
        with the adapters in use, or the base alone (``adapters=False``)."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": q} for q in seqs], sp, use_tqdm=False,
                                 lora_request=self.lora if adapters else None)
        return [[lp[t].logprob for t, lp in zip(q[1:], o.prompt_logprobs[1:])] for q, o in zip(seqs, outs)]

    def sample(self, prompts: list[list[int]], group: int, tokens: int, temperature: float, seed: int,
               routing: bool) -> list[list[tuple]]:
        """Per prompt, ``group`` (completion, its log-probs, routed experts of prompt + completion or None)."""
        from vllm import SamplingParams

        sp = [SamplingParams(n=group, temperature=temperature, max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                             logprobs=0, detokenize=False, seed=seed + i) for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=self.lora)
        result = []
        for p, o in zip(prompts, outs):
            rows = []
            for c in o.outputs:
                ids = list(c.token_ids)
                lps = [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
                routed = None
                if routing:
                    r = c.routed_experts  # [len(prompt) + len(ids) - 1, layers, k]: every token but the last
                    if r is None:
                        raise SystemExit("vllm_generator: --routing, but vLLM returned no routed_experts")
                    routed = r.tolist()
                    routed.append(routed[-1])  # the last token's forward predicts nothing that is trained
                rows.append((ids, lps, routed))
            result.append(rows)
        return result



def lora_rank(folder: Path) -> int:
    """The smallest of vLLM's accepted max_lora_rank values that holds the adapters' largest rank."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    r = max([int(cfg["r"]), *map(int, (cfg.get("rank_pattern") or {}).values())])
    return next((x for x in (8, 16, 32, 64, 128, 256, 320, 512) if x >= r), r)


def probe_prompts(n: int = 4, length: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, required=True, help="the trainer's publish.dir")
    p.add_argument("--out", type=Path, help="the trainer's data.path (data.follow=true)")
    p.add_argument("--backend", choices=("ipc", "nccl"), default="ipc",
                   help="the trainer's publish.transport: vllm_ipc -> ipc, vllm_nccl -> nccl")
    add_task_args(p)
    p.add_argument("--shards", type=int, default=0, help="stop after this many shards (0: until the trainer ends)")
    p.add_argument("--patience", type=float, default=30.0,
                   help="seconds to wait for the next version before sampling with the weights at hand")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the first weights and the link")
    p.add_argument("--routing", action="store_true", help="write routed_experts for moe.routing_replay=true")
    p.add_argument("--memory", type=float, default=0.25, help="vLLM's gpu_memory_utilization")
    p.add_argument("--max-len", type=int, default=1024, help="vLLM's max_model_len")
    p.add_argument("--gdn-prefill", choices=("triton", "flashinfer", "auto"), default="triton",
                   help="vLLM's GatedDeltaNet prefill kernels (Qwen3.5): triton needs no JIT build on a fresh machine, "
                   "where flashinfer's took over 60 s before the first sample")
    p.add_argument("--serve", action="store_true", help="only apply updates and answer probes")
    p.add_argument("--log", type=Path, help="append each update's times here (jsonl) as it lands")
    p.add_argument("--probe-out", type=Path, help="write the greedy probe of the latest version (JSON) and exit")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    folder = wait_for(lambda: latest(a.weights), a.wait)
    if folder is None:
        print(f"vllm_generator: no weights in {a.weights} after {a.wait:.0f} s", file=sys.stderr)
        return 1
    eng = Engine(folder, a.backend, routing=a.routing, memory=a.memory, max_len=a.max_len, seed=a.seed,
                 gdn_prefill=a.gdn_prefill, log=a.log)
    if a.probe_out is not None:  # the greedy probe, and the teacher-forced log-probs of fixed sequences
        seqs = probe_prompts(4, 64, seed=1)
        got = {**eng.probe(probe_prompts(), 16), "scored": eng.score(seqs)}
        if eng.lora is not None:
            got["scored_base"] = eng.score(seqs, adapters=False)
        a.probe_out.write_text(json.dumps(got))
        return 0
    if eng.lora is None:
        eng.connect(a.weights, a.wait)
        print(f"vllm_generator: engine on {folder} (version {eng.version}), linked to the trainer ({a.backend})",
              flush=True)
    else:
        print(f"vllm_generator: engine on the base {adapter_base(folder)} with the adapters of {folder} "
              f"(version {eng.version}); new versions load as LoRA adapters", flush=True)
    if a.serve:
        while eng.serve(block=True):
            pass
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    index = len([f for f in a.out.iterdir() if f.suffix == ".jsonl" and not f.name.startswith(".")])
    used = None
    while a.shards == 0 or index < a.shards:
        if not eng.serve(block=False) or eng.closed:  # the trainer ended: stop sampling
            break
        eng.poll_adapters(a.weights)
        if used == eng.version:  # on-policy: wait (bounded) for the version this shard trains into
            end = time.time() + a.patience
            while eng.conn is not None and used == eng.version and time.time() < end:
                if eng.conn.poll(0.05) and not eng.serve(block=True):
                    break
            while eng.lora is not None and not eng.poll_adapters(a.weights) and time.time() < end:
                time.sleep(0.05)
            if eng.closed:  # the run ended while this shard waited for its version
                break
        used = eng.version
        prompts = [[rng.randrange(256) for _ in range(a.prompt_tokens)] for _ in range(a.prompts)]
        groups = eng.sample(prompts, a.group, a.new_tokens, a.temperature, a.seed * 1_000_003 + index, a.routing)
        records, rewards = [], []
        for i, (prompt, rows) in enumerate(zip(prompts, groups)):
            rs = [reward(ids) for ids, _, _ in rows]
            adv = grpo_advantages(rs)
            for j, (ids, lps, routed) in enumerate(rows):
                records.append({
                    "input_ids": prompt + ids,
                    "loss_mask": [0] * len(prompt) + [1] * len(ids),
                    "old_logprobs": [0.0] * len(prompt) + lps,
                    "advantages": adv[j],
                    "policy_version": used,
                    "sequence_id": f"{index:06d}-{i * a.group + j}",
                    "group_id": f"{index:06d}-{i}",
                    "reward": rs[j],
                    **({"routed_experts": routed} if routed is not None else {}),
                })
            rewards += rs
        write_shard(a.out, index, records)
        print(f"vllm_generator: shard {index} from version {used}: mean reward "
              f"{sum(rewards) / len(rewards):.3f}", flush=True)
        index += 1
    while eng.conn is not None and eng.serve(block=True):  # the trainer's last updates, until it closes the link
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
