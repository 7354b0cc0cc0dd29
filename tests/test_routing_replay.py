"""MoE routing replay (moe.routing_replay=true, components/moe/routing_replay.py): the rollouts'
routed_experts route every MoE layer; the gate weights still come from the router's scores.

- model level (qwen3 and qwen3_5 MoE, one process): replaying the routing a forward chose gives
  the same loss and gradients bit for bit (same ops on the same numbers: the router's own gather,
  route_norm and route_scale); another routing changes them; the router still gets a gradient;
  the ids stay set through a full activation recompute; load-balance counts follow the replay;
- records: routed_experts is read unshifted into [B, T, n_layers, k] (-1 at padding);
- the trainer (records -> loader -> context sharding -> batch consumer -> routers): a step on
  records that carry the routing the trainer itself chose equals the step without replay, on one
  rank and on 4 gloo ranks with EP 2 and CP 2 (headtail load balancing);
- refusals before launch (exit 2, one paragraph naming moe.routing_replay and the reason).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from components.data import rollout_values
from components.data import rollouts as R

from conftest import ROOT, _child_env, read_metrics, run_cli, run_ranks


def _model(family: str, flavor: str, **kw):
    from framework import devices

    devices.install()
    from components.models import qwen3, qwen3_5

    cfg = {"qwen3": qwen3, "qwen3_5": qwen3_5}[family].model_config(flavor, **kw)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    model.train()
    return cfg, model


def _step(model, tokens):
    """Loss and gradients of one forward / backward on tokens [B, S+1] (one causal sequence per row)."""
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    inp = tokens[:, :-1]
    pos = torch.arange(inp.shape[1]).expand(inp.shape[0], -1)
    out = model(inp, positions=pos, attention_masks=model.get_attention_masks(pos))
    loss = F.cross_entropy(out.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,flavor", [("qwen3", "tiny_moe"), ("qwen3_5", "debug_moe")])
def test_replaying_the_own_routing_is_exact_and_another_routing_is_not(family, flavor, one_thread):
    from components.moe import routing_replay as rr

    cfg, model = _model(family, flavor)
    tokens = torch.randint(0, cfg.vocab_size, (2, 41), generator=torch.Generator().manual_seed(1))
    layers = rr.moe_layers(model)
    with rr.capture(model) as c:
        l0, g0 = _step(model, tokens)
    counts0 = torch.stack([m.tokens_per_expert_E.clone() for m in layers])
    n, k, e = len(layers), layers[0].router.top_k, layers[0].router.num_experts
    assert c.ids.shape == (2, 40, n, k) and c.ids.dtype == torch.long and n >= 2
    # the router's own choice, replayed: the same numbers
    rr.replay(model, c.ids)
    l1, g1 = _step(model, tokens)
    assert torch.equal(l0, l1), (l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[x], g1[x]) for x in g0)
    # load-balance statistics count the replayed routing (twice the first forward's now)
    assert torch.equal(torch.stack([m.tokens_per_expert_E for m in layers]), 2 * counts0)
    # another routing: every token moves to the next expert ids
    other = (c.ids + 1) % e
    rr.replay(model, other)
    with rr.capture(model) as c2:
        l2, g2 = _step(model, tokens)
    assert torch.equal(c2.ids, other)  # the forward used the given ids
    assert not torch.equal(l0, l2)
    routers = [x for x in g2 if ".router." in x]
    assert routers and all(g2[x].abs().max() > 0 for x in routers)  # the router still trains
    assert any(not torch.equal(g0[x], g2[x]) for x in routers)
    # padding (-1) keeps the router's own choice
    pad = c.ids.clone()
    pad[:, -5:] = -1
    rr.replay(model, pad)
    l3, _ = _step(model, tokens)
    assert torch.equal(l3, l0)
    rr.replay(model, None)  # off again: the router decides
    l4, _ = _step(model, tokens)
    assert torch.equal(l4, l0)


def test_replay_survives_full_recompute_and_refuses_a_wrong_shape(one_thread):
    """FullAC reruns each block's forward in backward: the ids on the MoE modules are used there too
    (the recompute would otherwise route by the router and mismatch the saved forward)."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    from components.moe import routing_replay as rr

    cfg, ref = _model("qwen3", "tiny_moe")
    state = copy.deepcopy(ref.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    other = torch.randint(0, 8, (2, 32, 2, 2), generator=torch.Generator().manual_seed(3))
    other[..., 1] = (other[..., 0] + 1 + other[..., 1] % 7) % 8  # k distinct experts per token
    rr.replay(ref, other)
    l0, g0 = _step(ref, tokens)
    model = copy.deepcopy(cfg).build()
    model.load_state_dict(state)
    model.train()
    rr.attach(model)  # hooks before the blocks are wrapped, as install() does
    FullAC(FullAC.Config()).apply(model)
    rr.replay(model, other)
    l1, g1 = _step(model, tokens)
    g1 = {x.replace("._checkpoint_wrapped_module", ""): v for x, v in g1.items()}
    assert torch.equal(l0, l1) and g0.keys() == g1.keys() and all(torch.equal(g0[x], g1[x]) for x in g0)
    with pytest.raises(RuntimeError, match="model wants \\[B, T, 2 MoE layers, top-k 2\\]"):
        rr.replay(model, other[:, :, :1])
    with pytest.raises(RuntimeError, match="outside \\[0, 8\\)"):
        rr.replay(model, other + 8)


# ------------------------------------------------------------------ records


def _rec(n, layers=2, k=2, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 200, (n,), generator=g).tolist(), "loss_mask": [0] * 2 + [1] * (n - 2),
            "old_logprobs": [0.0] + [-1.0] * (n - 1), "advantages": 1.0,
            "routed_experts": torch.randint(0, e, (n, layers, k), generator=g).tolist()}


