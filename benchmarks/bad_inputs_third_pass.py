"""Run the third pass of bad inputs (docs/bad_inputs_third_pass.md) and print its table.

    python benchmarks/bad_inputs_third_pass.py [--only 3,7,12] [--timeout 60] [--json FILE]

Weighted to the RL loop (rollout records, follow mode, rl.*, the policy losses' options, routing
replay), publication (publish.*, the in-memory transports vllm_ipc|vllm_nccl and their
publish.engine, publish.bucket_mb, publish.engine_timeout) and the multi-rank paths (nproc=2 on CPU
with gloo: parallel.* combinations, pp, cp, ep, with debug_moe, qwen35_debug_moe, debug_grpo,
debug_grpo_live, debug_grpo_vllm). None of the cases is a row of docs/reliability.md or of
docs/bad_inputs_second_pass.md.

The machinery is benchmarks/bad_inputs_pass.py's (each case through the real console entry in a
fresh interpreter and its own empty folder, on CPU; `outcome` and `run_case` classify it); this
script adds its own fixtures (rollout files, one short run that checkpoints and publishes), a
per-case time limit and a class for each outcome:

- clean: exit 2 before launch with one paragraph, nothing written;
- valid: a deliberate acceptance (the input is odd but right) that ran;
- traceback: a Python traceback reached the user;
- silent: a bad input accepted (exit 0);
- other: another exit, a hang, a refusal that wrote files, or a valid input refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bad_inputs_pass as bp  # noqa: E402  the second pass's machinery (Case, _run, outcome, run_case)

ROOT = bp.ROOT


@dataclass
class Case(bp.Case):
    valid: bool = False  # the input is deliberate: running (exit 0) is right
    timeout: int = 0  # seconds; 0: --timeout
    ok_rc: int = -1  # another exit code that is right for this input (e.g. 77 with a waiting run)


def _weights(cwd: Path) -> str:
    """What a run that published into F's copy of another run's weights left there."""
    w = cwd.parent.parent / "F" / "pubcopy"
    if not w.is_dir():
        return "no pubcopy"
    steps = sorted(p.name for p in w.iterdir() if p.name.startswith("step-"))
    latest = (w / "latest").read_text().strip() if (w / "latest").is_file() else "?"
    return f"pubcopy holds {', '.join(steps)}; latest {latest} (the other run had step-0..2)"


def _ran(cwd: Path) -> str:
    m = bp._metrics(cwd / "out")
    return f"{len(m)} metrics records, last loss {m[-1].get('loss', float('nan')):.4f}" if m else "no metrics.jsonl"


ONE = "training.steps=1 checkpoint.enable=false output_dir=out"  # a case that must get as far as training
GRPO = "train recipe=debug_grpo"
LIVE = "train recipe=debug_grpo_live data.path=roll publish.dir=w"  # follow mode in the case's folder
VLLM = "train recipe=debug_grpo_vllm data.path=roll publish.dir=w"
N2 = "nproc=2"

CASES: list[Case] = [
    # ------------------------------------------------------------ rollout records (static files)
    Case(f"{GRPO} data.path={{F}}/r_len1.jsonl {ONE}", "exit 2 naming file:line and input_ids (L >= 2)"),
    Case(f"{GRPO} data.path={{F}}/r_mask_short.jsonl {ONE}", "exit 2 naming file:line: loss_mask length != L"),
    Case(f"{GRPO} data.path={{F}}/r_old_short.jsonl {ONE}", "exit 2 naming file:line: old_logprobs length != L"),
    Case(f"{GRPO} data.path={{F}}/r_adv_len.jsonl {ONE}", "exit 2 naming file:line: advantages list length != L"),
    Case(f"{GRPO} data.path={{F}}/r_adv_str.jsonl {ONE}", "exit 2 naming file:line: advantages \"0.5\" is a string"),
    Case(f"{GRPO} data.path={{F}}/r_seqid_float.jsonl {ONE}", "exit 2: sequence_id 1.5 is neither integer nor string"),
    Case(f"{GRPO} data.path={{F}}/r_seqid_list.jsonl {ONE}", "exit 2: sequence_id [1] is neither integer nor string"),
    Case(f"{GRPO} data.path={{F}}/r_pos0.jsonl {ONE}", "exit 2: no record trains anything (loss_mask 1 at position 0 "
         "only is never predicted)"),
    Case(f"{GRPO} data.path={{F}}/r_bom.jsonl {ONE}", "trains (a UTF-8 BOM read as utf-8-sig) or exit 2 naming file:1",
         writes_ok=True, valid=True),
    Case(f"{GRPO} data.path={{F}}/r_array.jsonl {ONE}", "exit 2 naming file:1: a JSON array, not a record"),
    Case(f"{GRPO} data.path={{F}}/r_blank.jsonl {ONE}", "exit 2: the file holds no record (blank lines only)"),
    Case(f"{GRPO} data.path={{F}}/r_crlf.jsonl {ONE}", "trains (CRLF line ends are whitespace to JSON)",
         writes_ok=True, valid=True, verify=_ran),
    Case(f"{GRPO} data.path={{F}}/r_long.jsonl {ONE}", "exit 2 naming file:line: 300 tokens > training.seq_len 256"),
    Case(f"{GRPO} data.path={{F}}/r_pv_bool.jsonl {ONE}", "exit 2: policy_version true is not an integer"),
    Case(f"{GRPO} data.path={{F}}/r_pv_float.jsonl {ONE}", "exit 2: policy_version 2.5 is not an integer"),
    Case(f"{GRPO} data.path={{F}}/r_group_obj.jsonl {ONE}", "trains (docs/rl.md: group_id may be any value)", writes_ok=True,
         valid=True, verify=_ran),
    Case(f"{GRPO} data.path={{F}}/r_reward_str.jsonl {ONE}", "trains; a reward that is not a number is not counted",
         writes_ok=True, valid=True, verify=_ran),
    Case(f"{GRPO} data.path={{F}}/r_mask_float.jsonl {ONE}", "exit 2 naming loss_mask[j] = 0.5 (0 or 1)"),
    Case(f"{GRPO} data.path={{F}}/r_ids_str.jsonl {ONE}", "exit 2 naming input_ids: a string, not a list"),
    Case(f"{GRPO} data.path={{F}}/r_scalar.jsonl {ONE}", "exit 2 naming file:1: a number, not a record"),
    Case(f"{GRPO} data.path={{F}}/good.jsonl loss.kl_coef=0.1 {ONE}", "exit 2: loss.kl_coef needs ref_logprobs"),
    Case(f"{GRPO} data.path={{F}}/r_routed_float.jsonl moe.routing_replay=true {ONE}",
         "exit 2 naming routed_experts[t][layer][j] = 1.5 (integers)"),
    Case(f"{GRPO} data.path={{F}}/r_routed_bool.jsonl moe.routing_replay=true {ONE}",
         "exit 2 naming routed_experts: true is not an expert id"),
    Case(f"{GRPO} data.path={{F}}/routed.jsonl moe.routing_replay=true moe.load_balance_coeff=null {ONE}",
         "trains, routing every MoE layer to the records' experts", writes_ok=True, valid=True, verify=_ran),
    # ------------------------------------------------------------ the policy losses' options
    Case(f"{GRPO} loss.eps=-0.2 --cfg job", "exit 2 naming loss.eps (a clip range >= 0)"),
    Case(f"{GRPO} loss.eps=nan --cfg job", "exit 2 naming loss.eps (finite)"),
    Case(f"{GRPO} loss.kl_coef=-1 --cfg job", "exit 2 naming loss.kl_coef (>= 0)"),
    Case(f"{GRPO} loss.kl_coef=nan --cfg job", "exit 2 naming loss.kl_coef (finite)"),
    Case(f"{GRPO} loss.temperature=nan --cfg job", "exit 2 naming loss.temperature (finite > 0)"),
    Case(f"{GRPO} loss.temperature=inf --cfg job", "exit 2 naming loss.temperature (finite > 0)"),
    Case(f"{GRPO} loss.entropy_coef=nan --cfg job", "exit 2 naming loss.entropy_coef (finite >= 0)"),
    Case(f"{GRPO} loss.entropy_coef=inf --cfg job", "exit 2 naming loss.entropy_coef (finite >= 0)"),
    Case(f"{GRPO} loss.norm=seq --cfg job", "exit 2 listing token, sequence"),
    Case(f"{GRPO} loss=dapo loss.eps_high=-0.28 --cfg job", "exit 2 naming loss.eps_high (>= 0)"),
    Case(f"{GRPO} loss=dapo loss.eps_low=1.5 --cfg job", "exit 2 naming loss.eps_low (< 1: 1 - eps_low is the lower "
         "ratio bound)"),
    Case(f"{GRPO} loss=dapo loss.kl_coef=0.1 --cfg job", "exit 2: dapo has no kl_coef (did-you-mean a loss that has)"),
    Case(f"{GRPO} loss=gspo loss.eps_low=-1 --cfg job", "exit 2 naming loss.eps_low (>= 0)"),
    Case(f"{GRPO} loss=gspo loss.norm=token --cfg job", "exit 2: gspo has no norm option"),
    Case(f"{GRPO} loss=cispo loss.eps_high=-0.1 --cfg job", "exit 2 naming loss.eps_high (>= 0)"),
    Case(f"{GRPO} loss=cispo loss.eps_low=nan --cfg job", "exit 2 naming loss.eps_low (finite or null)"),
    Case(f"{GRPO} loss=ppo loss.eps_high=-0.5 --cfg job", "exit 2 naming loss.eps_high (>= 0 or null)"),
    Case(f"{GRPO} loss=ppo loss.eps=inf --cfg job", "exit 2 naming loss.eps (inf clips nothing)"),
    Case(f"{GRPO} loss=sft loss.eps=0.2 --cfg job", "exit 2: sft has no clip range"),
    Case(f"{GRPO} loss=grpo,dapo --cfg job", "exit 2: a sweep value needs -m (or apiary compare)"),
    # ------------------------------------------------------------ rl.*
    Case(f"{GRPO} rl.mismatch_threshold=inf --cfg job", "exit 2 naming rl.mismatch_threshold (inf counts nothing)"),
    Case(f"{GRPO} rl.tis_cap=1e-9 --cfg job", "accepted: > 0 is the rule (a cap that small weighs every token ~0)",
         valid=True),
    Case(f"{GRPO} rl.tis_cap=-inf --cfg job", "exit 2 naming rl.tis_cap"),
    Case(f"{GRPO} rl.max_lag=1.5 data.follow=true data.path={{F}}/live_rollouts --cfg job",
         "exit 2: rl.max_lag not an integer"),
    Case(f"{GRPO} rl.max_lag=99999999999999999999 data.follow=true data.path={{F}}/live_rollouts --cfg job",
         "exit 2: beyond int64 (or null for no limit)"),
    Case(f"{GRPO} rl.foo=1 --cfg job", "exit 2: unknown key rl.foo, did-you-mean"),
    # ------------------------------------------------------------ follow mode
    Case(f"{LIVE} data.wait_timeout=inf --cfg job", "exit 2: a finite number of seconds (or deliberate: wait forever)"),
    Case(f"{LIVE} data.sharding=documents --cfg job", "exit 2 or deliberate: rollout records are whole sequences"),
    Case(f"{LIVE} validation.interval=2 validation.fraction=0.1 --cfg job",
         "exit 2: a followed stream has no last fraction to hold out"),
    Case(f"{LIVE} data.follow=on --cfg job", "exit 2 (not true/false) or on = true as OmegaConf reads it", valid=True),
    Case(f"{LIVE} data.name=allenai/c4 --cfg job", "exit 2: follow reads data.path, not a hub dataset"),
    Case(f"{LIVE} data.format=text --cfg job", "exit 2: follow needs rollouts (the recipe chose them)"),
    Case(f"{LIVE} rl.max_lag=0 --cfg job", "accepted: only records of the trainer's current version", valid=True),
    Case(f"{LIVE} checkpoint.enable=false data.wait_timeout=3 output_dir=out",
         "exit 2 (the followed position cannot be saved), or exit 77 that does not claim a checkpoint",
         writes_ok=True, ok_rc=77),
    Case("train recipe=debug_grpo_live data.path=s3://bucket/rollouts publish.dir=w data.wait_timeout=3 "
         "output_dir=out", "exit 2: a URL is not a local folder (it would wait on a folder named s3:)"),
    Case(f"{LIVE} data.wait_timeout=1e-9 output_dir=out", "exit 2 (shorter than any poll) or exit 77 at once",
         writes_ok=True, ok_rc=77),
    Case("train recipe=debug_grpo_live publish.dir=w data.path={F}/rolldir rl.max_lag=0 training.steps=1 "
     "data.wait_timeout=5 output_dir=out",
         "trains the shard already in the folder (16 records), or a waiting line that says why it does not",
         writes_ok=True, timeout=120),
    Case("train recipe=debug_grpo_live data.path=roll publish.interval=0 --cfg job", "accepted: a follow run without "
     "publication (the recipe's publish "
         "keys are not refused)", valid=True),
    # ------------------------------------------------------------ publish.* and the in-memory transports
    Case(f"{VLLM} --cfg job", "exit 0: prints the job (no vLLM needed to print it)", valid=True),
    Case(f"{VLLM} publish.transport=vllm_nccl --cfg job", "exit 0: prints the job", valid=True),
    Case(f"{VLLM} publish.transport=vllm_nccl publish.bucket_mb=64 publish.engine=0.0.0.0:29600 "
         "publish.engine_timeout=30 --cfg job", "exit 0: prints the job", valid=True),
    Case("apiary plan recipe=debug_grpo_vllm gpus=1", "exit 0: the plan, with transfer_buckets", valid=True),
    Case("apiary plan recipe=debug_grpo_vllm gpus=2 publish.transport=vllm_nccl publish.bucket_mb=1",
         "exit 0: the plan, with transfer_send_buffers", valid=True),
    Case("apiary plan recipe=debug_grpo_vllm gpus=1 publish.bucket_mb=0", "exit 2 naming publish.bucket_mb"),
    Case(f"{VLLM} publish.transport=vllm_nccl output_dir=out", "exit 2 before launch: vllm_nccl needs vLLM"),
    Case(f"{VLLM} {N2} parallel.ep=2 output_dir=out", "exit 2 before launch: vllm_ipc needs vLLM (once, not per rank)"),
    Case("train recipe=qwen35_debug_grpo_vllm data.path=roll publish.dir=w output_dir=out",
         "exit 2 before launch: needs vLLM"),
    Case(f"{VLLM} publish.engine_timeout=nan --cfg job", "exit 2 naming publish.engine_timeout (finite > 0)"),
    Case(f"{VLLM} publish.engine_timeout=inf --cfg job", "exit 2 (finite) or deliberate: wait for ever"),
    Case(f"{VLLM} publish.bucket_mb=1.5 --cfg job", "exit 2: not an integer"),
    Case(f"{VLLM} publish.engine=127.0.0.1:65536 --cfg job", "exit 2 naming publish.engine (port 0-65535)"),
    Case(f"{VLLM} publish.engine=[::1]:0 --cfg job", "exit 2 (brackets are not a host socket takes) or accepted as IPv6",
         valid=True),
    Case(f"{VLLM} publish.engine= --cfg job", "exit 2 naming publish.engine (empty)"),
    Case(f"{VLLM} publish.transport=null --cfg job", "exit 2: publish.transport takes a name (hf_folder for folders)"),
    Case(f"{VLLM} publish.transport=VLLM_IPC --cfg job", "exit 2, did-you-mean vllm_ipc"),
    Case(f"{VLLM} publish.transport=vllm --cfg job", "exit 2 listing hf_folder, vllm_ipc, vllm_nccl"),
    Case(f"{VLLM} adapter=lora --cfg job", "exit 2: a LoRA run publishes folders (the adapters' hand-off is not built)"),
    Case(f"{GRPO} publish.transport=vllm_ipc --cfg job", "exit 2: publish.transport with publish.interval=0 (ignored)"),
    Case(f"{VLLM} parallel.pp=2 {N2} --cfg job", "exit 2 in --cfg job as at launch (publish.md: publication with "
     "parallel.pp > 1 is refused before launch)"),
    Case("train recipe=debug_grpo_vllm publish.transport=vllm_ipc nproc=2 publish.interval=1 --cfg job",
         "exit 0: prints the job (two ranks, rank 0 sends)", valid=True),
    Case("apiary launch recipe=debug_grpo_vllm launcher=slurm nodes=1 gpus_per_node=1 --dry-run",
         "exit 0: the script (vLLM is checked on the node)", valid=True),
    Case(f"train publish.interval=100 training.steps=2 {ONE.replace('training.steps=1 ', '')}",
         "exit 2 or a warning: publish.interval beyond training.steps publishes the starting weights only"),
    Case(f"train publish.interval=1 publish.dir={{F}}/pubcopy {ONE}",
         "exit 2 (or keeps them): publish.dir holds another run's versions (apiary_version.json names it)",
         writes_ok=True, verify=_weights),
    Case("train publish.interval=1 publish.dtype=int8 --cfg job", "exit 2 listing bfloat16, float16, float32"),
    Case("train publish.interval=1 publish.keep=1.5 --cfg job", "exit 2: not an integer"),
    Case(f"train model.hf_checkpoint={{F}}/run_ck/weights {ONE}", "exit 2: a publish folder, not an HF folder: "
         "point at {F}/run_ck/weights/step-2 (the one latest names)"),
    Case(f"train model.hf_checkpoint={{F}}/run_ck/weights/step-2 {ONE}", "trains from the published weights",
         writes_ok=True, valid=True, verify=_ran),
    Case("apiary logprobs {F}/run_ck/weights {F}/good.jsonl --out lp", "exit 2 (a publish folder: name step-N) or "
         "follows latest"),
    Case("apiary logprobs {F}/run_ck/weights/step-2 {F}/rolldir --out {F}/rolldir",
         "exit 2: --out is the rollouts' own folder (the records would be rewritten in place)"),
    Case("apiary logprobs {F}/run_ck/weights/step-2 {F}/good.jsonl --out lp --temperature nan",
         "exit 2 naming --temperature (finite > 0)"),
    # ------------------------------------------------------------ layouts for two ranks (--cfg job)
    Case(f"train {N2} parallel.dp_replicate=2 parallel.dp_shard=2 --cfg job", "exit 2: 2 x 2 does not fit 2 ranks"),
    Case(f"train {N2} parallel.ep=4 --cfg job", "exit 2: ep 4 does not divide the 2 ranks' layout"),
    Case(f"train {N2} parallel.ep=2 parallel.cp=2 --cfg job", "exit 0 (ep borrows dp_shard x cp) or exit 2", valid=True),
    Case("train recipe=debug_dense nproc=2 parallel.ep=2 --cfg job", "exit 2: a dense model has no experts"),
    Case(f"train {N2} parallel.cp=2 training.seq_len=250 --cfg job",
         "exit 2: seq_len not a multiple of 2 x cp (the load balancer's chunks)"),
    Case(f"train {N2} parallel.pp=2 parallel.pp_microbatch_size=3 --cfg job",
         "exit 2: local_batch 4 is not a multiple of pp_microbatch_size 3"),
    Case(f"train {N2} parallel.pp=2 parallel.pp_schedule=Interleaved1F1B --cfg job",
         "exit 2 (2 layers cannot make 2 stages per rank) or exit 0 (case 115 trains it)", valid=True),
    Case(f"train {N2} parallel.pp=4 --cfg job", "exit 2: pp 4 > 2 ranks"),
    Case(f"train {N2} parallel.pp=2 model.n_layers=1 --cfg job", "exit 2: one layer cannot make two stages"),
    Case(f"train {N2} parallel.gpus=4 --cfg job", "exit 0: the launch's 2 ranks win (parallel.gpus is the recipe's "
         "layout) and say so", valid=True),
    Case("train nproc=3 parallel.ep=2 --cfg job", "exit 2: ep 2 does not divide 3 ranks"),
    Case(f"train recipe=qwen35_debug_moe {N2} parallel.cp=2 --cfg job",
         "exit 2: context parallelism and the linear-attention (Gated DeltaNet) layers, or exit 0 (case 116 trains "
         "it)", valid=True),
    Case(f"{GRPO} {N2} parallel.pp=2 --cfg job", "exit 2 as the launch (case 117) refuses it: policy training without "
     "pipeline parallelism"),
    # ------------------------------------------------------------ two gloo ranks, real training
    Case(f"{GRPO} {N2} parallel.ep=2 {ONE}", "trains one GRPO step on two ranks (FSDP2 + EP 2)", writes_ok=True,
         valid=True, verify=_ran, timeout=150),
    Case(f"train recipe=debug_moe {N2} parallel.pp=2 {ONE}", "trains one step on two pipeline stages, or exit 2 "
         "before launch", writes_ok=True, valid=True, verify=_ran, timeout=150),
    Case(f"{GRPO} {N2} parallel.cp=2 {ONE}", "trains one GRPO step with cp 2, or exit 2 before launch",
         writes_ok=True, valid=True, verify=_ran, timeout=150),
    Case(f"train recipe=qwen35_debug_moe {N2} parallel.ep=2 state=zero1 {ONE}", "trains one step (zero1 + EP 2)",
         writes_ok=True, valid=True, verify=_ran, timeout=150),
    Case(f"{GRPO} {N2} parallel.ep=2 data.path={{F}}/routed.jsonl moe.routing_replay=true "
         f"moe.load_balance_coeff=null {ONE}", "trains one step, each rank replaying its records' routing",
         writes_ok=True, valid=True, verify=_ran, timeout=150),
    Case(f"{LIVE} {N2} parallel.dp_shard=2 data.wait_timeout=1e-9 output_dir=out",
         "exit 77 (or 2) in one paragraph from two ranks", writes_ok=True, timeout=150, ok_rc=77),
    # the --cfg job layouts above that printed a job: launched for one step
    Case(f"train {N2} parallel.pp=2 parallel.pp_microbatch_size=3 {ONE}",
         "exit 2 before launch: local_batch 4 is not a multiple of pp_microbatch_size 3", timeout=150),
    Case(f"train {N2} parallel.pp=2 parallel.pp_schedule=Interleaved1F1B {ONE}",
         "trains one step, or exit 2 before launch (one layer per stage cannot be interleaved)", writes_ok=True,
         valid=True, verify=_ran, timeout=150),
    Case(f"train recipe=qwen35_debug_moe {N2} parallel.cp=2 {ONE}", "trains one step with cp 2, or exit 2 before "
         "launch", writes_ok=True, valid=True, verify=_ran, timeout=150),
    Case(f"{GRPO} {N2} parallel.pp=2 {ONE}", "trains one GRPO step on two stages, or exit 2 before launch",
         writes_ok=True, valid=True, verify=_ran, timeout=150),
]


def _rec(n: int, L: int = 24, **over) -> dict:
    r = {"input_ids": [(7 * n + 3 * t) % 300 + 10 for t in range(L)], "loss_mask": [0] * 8 + [1] * (L - 8),
         "old_logprobs": [-1.5] * L, "advantages": 0.5 if n % 2 else -0.5, "sequence_id": f"s{n}"}
    r.update(over)
    return r


def _write(path: Path, recs, raw: str = "") -> None:
    path.write_text(raw or "".join(json.dumps(r) + "\n" for r in recs))


def _fixtures(f: Path, timeout: int) -> None:
    f.mkdir(parents=True, exist_ok=True)
    doc = "Bees visit flowers and turn nectar into honey. "
    (f / "text.jsonl").write_text("".join(json.dumps({"text": f"{n}: {doc * 4}"}) + "\n" for n in range(60)))
    (f / "live_rollouts").mkdir(exist_ok=True)
    good = [_rec(n) for n in range(16)]
    _write(f / "good.jsonl", good)
    (f / "rolldir").mkdir(exist_ok=True)
    _write(f / "rolldir" / "000001.jsonl", good)
    bad = {
        "r_len1": {"input_ids": [5], "loss_mask": [1], "old_logprobs": [-1.0], "advantages": 1.0},
        "r_mask_short": {"loss_mask": [0] * 8 + [1] * 10},
        "r_old_short": {"old_logprobs": [-1.5] * 10},
        "r_adv_len": {"advantages": [0.5] * 5},
        "r_adv_str": {"advantages": "0.5"},
        "r_seqid_float": {"sequence_id": 1.5},
        "r_seqid_list": {"sequence_id": [1]},
        "r_pv_bool": {"policy_version": True},
        "r_pv_float": {"policy_version": 2.5},
        "r_group_obj": {"group_id": {"a": 1}},
        "r_reward_str": {"reward": "high"},
        "r_mask_float": {"loss_mask": [0] * 8 + [0.5] * 16},
        "r_ids_str": {"input_ids": "hello world, a string"},
        "r_routed_float": {"routed_experts": [[[1.5, 2]] * 2] * 24},
        "r_routed_bool": {"routed_experts": [[[True, False]] * 2] * 24},
    }
    for name, over in bad.items():
        _write(f / f"{name}.jsonl", [_rec(n, **over) if "len1" not in name else {**over, "sequence_id": f"s{n}"}
                                     for n in range(8)])
    _write(f / "r_pos0.jsonl", [_rec(n, loss_mask=[1] + [0] * 23) for n in range(8)])
    _write(f / "r_long.jsonl", [_rec(n, L=300) for n in range(8)])
    _write(f / "r_bom.jsonl", [], raw="\ufeff" + "".join(json.dumps(r) + "\n" for r in good))
    _write(f / "r_array.jsonl", [], raw=json.dumps(good[:4]) + "\n")
    _write(f / "r_blank.jsonl", [], raw="\n   \n\n")
    _write(f / "r_crlf.jsonl", [], raw="".join(json.dumps(r) + "\r\n" for r in good))
    _write(f / "r_scalar.jsonl", [], raw="42\n")
    # routed_experts: [L, 2 MoE layers of tiny_moe, top-2 of 8 experts]
    _write(f / "routed.jsonl", [_rec(n, routed_experts=[[[(n + t) % 8, (n + t + 1) % 8]] * 2 for t in range(24)])
                                for n in range(16)])
    name = "run_ck"  # debug_moe, 2 steps, checkpoints step-1 and step-2, weights step-0..2
    if not (f / name / "config.yaml").is_file():
        p = bp._run(["train", "training.steps=2", "checkpoint.interval=1", "publish.interval=1",
                     "moe.load_balance_coeff=null", f"output_dir={f / name}"], f, {}, max(timeout, 300))
        assert p.returncode == 0, (name, p.stdout[-2000:], p.stderr[-2000:])
    shutil.copytree(f / name / "weights", f / "pubcopy", dirs_exist_ok=True)


def classify(c: Case, observed: str, rc: int) -> str:
    if observed.startswith("traceback"):
        return "traceback"
    if rc == c.ok_rc and (c.writes_ok or "+ wrote" not in observed):
        return "valid"
    if observed.startswith("ok: exit 2") and "+ wrote" not in observed and "+ changed" not in observed:
        return "other" if c.valid and "exit 2" not in c.expected else "clean"  # a right input refused
    if observed.startswith("accepted (exit 0)"):
        return "valid" if c.valid else "silent"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated case numbers (1-based)")
    ap.add_argument("--timeout", type=int, default=60, help="seconds per case (cases of two ranks: their own)")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = ap.parse_args()
    only = {int(x) for x in a.only.split(",") if x.strip()}
    tmp = Path(tempfile.mkdtemp(prefix="apiary-bad-inputs-3-"))
    rows = []
    try:
        t0 = time.perf_counter()
        _fixtures(tmp / "F", a.timeout)
        print(f"fixtures: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print("| # | input (exact command) | expected | observed | class |")
        print("|---|---|---|---|---|")
        for i, c in enumerate(CASES, 1):
            if only and i not in only:
                continue
            r = bp.run_case(i, c, tmp / "F", tmp / "work", c.timeout or a.timeout)
            short = {str(tmp / "work" / f"case{i}-run"): "RUN", str(tmp / "work" / f"case{i}"): ".",
                     str(tmp / "F"): "F", f"{ROOT}/": ""}
            for path, nm in short.items():
                r["observed"] = r["observed"].replace(path, nm)
            r["class"] = classify(c, r["observed"], r["rc"])
            rows.append(r)
            cells = [str(i), f"`{r['input']}`", r["expected"], r["observed"], r["class"]]
            print("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(rows, indent=1))
        counts = Counter(r["class"] for r in rows)
        print("\n" + ", ".join(f"{k} {counts.get(k, 0)}" for k in ("clean", "valid", "traceback", "silent", "other"))
              + f" of {len(rows)}")
    finally:
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
