"""Writes tiny_rollouts.jsonl, the packaged rollouts of the CPU recipe ``debug_grpo``:
``python -m components.data.make_tiny_rollouts``.

A synthetic task on the byte tokenizer (ids 0-255 bytes, 256 BOS, 257 EOS): each prompt is a
line of the packaged corpus, with 4 sampled responses; two continue the prompt's document
(reward 1) and two are shuffled bytes of the same continuation (reward 0). Advantages are
GRPO's group-normalised rewards. old_logprobs stand for a sampler with a near-uniform policy
(-ln 320 per token, what the tiny models' initial logits give), so the first importance ratios
are close to 1. Deterministic (seeded); 64 prompts x 4 responses.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from components.data.rollouts import read_rollouts  # noqa: F401  (format reference)
from components.losses.rl import group_advantages

HERE = Path(__file__).parent
OUT = HERE / "tiny_rollouts.jsonl"
BOS, EOS = 256, 257


def make(n_prompts: int = 64, group: int = 4, prompt_len: int = 32, response_len: int = 48, seed: int = 0):
    rng = random.Random(seed)
    texts = [json.loads(line)["text"].encode() for line in (HERE / "tiny_corpus.jsonl").read_text().splitlines()]
    texts = [t for t in texts if len(t) >= 4 * (prompt_len + response_len)]
    records = []
    for p in range(n_prompts):
        doc = texts[p % len(texts)]
        start = rng.randrange(0, len(doc) - 2 * (prompt_len + response_len))
        prompt = [BOS, *doc[start:start + prompt_len]]
        good = list(doc[start + prompt_len:start + prompt_len + response_len])
        rewards, responses = [], []
        for k in range(group):
            if k % 2 == 0:
                resp = good
                rewards.append(1.0)
            else:
                resp = good[:]
                rng.shuffle(resp)
                rewards.append(0.0)
            responses.append(resp + [EOS])
        adv = group_advantages(torch.tensor(rewards), torch.zeros(group, dtype=torch.long)).tolist()
        for k, resp in enumerate(responses):
            ids = prompt + resp
            mask = [0] * len(prompt) + [1] * len(resp)
            old = [0.0] * len(prompt) + [round(-math.log(320.0), 4)] * len(resp)
            records.append({"input_ids": ids, "loss_mask": mask, "old_logprobs": old,
                            "advantages": round(adv[k], 6), "sequence_id": p * group + k, "group_id": p})
    return records


if __name__ == "__main__":
    recs = make()
    OUT.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
    print(f"wrote {len(recs)} rollouts to {OUT}")