def test_records_read_routed_experts_unshifted_with_padding():
    recs = [_rec(5, seed=1), _rec(4, seed=2), _rec(6, seed=3)]
    out = R.build_rows([[(0, recs[0]), (1, recs[1])], [(2, recs[2])]], 10, with_ref=False)
    re = out["routed_experts"]
    assert re.shape == (2, 10, 2, 2) and re.dtype == torch.long
    assert re[0, :5].tolist() == recs[0]["routed_experts"]  # position t: input token t's routing
    assert re[0, 5:9].tolist() == recs[1]["routed_experts"]
    assert (re[0, 9:] == -1).all() and (re[1, 6:] == -1).all()
    assert "routed_experts" not in R.build_rows([[(0, {**recs[0], "routed_experts": None})]], 8, with_ref=False)
    with pytest.raises(ValueError, match="some records but not all"):
        R.build_rows([[(0, recs[0]), (1, {**recs[1], "routed_experts": None})]], 10, with_ref=False)
    with pytest.raises(ValueError, match="record 1: routed_experts is \\[L, 3, 2\\]"):
        R.build_rows([[(0, recs[0]), (1, _rec(4, layers=3))]], 10, with_ref=False)
    with pytest.raises(ValueError, match="routed_experts has 4 entries, input_ids 5"):
        R._check("f:1", {**recs[0], "routed_experts": recs[1]["routed_experts"]})
    with pytest.raises(ValueError, match="must be integers"):
        rollout_values._convert("f:1", {**recs[0], "routed_experts": [[[0.5, 1.0]] * 2] * 5})
    with pytest.raises(ValueError, match="must be integers"):
        rollout_values._convert("f:1", {**recs[0], "routed_experts": [[[0, 1], [2]]] * 5})  # ragged


# ------------------------------------------------------------------ the trainer

CAPTURE = r"""
import json, sys
import torch
import torch.distributed as dist
from framework import devices
from framework.train import process
devices.install()
from framework.train.build import trainer_config
from framework.resolve.resolver import resolve
from components.moe import routing_replay as rr

src, dst, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
process.single_process_env()
r = resolve("debug_grpo", overrides)
trainer = trainer_config(r).build()
model, ds = trainer.model_parts[0], trainer.dataloader.dataset
input_dict, labels = next(iter(trainer.dataloader))
input_dict = {k: v.to(trainer.device) for k, v in input_dict.items()}
inputs, labels, extra = trainer.post_dataloading_process(input_dict, labels.to(trainer.device))
with torch.no_grad(), trainer.train_context(), rr.capture(model) as c:
    model(inputs, **extra)
ids = c.ids  # [B, T / cp, n_layers, k]: this rank's part of its data-parallel rank's rows
pd = trainer.parallel_dims
if pd.cp_enabled:  # back to whole rows (headtail: rank r holds chunks r and 2cp-1-r of 2cp)
    group, cp = pd.get_mesh("cp").get_group(), pd.get_mesh("cp").size()
    parts = [torch.empty_like(ids) for _ in range(cp)]
    dist.all_gather(parts, ids.contiguous(), group=group)
    if trainer.config.parallelism.context_parallel_load_balancer == "headtail":
        chunks = [None] * (2 * cp)
        for rank, p in enumerate(parts):
            chunks[rank], chunks[2 * cp - 1 - rank] = p.chunk(2, dim=1)
        ids = torch.cat(chunks, dim=1)
    else:
        ids = torch.cat(parts, dim=1)
routed = {}
for j in range(ids.shape[0]):  # this data-parallel rank's rows of step 1
    g = ds.rank * ds.block + j
    col = 0
    for i in ds.rows[g % ds.n]:
        n = ds.index.lengths[i]
        routed[i] = ids[j, col:col + n].tolist()
        col += n
if dist.is_initialized() and dist.get_world_size() > 1:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, routed)
    for x in every:
        routed.update(x)
if not dist.is_initialized() or dist.get_rank() == 0:
    recs = [json.loads(x) for x in open(src).read().splitlines() if x.strip()]
    m = len(routed)
    assert sorted(routed) == list(range(m)), sorted(routed)  # step 1 reads a prefix of the records
    with open(dst, "w") as f:
        for i in range(m):
            f.write(json.dumps({**recs[i], "routed_experts": routed[i]}) + "\n")
trainer.close()
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
"""

