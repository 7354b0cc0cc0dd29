"""The generator side of a live GRPO loop with apiary as the trainer (docs/rl.md).

It uses transformers only (no apiary import): it loads the newest weights the trainer published
(``WEIGHTS/latest`` names a complete ``step-N`` folder), samples ``--group`` completions for each of
``--prompts`` prompts, scores them with a rule-based reward, normalizes the rewards within each
group (GRPO's advantages), computes the log-probs of the sampled tokens under the same weights, and
writes one shard of records into ``OUT`` (written as ``.NAME.tmp`` and renamed, names in write
order), each record carrying the ``policy_version`` it was sampled with.

The toy task ("answer in lowercase letters"): prompts are random byte strings; the reward of a
completion is the fraction of its tokens that are lowercase ASCII letters (byte ids 97-122 of the
byte tokenizer). A randomly initialised tiny model starts near 26/320 and GRPO raises it.

One shard per published version (on-policy, lag 0, when each shard fills one trainer step); if no
new version appears within ``--patience`` seconds the next shard is sampled with the weights at
hand, so a trainer that needs more rows than a shard gives never waits forever.

    python examples/rl_loop/generator.py --weights RUN/weights --out ROLLOUTS --seed 0

``--routing`` also writes each token's ``routed_experts`` (the experts every MoE layer chose in the
forward that computed ``old_logprobs``), for a trainer with ``moe.routing_replay=true``.

A LoRA run (``adapter=lora``) publishes its adapters alone (PEFT's folder naming its base): each
version is loaded onto that base with peft and merged.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shards.py beside this file
from shards import adapter_base, add_task_args, grpo_advantages, latest, reward, version_of, write_shard  # noqa: E402

SAY_EVERY_S = 30.0  # how often a generator waiting for the first weights says so

class _NotCacheRename(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "are deprecated. Use `cache` instead" not in str(record.msg)


@contextlib.contextmanager
def quiet_cache_rename():
    """transformers 5 renamed the forward's ``past_key_values`` to ``cache`` and warns (a FutureWarning
    and a log line) when the old name is used; the generator passes and reads the old name, which every
    transformers it runs with takes. Those two are dropped around its own forward only; other warnings show."""
    generic = hf_logging.get_logger("transformers.utils.generic")
    quiet = _NotCacheRename()
    generic.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
            yield
    finally:
        generic.removeFilter(quiet)


@contextlib.contextmanager
def no_loading_bar():
    """transformers' "Loading weights" bar, printed at every published version: off while the generator
    loads one (the generator's own line per shard names the version), then as it was."""
    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.enable_progress_bar()
    else:
        yield


def load(folder: Path):
    """The published version in ``folder``: a whole model, or (a LoRA run) adapters that peft applies to
    the base folder they name, merged so that sampling and routing read one plain model."""
    base = adapter_base(folder)
    with no_loading_bar():
        model = AutoModelForCausalLM.from_pretrained(base if base is not None else folder, dtype=torch.float32)
    if base is not None:
        from peft import PeftModel  # reason: only LoRA runs need peft

        model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    model.eval()
    return model, version_of(folder)


@torch.no_grad()
def sample_group(model, prompt: list[int], group: int, new_tokens: int, temperature: float, gen) -> torch.Tensor:
    """``group`` sampled continuations of ``prompt``: [group, len(prompt) + new_tokens] token ids
    (plain ancestral sampling at ``temperature`` over the whole vocabulary, the distribution the
    trainer's log-probs describe)."""
    ids = torch.tensor([prompt] * group)
    past = None
    step_ids = ids
    for _ in range(new_tokens):
        with quiet_cache_rename():
            out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
        step_ids = nxt
    return ids


def routers(model) -> list:
    """The MoE routers in forward order (transformers' qwen3_moe: each sparse block's ``gate``, whose
    forward returns (logits, weights, top-k expert ids))."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@torch.no_grad()
def token_logprobs(model, ids: torch.Tensor, temperature: float, routing: bool = False):
    """log p(ids[:, t] | ids[:, :t]) for t >= 1 (0 at t = 0), one full forward, fp32; with ``routing``
    also the experts each MoE layer routed each token to in that forward: [B, L, n_moe_layers, k]."""
    seen, hooks = [], []
    if routing:
        hooks = [r.register_forward_hook(lambda mod, args, out: seen.append(out[2])) for r in routers(model)]
    try:
        logits = model(input_ids=ids).logits.float() / temperature
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)
    if not routing:
        return lp, None
    if not seen:
        raise SystemExit("generator: --routing needs an MoE model with top-k routers (qwen3_moe)")
    return lp, torch.stack([s.reshape(*ids.shape, -1) for s in seen], dim=2)



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, required=True, help="the trainer's publish.dir")
    p.add_argument("--out", type=Path, required=True, help="the trainer's data.path (data.follow=true)")
    add_task_args(p)
    p.add_argument("--shards", type=int, default=0, help="stop after this many shards (0: until stopped)")
    p.add_argument("--patience", type=float, default=5.0,
                   help="seconds to wait for a new version before sampling another shard with the current one")
    p.add_argument("--wait", type=float, default=300.0,
                   help="seconds to wait for the first weights (default: %(default)s; said every 30 s while waiting)")
    p.add_argument("--routing", action="store_true",
                   help="write routed_experts (the experts each MoE layer chose per token) for moe.routing_replay")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    index = len([f for f in a.out.iterdir() if f.suffix == ".jsonl" and not f.name.startswith(".")])
    model, version, used = None, -1, None
    t0, said = time.time(), 0.0
    while a.shards == 0 or index < a.shards:
        folder = latest(a.weights)
        if folder is None or folder == used:
            waited = time.time() - t0
            if folder is None and waited > a.wait:
                print(f"generator: no weights in {a.weights} after {waited:.0f} s", file=sys.stderr)
                return 1
            if folder is None and waited >= said + SAY_EVERY_S:  # a trainer that failed to start leaves this waiting
                said = waited
                print(f"generator: waiting for the trainer's first weights in {a.weights}: {waited:.0f} s "
                      f"(gives up after --wait {a.wait:.0f} s; is the trainer running?)", flush=True)
            if folder is None or waited < a.patience:
                time.sleep(0.05)
                continue
        if folder != used and folder is not None:
            try:
                model, version = load(folder)
            except (OSError, ValueError, KeyError):  # pruned or replaced while read: take the next
                time.sleep(0.05)
                continue
            used = folder
        records, rewards = [], []
        for i in range(a.prompts):
            prompt = torch.randint(0, 256, (a.prompt_tokens,), generator=gen).tolist()
            ids = sample_group(model, prompt, a.group, a.new_tokens, a.temperature, gen)
            lps, routed = token_logprobs(model, ids, a.temperature, a.routing)
            rs = [reward(row[a.prompt_tokens:].tolist()) for row in ids]
            adv = grpo_advantages(rs)
            for j, row in enumerate(ids.tolist()):
                records.append({
                    "input_ids": row,
                    "loss_mask": [0] * a.prompt_tokens + [1] * a.new_tokens,
                    "old_logprobs": [0.0] * a.prompt_tokens + lps[j, a.prompt_tokens:].tolist(),
                    "advantages": adv[j],
                    "policy_version": version,
                    "sequence_id": f"{index:06d}-{i * a.group + j}",
                    "group_id": f"{index:06d}-{i}",
                    "reward": rs[j],
                    **({"routed_experts": routed[j].tolist()} if routed is not None else {}),
                })
            rewards += rs
        write_shard(a.out, index, records)
        print(f"generator: shard {index} from version {version}: mean reward {sum(rewards) / len(rewards):.3f}",
              flush=True)
        index += 1
        t0 = time.time()
    return 0


if __name__ == "__main__":
    sys.exit(main())
