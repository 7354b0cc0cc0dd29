"""Policy losses in the trainer (loss=grpo|dapo|gspo|cispo|ppo|sft on data.format=rollouts): the
trainer-side loss against the objective's formula on materialised logits, sequence splits over
ranks, the rollout loader's rows and counts, and end-to-end training on 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from components.data import rollouts as R
from components.losses import rl

from conftest import (
    TRAJ_LOSS_REL,
    assert_same_trajectory,
    free_port,
    read_metrics,
    run_cli,
    spawn_ranks,
    train_here,
)

SEQ_OBJECTIVES = [("grpo", dict(eps=0.2, kl_coef=0.05, norm="sequence")), ("gspo", dict(eps_low=0.02, eps_high=0.03))]
OBJECTIVES = [("ppo", dict(eps=0.2, eps_high=None, kl_coef=0.0, norm="token")),
              ("dapo", dict(eps_low=0.2, eps_high=0.28, norm="token")),
              ("cispo", dict(eps_low=None, eps_high=0.28, norm="token")),
              ("sft", dict(norm="token")), *SEQ_OBJECTIVES]


def _packed_batch(seed=0, b=2, t=24, h=16, v=37):
    """Rows of 2-3 packed sequences with prompt (untrained) and response tokens, as the loader makes them."""
    g = torch.Generator().manual_seed(seed)
    sid = torch.full((b, t), -1)
    lens = [[9, 8, 5], [11, 10]]
    for r in range(b):
        c = 0
        for k, n in enumerate(lens[r]):
            sid[r, c:c + n] = k
            c += n
    mask = (sid >= 0) & (torch.rand(b, t, generator=g) > 0.3)
    labels = torch.where(mask, torch.randint(0, v, (b, t), generator=g), torch.full((b, t), -100))
    counts = torch.zeros(b, 4, dtype=torch.long).scatter_add_(1, sid.clamp_min(0), mask.long())
    seq_tokens = torch.where(sid >= 0, counts.gather(1, sid.clamp_min(0)), 0)
    batch = {
        "rl_old_logprobs": -3 + 0.4 * torch.randn(b, t, generator=g),
        "rl_advantages": torch.randn(b, 4, generator=g).gather(1, sid.clamp_min(0)) * (sid >= 0),
        "rl_ref_logprobs": -3 + 0.4 * torch.randn(b, t, generator=g),
        "rl_sequence_ids": sid, "rl_seq_tokens": seq_tokens,
        "rl_num_seqs": torch.full((b,), float(sum(len(x) for x in lens))),
    }
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = 0.3 * torch.randn(v, h, generator=g, dtype=torch.float64)
    return hidden, weight, labels, batch


def _policy_loss(name, hp, temperature, entropy_coef=0.0):
    from framework import devices

    devices.install()
    from components.losses.policy import policy_loss_class

    fn = policy_loss_class().Config(objective=name, hparams=hp, temperature=temperature, backend="torch",
                                    entropy_coef=entropy_coef).build()
    return fn


@pytest.mark.parametrize("name,hp,ent_coef", [(n, h, 0.0) for n, h in OBJECTIVES] + [
    ("grpo", dict(eps=0.2, kl_coef=0.0, norm="sequence"), 0.05), ("dapo", OBJECTIVES[1][1], 0.01)])
def test_trainer_policy_loss_matches_the_objective_on_logits(name, hp, ent_coef):
    """The trainer's fused policy loss (hidden states + lm_head, its own backward) against
    log_softmax(h W^T / T) -> rl.<objective> with the step normaliser (and the entropy bonus
    - coef x token mean of -sum p log p) in fp64; the fused torch path accumulates in fp32:
    fp32 tolerances."""
    hidden, weight, labels, batch = _packed_batch()
    temp = 0.7
    fn = _policy_loss(name, hp, temp, ent_coef)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float64)
    head.weight.data.copy_(weight)
    fn.set_lm_head(head)
    fn.set_batch(batch)
    pred = hidden.clone().requires_grad_(True)
    gvt = (labels != -100).sum()
    out, _ = fn(pred, labels, gvt)
    out.backward()

    h2 = hidden.clone().requires_grad_(True)
    w2 = weight.clone().requires_grad_(True)
    logp_all = torch.log_softmax(h2 @ w2.T / temp, -1)
    lp = logp_all.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    mask = labels != -100
    kw = dict(sequence_ids=batch["rl_sequence_ids"])
    if name == "gspo" or hp.get("norm") == "sequence":
        kw["normalizer"] = None  # whole batch here: the local count is the step's count
    else:
        kw["normalizer"] = gvt
    want, _ = rl.objective(name)(lp, batch["rl_old_logprobs"].double(), batch["rl_advantages"].double(), mask,
                                 batch["rl_ref_logprobs"].double(), **hp, **kw)
    if ent_coef:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        mean_entropy = (entropy * mask).sum() / gvt
        want = want - ent_coef * mean_entropy
        assert float(fn.metrics["entropy"]) == pytest.approx(mean_entropy.item(), rel=1e-5)
    want.backward()
    assert out.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(pred.grad, h2.grad, rtol=1e-4, atol=1e-7)
    assert torch.allclose(head.weight.grad, w2.grad, rtol=1e-4, atol=1e-7)
    if name in ("ppo", "grpo", "dapo"):
        assert set(fn.metrics) >= {"clip_low_frac", "clip_high_frac"}


def test_policy_loss_without_rollouts_says_what_is_missing():
    hidden, weight, labels, _ = _packed_batch()
    fn = _policy_loss("grpo", dict(eps=0.2, kl_coef=0.0, norm="sequence"), 1.0)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float64)
    fn.set_lm_head(head)
    with pytest.raises(ValueError, match="needs rollouts.*data.format=rollouts"):
        fn(hidden.requires_grad_(True), labels, (labels != -100).sum())


def _split_worker(rank, world, port, name, hp, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        lp, old, adv, mask, ref, sid, seq_tokens, nseq = torch.load(q["data"])
        t = lp.shape[1]
        half = slice(rank * t // 2, (rank + 1) * t // 2)  # this rank's part of every sequence
        x = lp[:, half].clone().requires_grad_(True)
        kw = dict(sequence_ids=sid[:, half], normalizer=nseq)
        if name == "gspo":
            kw["seq_group"] = dist.group.WORLD
        else:
            kw["seq_tokens"] = seq_tokens[:, half]
        loss, _ = rl.objective(name)(x, old[:, half], adv[:, half], mask[:, half], ref[:, half], **hp, **kw)
        loss.backward()
        torch.save((loss.detach(), x.grad), f"{q['out']}.{rank}")
        dist.barrier()  # tear gloo down together: a rank leaving early can abort its peer's exit
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,hp", SEQ_OBJECTIVES)
def test_sequence_level_objectives_split_over_two_ranks(tmp_path, name, hp):
    """Context parallelism cuts sequences: sequence means through seq_tokens, GSPO's sequence
    ratio through an all-reduce over the group; the ranks' losses add up to the whole-batch loss
    and each rank gets its tokens' gradient."""
    hidden, weight, labels, b = _packed_batch(seed=3)
    lp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0].detach()
    mask = labels != -100
    args = (lp, b["rl_old_logprobs"].double(), b["rl_advantages"].double(), mask, b["rl_ref_logprobs"].double())
    x = lp.clone().requires_grad_(True)
    whole, _ = rl.objective(name)(x, *args[1:], **hp, sequence_ids=b["rl_sequence_ids"])
    whole.backward()
    data = tmp_path / "batch.pt"
    torch.save((*args, b["rl_sequence_ids"], b["rl_seq_tokens"], torch.tensor(5.0, dtype=torch.float64)), data)
    q = {"data": str(data), "out": str(tmp_path / "part")}
    spawn_ranks(_split_worker, 2, 2, free_port(), name, hp, q)
    parts = [torch.load(f"{q['out']}.{r}") for r in range(2)]
    # fp64 throughout: two sums of the same terms in another grouping, ~1e-16 relative each
    assert (parts[0][0] + parts[1][0]).item() == pytest.approx(whole.item(), rel=1e-10)
    assert torch.allclose(torch.cat([parts[0][1], parts[1][1]], dim=1), x.grad, rtol=1e-9, atol=1e-14)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_rollout_loader_deals_rows_by_step(tmp_path):
    from framework import devices

    devices.install()
    from components.data.rollout_loader import RolloutRows

    recs = [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1], "old_logprobs": [0.0, 0, -1, -1, -1],
             "advantages": float(i)} for i in range(10)]
    path = _write(tmp_path / "r.jsonl", recs)
    # seq_len 10: two sequences per row, 5 rows; a step is 4 rows (local 2 x 2 ranks)
    one = RolloutRows(str(path), seq_len=10, dp_rank=0, dp_world_size=1, local_batch=4, global_batch=4)
    ranks = [RolloutRows(str(path), seq_len=10, dp_rank=r, dp_world_size=2, local_batch=2, global_batch=4)
             for r in range(2)]
    it1, its = iter(one), [iter(r) for r in ranks]
    for step in range(3):  # the 5 rows repeat: step 1 holds rows 4, 0, 1, 2
        s1 = [next(it1) for _ in range(4)]
        s2 = [next(its[0]) for _ in range(2)] + [next(its[1]) for _ in range(2)]
        for (a, la), (b, lb) in zip(s1, s2):
            assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
            assert torch.equal(a["rl_advantages"], b["rl_advantages"])
        assert all(x["rl_num_seqs"].item() == 8 for x, _ in s1 + s2)  # 4 rows x 2 sequences
    adv = [int(x["rl_advantages"].max()) for x, _ in s1]
    assert adv == [7, 9, 1, 3]  # step 2 holds rows 3, 4, 0, 1 -> sequences (6,7) (8,9) (0,1) (2,3) max
    # labels: shifted, -100 outside the response; seq_tokens = 3 trained tokens per sequence
    x, lab = s1[0]
    assert lab[:5].tolist() == [-100, 3, 4, 5, -100] and x["rl_seq_tokens"][:5].tolist() == [3] * 5
    # resume: the position in the stream is the state
    st = ranks[1].state_dict()
    again = RolloutRows(str(path), seq_len=10, dp_rank=1, dp_world_size=2, local_batch=2, global_batch=4)
    again.load_state_dict(st)
    assert torch.equal(next(iter(again))[0]["input"], next(its[1])[0]["input"])