COMMON = ["training.steps=1", "checkpoint.enable=false", "logging.tensorboard=false", "training.local_batch=2"]


def _capture(workdir, overrides, nproc, env=None):
    src = str(R.PACKAGED_ROLLOUTS)
    dst = workdir / f"routed{nproc}.jsonl"
    script = workdir / "capture.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + CAPTURE)
    p = run_ranks(script, [src, dst, json.dumps([*COMMON, f"data.path={src}", f"output_dir={workdir}/cap{nproc}",
                                                 *overrides])], nproc, cwd=workdir, timeout=600, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    return dst


def _train(workdir, name, data, overrides, nproc=1, env=None):
    argv = ["train", "recipe=debug_grpo", *COMMON, f"data.path={data}", f"output_dir={name}", *overrides]
    if nproc > 1:
        argv.append(f"nproc={nproc}")
    p = subprocess.run([sys.executable, "-m", "framework.cli", *argv], cwd=workdir, env=_child_env(env),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return read_metrics(workdir / name)[0]


def test_trainer_step_with_replay_of_its_own_routing_equals_the_step_without(workdir):
    """One rank: records carrying the routing the trainer chose at step 1 (captured in process from
    the same seed) give the same step-1 loss and grad norm bit for bit with replay on and off; the
    same records with every id moved to the next expert give another step."""
    one = {"OMP_NUM_THREADS": "1"}  # every process one thread: the same arithmetic, three runs side by side
    data = _capture(workdir, [], 1, env=one)
    shifted = workdir / "shifted.jsonl"
    recs = [json.loads(x) for x in data.read_text().splitlines()]
    shifted.write_text("".join(json.dumps({**r, "routed_experts": [[[(e + 1) % 8 for e in lay] for lay in tok]
                                                                   for tok in r["routed_experts"]]}) + "\n"
                               for r in recs))
    runs = [("off", data, []),  # routed_experts in the records, replay off: ignored
            ("on", data, ["moe.routing_replay=true"]), ("other", shifted, ["moe.routing_replay=true"])]
    with ThreadPoolExecutor(3) as pool:
        off, on, other = pool.map(lambda r: _train(workdir, *r, env=one), runs)
    assert (on["loss"], on["grad_norm"]) == (off["loss"], off["grad_norm"])
    assert other["grad_norm"] != off["grad_norm"] and other["loss"] != off["loss"]


@pytest.mark.slow  # about 3 minutes: three 4-rank gloo runs on a 2-core CPU
def test_replay_under_ep2_cp2_equals_no_replay(workdir):
    """4 gloo ranks, EP 2 x CP 2 (headtail), dp_shard 2: the routing captured in that layout,
    written per record and replayed through the loader, CP sharding and the EP dispatch, gives
    the step without replay."""
    dims = ["parallel.ep=2", "parallel.cp=2"]
    data = _capture(workdir, dims, 4)
    off = _train(workdir, "off4", data, dims, nproc=4)
    on = _train(workdir, "on4", data, [*dims, "moe.routing_replay=true"], nproc=4)
    # same layout, same routing, same arithmetic: equal up to gloo's reduction order (none measured)
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6), (on["loss"], off["loss"])
    assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-6), (on["grad_norm"], off["grad_norm"])


# ------------------------------------------------------------------ refusals before launch


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("case,needle", [
    ("missing", "needs routed_experts in every rollout record"),
    ("layers", "wrong number of MoE layers"),
    ("k", "wrong number of experts per token (top-k)"),
    ("range", "expert id 8, outside [0, 8)"),
    ("dense", "has no MoE layers"),
    ("text", "data.format=text has none"),
])
def test_refusals_before_launch(workdir, case, needle):
    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    recs = [_rec(20, seed=s) for s in range(3)]
    if case == "missing":
        recs[1].pop("routed_experts")
    elif case == "layers":
        recs[2] = _rec(20, layers=3, seed=5)
    elif case == "k":
        recs = [_rec(20, k=3, seed=s) for s in range(3)]
    elif case == "range":
        recs[1]["routed_experts"][7][1][0] = 8
    path = _write(workdir / "r.jsonl", recs)
    over = ["model.flavor=tiny_dense"] if case == "dense" else []
    args = [f"data.path={path}", "moe.routing_replay=true", *over]
    if case == "text":
        args = ["moe.routing_replay=true", "loss=ce", "data.format=text"]
    if case == "missing":  # once through the real command: exit 2, one paragraph, nothing started
        p = run_cli(["train", "recipe=debug_grpo", *args], cwd=workdir)
        assert p.returncode == 2, p.stderr[-3000:]
        assert "moe.routing_replay=true" in p.stderr and needle in p.stderr, p.stderr[-3000:]
        assert not (workdir / "runs").exists()
        return
    with pytest.raises(UserError) as err:
        resolve("debug_grpo", args, world_size=1)
    assert "moe.routing_replay=true" in str(err.value) and needle in str(err.value), str(err.value)
