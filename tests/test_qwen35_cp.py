"""Context parallelism for the hybrid Qwen3.5 stack on CPU (gloo, 2 ranks): CP=2 gives the
CP=1 loss and gradients (fp32) for head-tail and contiguous sharding, with EP off and on
(EP=2 carved from dp_shard x cp = 2), on packed documents that cross the rank boundaries.

Each rank runs the trainer's own steps: the model spec's parallelize_fn (CP + EP + FSDP2),
weights from a HF folder through ``load_hf`` into the sharded parameters (init_states),
``get_attention_masks`` on global positions, torchtitan's ``prepare_context_parallel_input``
(the trainer's post_dataloading_process), forward, local CE sum / global tokens, backward.
The CP=1 reference is the same model unparallelised, on the full sequences.
"""

import os

import pytest
import torch

from conftest import free_port, spawn_ranks

CASES = [  # (name, ep, load balancer)
    ("headtail", 1, "headtail"),
    ("headtail_ep2", 2, "headtail"),
    ("contiguous", 1, None),
]
SEQ, BATCH, VOCAB = 256, 2, 320


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # packed documents; several cross the CP part boundaries (64, 128, 192 under head-tail)
    docs = [[100, 90, 66], [30, 200, 26]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return tokens, labels, positions


def _cp_worker(rank: int, world: int, port: int, out_dir: str, device: str = "cpu"):
    """One rank: every case of CASES; writes rank{rank}.pt with the differences to the reference.

    device "cpu": gloo, torch GatedDeltaNet, dense-mask attention; "cuda": NCCL, fla kernels and
    fla's CP, flex attention (tests/gpu/test_qwen35_gpu.py)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device == "cpu":
        os.environ["APIARY_DEVICE"] = "cpu"
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
    from framework import devices

    devices.install()
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    from components.models import qwen3_5

    dist.init_process_group(devices.backend(), rank=rank, world_size=world)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    tokens, labels, positions = (t.to(dev) for t in _batch())

    def loss_of(logits, lab, n_tokens):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), lab.flatten(), reduction="sum") / n_tokens

    # reference: CP=1, one process, full sequences
    torch.manual_seed(0)
    with torch.device("meta"):
        ref_model = qwen3_5.model_spec("debug_moe", load_balance_coeff=None).model.build()
    ref_model.to_empty(device=dev)
    with torch.no_grad():
        ref_model.init_states(buffer_device=dev)
    hf_dir = os.path.join(out_dir, "hf")  # the parallel models load these weights through load_hf (DTensors)
    if rank == 0:
        from components.models.qwen3_5_hf import save_hf

        save_hf(ref_model.state_dict(), qwen3_5.FLAVORS["debug_moe"], hf_dir, ref_model.config)
    dist.barrier()
    masks = ref_model.get_attention_masks(positions)
    ref_logits = ref_model(tokens, positions=positions, attention_masks=masks)
    ref_loss = loss_of(ref_logits, labels, labels.numel())
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}

    results = {}
    for name, ep, balancer in CASES:
        parallelism = ParallelismConfig(data_parallel_shard_degree=1, context_parallel_degree=world,
                                        expert_parallel_degree=ep, context_parallel_load_balancer=balancer)
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        pd = ParallelDims.from_config(parallelism, world)
        pd.build_mesh()
        spec = qwen3_5.model_spec("debug_moe", load_balance_coeff=None, hf_checkpoint=hf_dir)
        spec.model.update_from_config(config=SimpleNamespace(parallelism=parallelism))
        with torch.device("meta"):
            model = spec.model.build()
        model = spec.parallelize_fn(model, parallel_dims=pd, training=TrainingConfig(mixed_precision_param="float32"),
                                    parallelism=parallelism, compile_config=CompileConfig(enable=False),
                                    ac_config=None, dump_folder=out_dir)
        model.to_empty(device=dev)
        with torch.no_grad():
            model.init_states(buffer_device=dev)  # random init, then the HF weights
        ctx = dist_utils.get_spmd_context(parallel_dims=pd)
        extra = {"positions": positions.clone(), "attention_masks": model.get_attention_masks(positions)}
        inp, lab, extra = prepare_context_parallel_input(tokens.clone(), labels.clone(), extra, pd.get_mesh("cp"),
                                                         dev, balancer)
        want, _, _ = prepare_context_parallel_input(ref_logits.detach(), labels.clone(), {"positions": positions.clone()},
                                                    pd.get_mesh("cp"), dev, balancer)
        with ctx():
            logits = model(inp, **extra)
            loss = loss_of(logits, lab, labels.numel())
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
        results[name] = dict(
            loss=(total - ref_loss.detach()).abs().item(), ref_loss=ref_loss.item(),
            logits=(logits.detach() - want).abs().max().item(), logit_scale=want.abs().max().item(),
            grad=max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
            grad_scale=max(g.abs().max().item() for g in ref_grads.values()),
            n_params=len(grads), n_ref=len(ref_grads), sharded=sharded,
            local_len=inp.shape[1],
        )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_cp_cases(out, device: str = "cpu", world: int = 2) -> list[dict]:
    spawn_ranks(_cp_worker, world, world, free_port(), str(out), device)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_cp_cases(tmp_path_factory.mktemp("cp"))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_cp2_matches_cp1(cp_results, case):
    for r in cp_results:
        res = r[case]
        assert res["local_len"] == SEQ // 2
        assert res["n_params"] == res["n_ref"] == res["sharded"]  # FSDP2 (and EP) DTensors, loaded by load_hf
        # one fp32 forward + backward from the same weights; CP changes only summation orders
        # (attention over gathered K/V, the GatedDeltaNet state handed across the cut, the loss
        # summed over 2 ranks), and another CPU's SIMD width changes them again. Measured (Intel
        # Xeon, 2026-11-24, the ratios of run_cp_cases' results): logits 5.7e-8 of the largest,
        # loss 1.5e-7, gradients 3.6e-7 of the largest entry. Bounds: logits 1e-5 (~170 u, u = 6e-8);
        # the loss 4e-6 (64 u: a few tens of u per token through 2 blocks and a 320-way softmax,
        # plus log2(512) = 9 u for the token sum); gradients 1e-4 of the largest entry, since a
        # backward through the cut accumulates over both ranks' tokens
        assert res["logits"] <= 1e-5 * res["logit_scale"], res  # this rank's tokens, in its CP order
        assert res["loss"] <= 4e-6 * res["ref_loss"], res
        assert res["grad"] <= 1e-4 * res["grad_scale"], res
