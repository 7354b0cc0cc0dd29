"""Build random tiny HuggingFace checkpoints with transformers and save their fp32 logits.

Run as a script (a separate interpreter, where fla is blocked so that transformers' Qwen3.5 takes
its torch path): ``python tests/hf_reference.py OUT SPECS_JSON``. SPECS_JSON is a list of
``{"name", "cls", "config": {...}, "seed"}``; each lands in OUT/name (config.json,
model.safetensors, reference.pt with tokens and logits).
"""

import json
import sys

CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
}


def main(out: str, specs: list[dict]) -> None:
    sys.modules["fla"] = None  # else transformers routes GatedDeltaNet to fla's Triton kernels
    import torch
    import transformers

    for spec in specs:
        cfg_cls, model_cls = (getattr(transformers, n) for n in CLASSES[spec["cls"]])
        cfg = cfg_cls(**spec["config"])
        torch.manual_seed(spec.get("seed", 0))
        m = model_cls(cfg).float().eval()
        with torch.no_grad():  # every weight random, so that each one matters
            for n, p in m.named_parameters():
                if n.endswith("A_log"):
                    p.copy_(torch.empty_like(p).uniform_(1, 16).log())
                elif "norm" in n:
                    p.copy_(torch.randn_like(p) * 0.1 + (0.0 if spec["cls"].startswith("qwen3_5")
                                                          and "linear_attn.norm" not in n else 1.0))
                else:
                    p.normal_(0, 0.1)
            if spec.get("bf16"):  # weights stored in bf16; the fp32 reference runs the rounded values
                for p in m.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        dest = f"{out}/{spec['name']}"
        vocab = spec["config"]["vocab_size"]
        tokens = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = m(tokens).logits
        (m.to(torch.bfloat16) if spec.get("bf16") else m).save_pretrained(dest)
        torch.save({"tokens": tokens, "logits": logits}, f"{dest}/reference.pt")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(open(sys.argv[2]).read()))