def test_sft_on_rollouts_equals_ce_on_rollouts(workdir, capsys, one_thread):
    """The fused policy path in the trainer: sft (-mean log-prob of trained tokens) and the
    baseline ce (materialised logits) on the same rollouts follow each other step by step."""
    common = ["recipe=debug_grpo", "training.steps=2", "checkpoint.enable=false", "logging.tensorboard=false"]
    runs = {}
    for loss in ("sft", "ce"):
        p = train_here(["train", *common, f"loss={loss}", f"output_dir={loss}"], workdir, capsys)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[loss] = read_metrics(workdir / loss)
    # the same loss in another summation order: conftest's fp32 trajectory bound
    assert_same_trajectory(runs["sft"], runs["ce"])


def test_grpo_on_fixed_rollouts_raises_the_good_responses(workdir, capsys):
    """GRPO on one step's rollouts repeated: the objective falls (the policy moves toward the
    positive-advantage responses), and clip fractions are logged."""
    recs = [json.loads(x) for x in R.PACKAGED_ROLLOUTS.read_text().splitlines()[:12]]  # 4 rows of 3
    path = _write(workdir / "fixed.jsonl", recs)
    p = train_here(["train", "recipe=debug_grpo", f"data.path={path}", "training.steps=8", "lr.warmup_steps=0",
                    "checkpoint.enable=false", "logging.tensorboard=false", "output_dir=run"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    m = read_metrics(workdir / "run")
    assert m[-1]["loss"] < m[0]["loss"] - 0.05, [r["loss"] for r in m]
    assert "policy/clip_high_frac" in m[0]


def test_policy_loss_on_text_is_refused_before_training(workdir, capsys):
    p = train_here(["train", "recipe=debug_moe", "loss=grpo"], workdir, capsys)
    assert p.returncode == 2
    assert "is a policy objective" in p.stderr and "data.format=rollouts" in p.stderr
    assert not (workdir / "runs").exists()
    long = _write(workdir / "long.jsonl", [{"input_ids": list(range(50)), "loss_mask": [1] * 50,
                                             "old_logprobs": [0.0] * 50, "advantages": 1.0}])
    p = train_here(["train", "recipe=debug_grpo", f"data.path={long}", "training.seq_len=32"], workdir, capsys)
    assert p.returncode == 2 and "50 tokens do not fit training.seq_len=32" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("loss,dims", [
    # about 80 s; the data-parallel split is covered by test_rollout_loader_deals_rows_by_step and
    # the fused head's FSDP path by test_linear_ce.py in the default run
    pytest.param("grpo", "dp2", marks=pytest.mark.slow),
    ("gspo", "cp2")])
def test_two_ranks_match_one_rank(workdir, capsys, loss, dims):
    """The step's normalisers do not depend on the split: 2 gloo ranks (data-parallel, or context-
    parallel with sequences cut in two) follow the 1-rank run from the same seed checkpoint.
    GSPO's clip range is opened so every sequence ratio carries gradient through the all-reduce;
    an entropy bonus is on, and its logged token mean must match the 1-rank run's too."""
    wide = ["loss.eps_low=0.99", "loss.eps_high=100"] if loss == "gspo" else []
    base = ["recipe=qwen35_debug_moe", f"loss={loss}", *wide, "loss.entropy_coef=0.01", "data.format=rollouts",
            "training.steps=2",
            "training.local_batch=2", "checkpoint.interval=100", "logging.tensorboard=false"]
    p = train_here(["train", *base, "checkpoint.create_seed=true", "output_dir=seed"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    seed = f"checkpoint.load_path={workdir / 'seed' / 'checkpoint' / 'step-0'}"
    one_batch = "training.global_batch=4" if dims == "dp2" else "training.global_batch=2"
    two = ["nproc=2"] + (["parallel.cp=2"] if dims == "cp2" else [])
    with ThreadPoolExecutor(2) as pool:  # the 1-rank run beside the 2 ranks, one thread each
        f1 = pool.submit(run_cli, ["train", *base, seed, one_batch, "output_dir=one"], cwd=workdir,
                         env={"OMP_NUM_THREADS": "1"})
        f2 = pool.submit(run_cli, ["train", *base, seed, *two, "output_dir=two"], cwd=workdir)
        p1, p2 = f1.result(), f2.result()
    assert p1.returncode == 0, p1.stderr[-3000:]
    assert p2.returncode == 0, p2.stderr[-3000:]
    lay = json.loads((workdir / "two" / "layout.json").read_text())["dims"]
    assert (lay["dp_shard"], lay["cp"]) == ((2, 1) if dims == "dp2" else (1, 2))
    one, two = read_metrics(workdir / "one"), read_metrics(workdir / "two")
    assert len(one) == len(two) == 2
    # another split of the same batch over ranks: rounding-level differences from step 1 on, so
    # conftest's fp32 trajectory bound for an MoE recipe (the grad norm keeps its looser 1e-3)
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=TRAJ_LOSS_REL, abs=1e-6), (loss, dims)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (loss, dims)
        assert a["policy/clip_low_frac"] + a["policy/clip_high_frac"] < 1
        # policy metrics are token means over the whole step, whatever the split (not rank 0's part)
        assert {k for k in a if k.startswith("policy/")} == {k for k in b if k.startswith("policy/")}
        for k in (k for k in a if k.startswith("policy/")):
            assert b[k] == pytest.approx(a[k], rel=TRAJ_LOSS_REL, abs=1e-6), (k, a[k], b[k])
        if dims == "cp2":  # one data-parallel rank: its loss (CP shares summed) is the max
            assert b["max_loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), (b["max_loss"], b["loss"])


def test_rollout_run_resumes_at_the_next_rows(workdir, capsys):
    """The loader's position is checkpointed: resuming from step 2 gives the uninterrupted run's
    steps 3 and 4 (other rows would give other losses)."""
    import shutil

    common = ["recipe=debug_grpo", "training.steps=4", "checkpoint.interval=2", "logging.tensorboard=false"]
    p = train_here(["train", *common, "output_dir=run"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    full = read_metrics(workdir / "run")
    assert len({round(r["loss"], 6) for r in full}) == 4  # every step sees other rows
    shutil.copytree(workdir / "run", workdir / "resumed")
    shutil.rmtree(workdir / "resumed" / "checkpoint" / "step-4")
    (workdir / "resumed" / "metrics.jsonl").unlink()
    p = train_here(["train", *common, "checkpoint.resume=true", f"output_dir={workdir / 'resumed'}"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = read_metrics(workdir / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    # one process, same weights, optimizer state, rows and arithmetic: bit for bit
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]


def test_rollout_rows_read_on_demand_equal_the_whole_set(tmp_path):
    """The loader keeps an index, not the records: each row it builds on demand equals that row
    of the whole set read at once, for jsonl files in a folder and parquet with several row groups."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from framework import devices

    devices.install()
    from components.data.rollout_loader import RolloutRows
    from components.data.rollouts import read_rollouts

    rng = random.Random(0)
    recs = []
    for i in range(23):
        n = rng.randint(3, 9)
        recs.append({"input_ids": [rng.randint(1, 50) for _ in range(n)],
                     "loss_mask": [0] + [rng.randint(0, 1) for _ in range(n - 1)],
                     "old_logprobs": [0.0] + [-rng.random() for _ in range(n - 1)],
                     "advantages": [rng.uniform(-1, 1)] * n, "ref_logprobs": [-rng.random() for _ in range(n)]})
    (tmp_path / "j").mkdir()
    for f in range(5):  # five files, the second starting with a blank line
        blank = "\n" if f == 1 else ""
        (tmp_path / "j" / f"{f}.jsonl").write_text(blank + "".join(json.dumps(r) + "\n" for r in recs[5 * f:5 * f + 5]))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "r.parquet", row_group_size=4)
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "one_group.parquet")
    for path in (tmp_path / "j", tmp_path / "r.parquet", tmp_path / "one_group.parquet"):
        whole = read_rollouts(path, pack_to=16)
        fds = len(os.listdir("/proc/self/fd"))
        ds = RolloutRows(str(path), seq_len=16, dp_rank=0, dp_world_size=1, local_batch=1, global_batch=1)
        assert ds.n == whole["input_ids"].shape[0] > 5
        held = [t for v in vars(ds).values() for t in (v.values() if isinstance(v, dict) else [v])
                if isinstance(t, torch.Tensor)]
        assert sum(t.numel() for t in held) <= ds.n  # per-row counts only, no [rows, seq_len] tensors
        for i in [*range(ds.n), 3, 0]:  # in order, then back (parquet re-reads a row group)
            row = ds.row(i)
            for k, v in row.items():
                assert torch.equal(v, whole[k][i]), (path, i, k)
        assert len(os.listdir("/proc/self/fd")) <= fds + 1  # one file open at a time
        x, labels = next(iter(ds))
        assert torch.equal(x["rl_ref_logprobs"], whole["ref_logprobs"][0]) and torch.equal(labels, whole["labels"][0])
        ds.index.close()


def test_malformed_rollout_value_stops_before_launch(tmp_path):
    from components.data.rollouts import RolloutIndex

    rec = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "old_logprobs": [0.0, None, -1.0], "advantages": 1.0}
    path = _write(tmp_path / "r.jsonl", [rec])
    RolloutIndex(path)  # the workers' index pass reads lengths only
    with pytest.raises(ValueError, match=r"r.jsonl:1: old_logprobs holds a value that is not a number"):
        RolloutIndex(path, validate=True)  # resolve's check


def test_rollout_loader_in_a_worker_process_gives_the_same_batches_and_resumes(tmp_path):
    """data.num_workers=1 (one background process): the same batches as in-process, and the
    loader's state resumes mid-stream; two workers would repeat batches (refused before launch,
    tests/test_cli_errors.py)."""
    from framework import devices

    devices.install()
    from components.data.rollout_loader import RolloutDataLoader

    recs = [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1], "old_logprobs": [0.0, 0, -1, -1, -1],
             "advantages": float(i)} for i in range(10)]
    path = _write(tmp_path / "r.jsonl", recs)

    def loader(workers):
        return RolloutDataLoader(RolloutDataLoader.Config(path=str(path), num_workers=workers), dp_world_size=1,
                                 dp_rank=0, tokenizer=None, seq_len=5, local_batch_size=2)

    def adv(batch):
        return [int(x) for x in batch[0]["rl_advantages"].max(-1).values]

    it0, dl = iter(loader(0)), loader(1)
    it1 = iter(dl)
    first = [adv(next(it1)) for _ in range(3)]
    assert first == [adv(next(it0)) for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]
    state = dl.state_dict()
    rest = [adv(next(it1)) for _ in range(3)]
    assert rest == [[6, 7], [8, 9], [0, 1]]
    again = loader(1)
    again.load_state_dict(state)
    it2 = iter(again)
    assert [adv(next(it2)) for _ in range(3)] == rest
