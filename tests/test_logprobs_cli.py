"""`apiary logprobs MODEL ROLLOUTS --out DIR` (toolkit/logprobs.py, docs/skills/logprobs.md): the
ref_logprobs it writes equal transformers' log_softmax(logits / T) at the sampled tokens; a run
folder's checkpoint scores like its export loaded as an HF folder; bad input exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data.rollouts import PACKAGED_ROLLOUTS
from toolkit.cli import apiary_main

from conftest import train_here

# fp32 on both sides, other kernels and summation orders (fused head vs materialised logits):
# measured max abs diff ~2e-6 on log-probs of size ~6; the bound leaves room for other CPUs
LOGPROB_ATOL = 1e-4
# a run folder's model (bf16 expert GEMMs, as it trains) vs its export as an HF folder (fp32 experts): measured
# max abs diff 3.1e-3 (debug_moe's seed checkpoint) and 1.7e-4 (after 2 steps); other weights move them by O(1)
RUN_VS_HF_ATOL = 1e-2

_HF_REF = """
import json, sys
sys.modules["fla"] = None
import torch, transformers
folder, rollouts, out = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                                  moe_intermediate_size=24, norm_topk_prob=True, max_position_embeddings=512)
torch.manual_seed(0)
m = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
with torch.no_grad():  # every weight random, so that each one matters
    for n, p in m.named_parameters():
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in n else 0.0)) if "norm" in n else p.normal_(0, 0.2)
m.save_pretrained(folder)
res = {}
for T in (1.0, 0.7):
    res[str(T)] = []
    for line in open(rollouts):
        ids = torch.tensor([json.loads(line)["input_ids"]])
        with torch.no_grad():
            lsm = torch.log_softmax(m(ids).logits[0].double() / T, dim=-1)
        res[str(T)].append([0.0] + lsm[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
json.dump(res, open(out, "w"))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A random tiny Qwen3 MoE saved by transformers with its log_softmax at 6 rollouts of other
    lengths (one interpreter), and side by side a debug_moe run folder with a seed checkpoint."""
    work = tmp_path_factory.mktemp("logprobs")
    recs = [json.loads(x) for x in PACKAGED_ROLLOUTS.read_text().splitlines()[:6]]
    recs[1]["input_ids"] = recs[1]["input_ids"][:7]  # lengths differ: batches are right-padded
    for k in ("loss_mask", "old_logprobs"):
        recs[1][k] = recs[1][k][:7]
    src = work / "rollouts"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    pq.write_table(pa.Table.from_pylist(recs[4:]), src / "sub" / "b.parquet")
    (work / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ref = work / "ref.json"
    hf_proc = subprocess.Popen([sys.executable, "-c", _HF_REF, str(work / "hf"), str(work / "all.jsonl"), str(ref)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p = train_here(["train", "recipe=debug_moe", "checkpoint.create_seed=true", "output_dir=run",
                    "logging.tensorboard=false"], work)
    assert p.returncode == 0, p.stderr[-3000:]
    _, err = hf_proc.communicate(timeout=300)
    assert hf_proc.returncode == 0, err[-3000:]
    return dict(work=work, run=work / "run", hf=work / "hf", src=src, recs=recs, ref=json.loads(ref.read_text()))


def _scored(out: Path) -> list[dict]:
    return [json.loads(x) for f in ("a.jsonl", "sub/b.jsonl") for x in (out / f).read_text().splitlines()]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ref_logprobs_equal_transformers_log_softmax(run, tmp_path, temperature, capsys):
    out = tmp_path / "out"
    argv = ["logprobs", str(run["hf"]), str(run["src"]), "--out", str(out), "--batch-tokens", "200"]
    assert apiary_main(argv + (["--temperature", str(temperature)] if temperature != 1.0 else [])) == 0
    assert "ref_logprobs of 6 records" in capsys.readouterr().out
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["a.jsonl", "sub", "sub/b.jsonl"]
    got, worst = _scored(out), 0.0
    for rec, orig, ref in zip(got, run["recs"], run["ref"][str(temperature)]):
        assert {k: v for k, v in rec.items() if k != "ref_logprobs"} == orig  # every other field kept
        assert len(rec["ref_logprobs"]) == len(orig["input_ids"]) and rec["ref_logprobs"][0] == 0.0
        diff = max(abs(a - b) for a, b in zip(rec["ref_logprobs"], ref))
        assert diff <= LOGPROB_ATOL, diff
        worst = max(worst, diff)
    print(f"temperature {temperature}: ref_logprobs vs transformers max abs diff {worst:.2e}")


def test_field_old_logprobs_keeps_the_engines_as_gen_logprobs(run, tmp_path, capsys):
    """--field old_logprobs (rl.tis_cap's decoupled form): the trainer-side log-probs go to old_logprobs,
    the engine's former old_logprobs to gen_logprobs; a record that already has gen_logprobs is refused."""
    out = tmp_path / "out"
    assert apiary_main(["logprobs", str(run["hf"]), str(run["src"]), "--out", str(out), "--field", "old_logprobs"]) == 0
    assert "old_logprobs of 6 records" in capsys.readouterr().out
    for rec, orig, ref in zip(_scored(out), run["recs"], run["ref"]["1.0"]):
        assert rec["gen_logprobs"] == orig["old_logprobs"] and "ref_logprobs" not in rec
        assert max(abs(a - b) for a, b in zip(rec["old_logprobs"], ref)) <= LOGPROB_ATOL
    again = tmp_path / "again"
    assert apiary_main(["logprobs", str(run["hf"]), str(out), "--out", str(again), "--field", "old_logprobs"]) == 2
    assert "already has gen_logprobs" in capsys.readouterr().err
    assert not again.exists()


def test_run_folder_scores_like_its_export(run, tmp_path):
    """The run's own model from its checkpoint == `apiary export` of that checkpoint loaded as an HF
    folder, up to the run's expert GEMMs: the tiny_moe flavor trains with torchtitan's GroupedExperts,
    which compute in bf16, the HF folder's model with exact fp32 experts."""
    assert apiary_main(["export", str(run["run"]), "--hf", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    assert apiary_main(["logprobs", str(run["run"]), str(run["src"]), "--out", str(tmp_path / "r")]) == 0
    assert apiary_main(["logprobs", str(tmp_path / "export"), str(run["src"]), "--out", str(tmp_path / "h")]) == 0
    diffs = [abs(x - y) for a, b in zip(_scored(tmp_path / "r"), _scored(tmp_path / "h"))
             for x, y in zip(a["ref_logprobs"], b["ref_logprobs"])]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"run folder vs its export: max abs diff {worst:.2e}, mean {mean:.2e}")
    assert 0 < worst <= RUN_VS_HF_ATOL and mean <= RUN_VS_HF_ATOL / 10


def test_bad_input_exits_2_with_one_paragraph(run, tmp_path, capsys):
    def err(argv):
        code = apiary_main(["logprobs", *argv, "--out", str(tmp_path / "o")])
        return code, " ".join(capsys.readouterr().err.split())

    code, msg = err([str(tmp_path / "nope"), str(run["src"])])
    assert code == 2 and "is neither a HuggingFace model folder" in msg and "does not exist" in msg, msg
    code, msg = err([str(run["hf"]), str(tmp_path / "missing.jsonl")])
    assert code == 2 and "does not exist" in msg, msg
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    code, msg = err([str(run["hf"]), str(text)])
    assert code == 2 and f"{text}:1" in msg and "is not a rollout record" in msg, msg
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"input_ids": [1, 2, 5000]}) + "\n")
    code, msg = err([str(run["hf"]), str(big)])
    assert code == 2 and "token id 5000 is outside the model's vocabulary of 320" in msg, msg
    code, msg = err([str(run["run"]), str(run["src"]), "--step", "1"])
    assert code == 2 and "--step 1" in msg and "complete: 0" in msg, msg
    code, msg = err([str(run["hf"]), str(run["src"]), "--temperature", "0"])
    assert code == 2 and "--temperature 0" in msg, msg
    assert "Traceback" not in msg and not (tmp_path / "o").exists()
