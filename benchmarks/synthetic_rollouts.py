"""Writes a rollouts .jsonl of COUNT records of TOKENS tokens each, for benchmarks that need RL rows
of a chosen rollout length (the packaged tiny rollouts are ~82 tokens; a 32K row of them packs ~256):

    python benchmarks/synthetic_rollouts.py --count 64 --tokens 4096 --out /tmp/rollouts_4k.jsonl

Byte-tokenizer ids (0-255 from the packaged corpus, 256 BOS, 257 EOS), groups of GROUP responses
sharing a prompt of PROMPT tokens, alternate responses rewarded, GRPO group-normalised advantages,
old_logprobs of a near-uniform sampler. Deterministic (seeded). Only the shapes matter for speed
and memory; the loss still decreases on them (the rewarded responses continue the prompt's text).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch

from components.data.make_tiny_rollouts import BOS, EOS, HERE
from components.losses.rl import group_advantages


def make(count: int, tokens: int, group: int = 4, prompt: int = 256, seed: int = 0) -> list[dict]:
    if tokens < prompt + 2 or count < 1 or group < 1:
        raise ValueError(f"need tokens >= prompt + 2 ({prompt + 2}), count >= 1, group >= 1")
    rng = random.Random(seed)
    corpus = b"".join(json.loads(x)["text"].encode() for x in (HERE / "tiny_corpus.jsonl").read_text().splitlines())
    resp_len = tokens - prompt - 2  # BOS + prompt + response + EOS = tokens
    records = []
    for g in range((count + group - 1) // group):
        start = rng.randrange(0, len(corpus) - tokens)
        p = [BOS, *corpus[start:start + prompt]]
        good = list(corpus[start + prompt:start + prompt + resp_len])
        k_in = min(group, count - g * group)
        rewards = [1.0 if k % 2 == 0 else 0.0 for k in range(k_in)]
        adv = group_advantages(torch.tensor(rewards), torch.zeros(k_in, dtype=torch.long)).tolist()
        for k in range(k_in):
            resp = good[:] if k % 2 == 0 else rng.sample(good, len(good))
            ids = p + resp + [EOS]
            records.append({"input_ids": ids, "loss_mask": [0] * len(p) + [1] * (len(ids) - len(p)),
                            "old_logprobs": [0.0] * len(p) + [round(-math.log(320.0), 4)] * (len(ids) - len(p)),
                            "advantages": round(adv[k], 6), "sequence_id": g * group + k, "group_id": g})
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        recs = make(a.count, a.tokens, a.group, a.prompt)
    except ValueError as e:
        ap.error(str(e))
    a.out.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
    print(f"wrote {len(recs)} rollouts of {a.tokens} tokens to {a.out}")


if __name__ == "__main__":
    main()
