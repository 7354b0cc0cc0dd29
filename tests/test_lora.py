"""adapter=lora against its baseline adapter=none (docs/skills/lora.md): a LoRA model starts as its
base and switches back to it exactly; the adapters' outputs and gradients match an fp64 reference;
through the trainer the optimizer holds the adapters alone, the base stays bitwise, step 1's loss is
the base's and a fine-tune lowers it; checkpoints hold adapters and a base pointer, a resume on
another base is refused; PEFT loads the export onto the transformers base with apiary's logits
(qwen3 MoE and qwen3_5), the merged folder too; every bad setting is refused before launch; the
planner counts the frozen base once. Two ranks (FSDP2 + EP) against one: opt-in (-m slow)."""

import copy
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from framework import devices

devices.install()  # before torchtitan is imported (CPU shims), as the trainer does

from components.adapters import modules, runtime  # noqa: E402
from components.adapters.lora import adapter_counts  # noqa: E402
from components.adapters.targets import is_adapter_param  # noqa: E402
from components.models import qwen3, qwen3_5  # noqa: E402
from components.models.common import ExactGroupedExperts  # noqa: E402

from conftest import ROOT, assert_rel, assert_same_trajectory, read_metrics, run_cli  # noqa: E402

SPECS = [  # tiny random HF checkpoints (tests/hf_reference.py): the bases PEFT loads
    {"name": "qwen3_moe", "cls": "qwen3_moe", "config": dict(
        vocab_size=333, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        rope_theta=1e6, max_position_embeddings=512)},
    {"name": "qwen35_moe", "cls": "qwen3_5_moe", "config": dict(
        vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, max_position_embeddings=1024, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0])), "seed": 1},
]
Q3_TARGETS = "[q,k,v,o,experts,lm_head]"
Q35_TARGETS = "[q,k,v,o,in_proj_q,in_proj_k,in_proj_v,in_proj_z,in_proj_a,in_proj_b,out_proj,shared_expert,experts]"
SMALL = ["training.seq_len=32", "training.local_batch=2", "recompute=none", "moe.load_balance_coeff=null",
         "logging.tensorboard=false"]


# ---------------------------------------------------------------- modules, no trainer


def _built(config, seed=7):
    with torch.device("meta"):
        m = copy.deepcopy(config).build()
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        m.init_states(buffer_device=torch.device("cpu"))
    return m


def _logits(model, tokens):
    from components.models.hf import causal_masks

    return model(tokens, attention_masks=causal_masks(model, tokens))


def _randomize_b(model, seed=3, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in runtime.adapter_parameters(model).items():
            if n.rsplit(".", 1)[1].startswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("family,flavor,targets", [
    (qwen3, "tiny_moe", ["q", "v", "o", "experts", "lm_head"]),  # fused wqkv with q and v only; bf16 experts
    (qwen3_5, "debug_moe", ["k", "in_proj_q", "in_proj_b", "out_proj", "shared_expert", "experts"]),
])
def test_a_lora_model_starts_as_its_base_and_switches_back_exactly(family, flavor, targets, one_thread):
    base_cfg = family.model_config(flavor, load_balance_coeff=None)
    lora_cfg, found = modules.convert(family.model_config(flavor, load_balance_coeff=None),
                                      modules.LoRASpec(rank=4, alpha=8.0, seed=5), targets)
    assert set(found) == set(targets)
    base, lora = _built(base_cfg), _built(lora_cfg)
    base_sd = base.state_dict()
    lora_sd = {k: v for k, v in lora.state_dict().items() if not is_adapter_param(k)}
    assert lora_sd.keys() == base_sd.keys() and all(torch.equal(base_sd[k], v) for k, v in lora_sd.items())
    # frozen base, trainable adapters, as many as the planner counts
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable == set(runtime.adapter_parameters(lora)) and trainable
    facts = family.facts(flavor)
    assert sum(p.numel() for p in runtime.adapter_parameters(lora).values()) == \
        sum(adapter_counts(facts, targets, 4)[k] for k in ("dense", "experts"))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _logits(base, tokens)
        assert torch.equal(_logits(lora, tokens), want)  # B = 0: exactly the base
        _randomize_b(lora)
        moved = _logits(lora, tokens)
        with runtime.adapters_disabled(lora):
            off = _logits(lora, tokens)
    assert (moved - want).abs().max() > 1e-2  # the adapters act ...
    assert torch.equal(off, want)  # ... and switched off, the frozen base's logits exactly
    assert all(m.lora_enabled for m in runtime.adapter_modules(lora))  # restored after the block


def _grads_against_fp64(module, forward, reference, inputs):
    """Output and adapter gradients of ``module`` (fp32) against ``reference`` (fp64, autograd on A and B)."""
    adapters = {n: p for n, p in module.named_parameters() if is_adapter_param(n)}
    out = forward(module, *inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(11)
    weights = [torch.randn(o.shape, generator=g) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    ref_params = {n: p.detach().double().requires_grad_(True) for n, p in adapters.items()}
    ref = reference(ref_params, *[x.double() for x in inputs])
    refs = ref if isinstance(ref, tuple) else (ref,)
    sum((o * w.double()).sum() for o, w in zip(refs, weights)).backward()
    for o, r in zip(outs, refs):
        assert_rel(o.detach(), r.detach(), 1e-6)
    for n, p in adapters.items():
        assert_rel(p.grad, ref_params[n].grad, 1e-5)


def test_adapter_outputs_and_gradients_match_fp64_references(one_thread):
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.common.linear import Linear

    g = torch.Generator().manual_seed(2)
    s = 16.0 / 4
    spec = modules.LoRASpec(rank=4, alpha=16.0, seed=1)

    def randomized(m):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return m

    # a plain linear: y = x W^T + s (x A^T) B^T
    lin = randomized(modules.lora_linear_class(Linear)(
        modules.lora_linear_class(Linear).Config(in_features=12, out_features=10, lora=spec)))
    W = lin.weight.detach().double()
    _grads_against_fp64(lin, lambda m, x: m(x), lambda p, x: x @ (W + s * p["lora_B"] @ p["lora_A"]).T,
                        (torch.randn(3, 5, 12, generator=g),))

    # a fused wqkv with q and v adapted: the stock wq / wk / wv its state dict holds, merged, give q, k, v
    cfg = FusedQKVLinear.Config(head_dim=4, n_heads=4, n_kv_heads=2,
                                wqkv=Linear.Config(in_features=16, out_features=(2 + 2) * 2 * 4))
    converted, _ = modules.convert(cfg, spec, ["q", "v"])
    fused = randomized(converted.build())
    sd = fused.state_dict()
    base = {k: v.double() for k, v in sd.items() if not is_adapter_param(k)}
    assert set(base) == {"wq.weight", "wk.weight", "wv.weight"}

    def qkv_ref(p, x):
        merged = runtime.merge_into({**base, **p}, s)
        return tuple((x @ merged[f"w{c}.weight"].T).view(*x.shape[:-1], -1, 4) for c in "qkv")

    _grads_against_fp64(fused, lambda m, x: m(x), qkv_ref, (torch.randn(2, 3, 16, generator=g),))

    # routed experts (one pair per expert and weight): tokens grouped by expert, per-expert SwiGLU
    E, D, Fh = 3, 8, 6
    cls = modules.lora_experts_class(ExactGroupedExperts)
    ex = randomized(cls(cls.Config(num_experts=E, dim=D, hidden_dim=Fh, lora=spec)))
    counts = torch.tensor([2, 0, 3])
    w = {n: getattr(ex, n).detach().double() for n in ("w1_EFD", "w2_EDF", "w3_EFD")}

    def experts_ref(p, x):
        outs = []
        for e, xe in enumerate(x.split(counts.tolist())):
            d = {k: w[k][e] + s * p[f"lora_B_{k[:2]}"][e] @ p[f"lora_A_{k[:2]}"][e] for k in w}
            outs.append((torch.nn.functional.silu(xe @ d["w1_EFD"].T) * (xe @ d["w3_EFD"].T)) @ d["w2_EDF"].T)
        return torch.cat(outs)

    _grads_against_fp64(ex, lambda m, x: m(x, counts), experts_ref, (torch.randn(5, D, generator=g),))


# ---------------------------------------------------------------- trainings (one process)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_hf")
    (out / "specs.json").write_text(json.dumps(SPECS))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "hf_reference.py"), str(out), str(out / "specs.json")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _trainer_run(recipe: str, overrides: list[str], inspect=None):
    """A run built and trained in this process (as framework.train.run.train does), ``inspect(trainer,
    before)`` called after training with the parameters it started from."""
    import os

    import torch.distributed as dist

    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config
    from framework.train.process import single_process_env
    from framework.train.run import write_run_files

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k, None) for k in keys}
    threads = torch.get_num_threads()
    trainer = None
    try:
        r = resolve(recipe, overrides)
        single_process_env()
        write_run_files(r)
        trainer = trainer_config(r).build()
        before = {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}
        trainer.train()
        if inspect is not None:
            inspect(trainer, before)
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        for k in keys:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]
    return read_metrics(r.output_dir)


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory):
    """adapter=none (1 step) and adapter=lora (8 steps) on a copy of the qwen3 MoE base; lora on qwen3_5."""
    work = tmp_path_factory.mktemp("lora_runs")
    base = work / "base"
    shutil.copytree(hf_dirs / "qwen3_moe", base)
    q3 = ["debug_moe", [f"model.hf_checkpoint={base}", *SMALL, "lr.min_lr_factor=1.0"]]
    seen = {}

    def inspect(trainer, before):
        model = trainer.model_parts[0]
        now = dict(model.named_parameters())
        seen["frozen_same"] = all(torch.equal(now[n], p) for n, p in before.items() if not is_adapter_param(n))
        seen["adapters_moved"] = all(not torch.equal(now[n], p) for n, p in before.items()
                                     if is_adapter_param(n) and ".lora_B" in n)
        held = {id(p) for opt in trainer.optimizers.optimizers for grp in opt.param_groups for p in grp["params"]}
        seen["optimizer_holds"] = {n for n, p in now.items() if id(p) in held}
        seen["adapters"] = set(runtime.adapter_parameters(model))

    none = _trainer_run(q3[0], q3[1] + ["training.steps=1", "checkpoint.enable=false", f"output_dir={work / 'none'}"])
    lora = _trainer_run(q3[0], q3[1] + ["adapter=lora", f"adapter.targets={Q3_TARGETS}", "adapter.rank=4",
                                        "optimizer.lr=1e-2", "training.steps=8", "checkpoint.interval=4",
                                        "publish.interval=4", "publish.keep=3", "publish.dtype=bfloat16",
                                        f"output_dir={work / 'lora'}"],
                        inspect)
    q35 = _trainer_run("qwen35_debug_moe", [f"model.hf_checkpoint={hf_dirs / 'qwen35_moe'}", *SMALL, "adapter=lora",
                                            f"adapter.targets={Q35_TARGETS}", "adapter.rank=4", "optimizer.lr=1e-2",
                                            "training.steps=2", "checkpoint.interval=2", "publish.interval=2",
                                            f"output_dir={work / 'q35'}"])
    return {"work": work, "base": base, "none": none, "lora": lora, "q35": q35, "seen": seen, "q3_args": q3}


def test_the_base_stays_frozen_and_the_adapters_learn(runs):
    seen, none, lora = runs["seen"], runs["none"], runs["lora"]
    assert seen["optimizer_holds"] == seen["adapters"]  # the optimizer holds the adapters alone
    assert seen["frozen_same"] and seen["adapters_moved"]  # 8 updates: base bitwise, every B moved
    assert lora[0]["loss"] == none[0]["loss"]  # step 1: B = 0 is the frozen base, exactly
    losses = [r["loss"] for r in lora]
    assert losses[-1] < losses[0] - 0.3, losses  # a fine-tune of the adapters alone lowers the loss


def test_checkpoints_hold_the_adapters_and_a_pointer_to_the_base(runs):
    import torch.distributed.checkpoint as dcp

    step = runs["work"] / "lora" / "checkpoint" / "step-8"
    keys = list(dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata)
    model = [k for k in keys if k.startswith("layers.") or k.startswith(("tok_embeddings", "norm", "lm_head"))]
    assert model and all(is_adapter_param(k) for k in model)
    optim = [k for k in keys if k.startswith("optimizer.state.")]
    assert optim and all(is_adapter_param(k.rsplit(".", 1)[0]) for k in optim)
    pointer = json.loads((step / "adapter_base.json").read_text())
    assert pointer["base"]["kind"] == "hf" and pointer["base"]["path"] == str(runs["base"].resolve())
    assert set(pointer["base"]["files"]) == {"config.json", "model.safetensors"}
    manifest = json.loads((step / "manifest.json").read_text())
    assert "adapter_base.json" in manifest["files"]  # checksummed with the rest of the step


def _apiary_logits(run: Path, tokens):
    """Logits of a run's latest adapters on its HF base, and with the adapters switched off."""
    from omegaconf import OmegaConf

    from components.adapters import export
    from components.models import hf_export
    from framework.compose import registry

    cfg = OmegaConf.load(run / "config.yaml")
    fam = registry.resolve("model", cfg.model.family)
    spec, targets = export._spec(cfg)
    model = _built(modules.convert(export._family_config(fam, cfg), spec, targets)[0])
    model.load_state_dict(export.load_adapters(fam, cfg, hf_export.latest_step(run)), strict=False)
    with torch.no_grad():
        on = model(tokens)
        with runtime.adapters_disabled(model):
            off = model(tokens)
    return on, off


PEFT_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.modules["fla"] = None  # else transformers routes GatedDeltaNet to fla's Triton kernels
    import torch, transformers
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from generator import load  # examples/rl_loop: a LoRA run's published version, as the generator loads it
    out = {}
    for name, cls, base, adapter, merged, tokens, published in json.loads(sys.argv[1]):
        C = getattr(transformers, cls)
        tokens = torch.load(tokens)
        pm = PeftModel.from_pretrained(C.from_pretrained(base, dtype=torch.float32), adapter).eval()
        want = set(get_peft_model_state_dict(pm, save_embedding_layers=False))  # the adapters, not the base head
        have = {k for k in load_file(adapter + "/adapter_model.safetensors")}
        with torch.no_grad():
            peft_logits = pm(tokens).logits
            merged_logits = C.from_pretrained(merged, dtype=torch.float32).eval()(tokens).logits
            gm, version = load(Path(published))
            gen_logits = gm(tokens).logits
            pub = PeftModel.from_pretrained(C.from_pretrained(base, dtype=torch.float32), published).eval()
            published_logits = pub(tokens).logits
        torch.save({"peft": peft_logits, "merged": merged_logits, "generator": gen_logits, "version": version,
                    "published_peft": published_logits,
                    "missing": sorted(want - have),
                    "unexpected": sorted(have - want)}, adapter + "/../" + name + "_hf.pt")
""")


def test_logprobs_with_an_adapter_folder_scores_the_adapted_model(runs, capsys):
    """`apiary logprobs BASE ROLLOUTS --adapter PEFT_DIR` (peft merges the adapters into the base)
    gives the log-probs of the merged export, and differs from the base's: the reference and the
    policy from one base plus one adapter folder."""
    from components.data.rollouts import PACKAGED_ROLLOUTS
    from toolkit.cli import apiary_main

    work, base = runs["work"], runs["base"]
    peft_dir, merged = work / "lp_peft", work / "lp_merged"
    if not peft_dir.exists():
        assert apiary_main(["export", str(work / "lora"), "--hf", str(peft_dir)]) == 0
        assert apiary_main(["export", str(work / "lora"), "--hf", str(merged), "--merged"]) == 0
    rollouts = work / "lp_rollouts.jsonl"
    rollouts.write_text("\n".join(PACKAGED_ROLLOUTS.read_text().splitlines()[:3]) + "\n")
    outs = {}
    for name, argv in (("adapter", [str(base), str(rollouts), "--adapter", str(peft_dir)]),
                       ("merged", [str(merged), str(rollouts)]), ("base", [str(base), str(rollouts)]),
                       ("run", [str(work / "lora"), str(rollouts)])):
        out = work / f"scored_{name}"  # (not lp_merged: the merged export's own folder)
        shutil.rmtree(out, ignore_errors=True)
        assert apiary_main(["logprobs", *argv, "--out", str(out)]) == 0
        outs[name] = [json.loads(x)["ref_logprobs"] for x in (out / rollouts.name).read_text().splitlines()]
    flat = {k: torch.tensor([x for r in v for x in r]) for k, v in outs.items()}
    assert (flat["adapter"] - flat["merged"]).abs().max() < 1e-4
    assert torch.equal(flat["run"], flat["merged"])  # the LoRA run folder itself: its base + adapters
    assert "step 8 (adapter=lora folded into its base)" in capsys.readouterr().out
    assert apiary_main(["logprobs", str(work / "lora"), str(rollouts), "--step", "4", "--out", str(work / "lp_s4")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "latest step (8) only" in err and f"apiary export {work / 'lora'} --hf OUT --merged" in err, err
    assert (flat["adapter"] - flat["base"]).abs().max() > 1e-3
    assert apiary_main(["logprobs", str(work / "lora"), str(rollouts), "--adapter", str(peft_dir), "--out",
                        str(work / "lp_bad")]) == 2
    assert "applies to a HuggingFace folder of the base" in " ".join(capsys.readouterr().err.split())
    # an adapter folder on another base (same shapes, other weights): refused, naming the file
    other = work / "lp_other_base"
    shutil.copytree(base, other)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(other / "model.safetensors"))
    first = sorted(sd)[0]
    sd[first] = sd[first] + 1.0
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert apiary_main(["logprobs", str(other), str(rollouts), "--adapter", str(peft_dir), "--out",
                        str(work / "lp_bad2")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "holds adapters trained on another base" in err and "model.safetensors" in err, err


def test_peft_loads_the_export_with_apiarys_logits(runs, hf_dirs, capsys):
    from framework.train import published
    from toolkit.cli import apiary_main

    work = runs["work"]
    cases = [("q3", "Qwen3MoeForCausalLM", runs["base"], work / "lora"),
             ("q35", "Qwen3_5MoeForCausalLM", hf_dirs / "qwen35_moe", work / "q35")]
    jobs, mine = [], {}
    for name, cls, base, run in cases:
        assert apiary_main(["export", str(run), "--hf", str(work / f"{name}_peft")]) == 0
        assert apiary_main(["export", str(run), "--hf", str(work / f"{name}_merged"), "--merged"]) == 0
        tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(4))
        torch.save(tokens, work / f"{name}_tokens.pt")
        mine[name] = _apiary_logits(run, tokens)
        jobs.append([name, cls, str(base), str(work / f"{name}_peft"), str(work / f"{name}_merged"),
                     str(work / f"{name}_tokens.pt"), str(published.read_latest(run / "weights"))])
    said = capsys.readouterr().out
    assert "PEFT LoRA adapter (rank 4, alpha 32)" in said and "routed experts of 2 layers" in said
    cfg35 = json.loads((work / "q35_peft" / "adapter_config.json").read_text())
    assert cfg35["rank_pattern"] == {"linear_attn.in_proj_qkv": 12, "gate_up_proj": 8}  # 3 x r fused, 2 x r experts
    assert cfg35["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    p = subprocess.run([sys.executable, "-c", PEFT_SCRIPT, json.dumps(jobs), str(ROOT / "examples" / "rl_loop")],
                       capture_output=True, text=True, timeout=600, cwd=work)
    assert p.returncode == 0, p.stderr[-3000:]
    _published_adapters_are_the_export(work)
    for name, *_ in cases:
        got = torch.load(work / f"{name}_hf.pt")
        assert got["missing"] == [] and got["unexpected"] == []  # every key PEFT expects, nothing it ignores
        on, off = mine[name]
        assert (on - off).abs().max() > 0.1  # the adapters matter
        # measured (2 cores, fp32): qwen3 MoE 1.5e-6 (PEFT) / 7.0e-6 (merged); qwen3_5 1.2e-5 / 5.2e-5 (GatedDeltaNet's
        # torch paths differ from transformers'); 2e-4 is the bound, a wrong row or scale moves logits by > 1e-2
        peft_diff, merged_diff = ((got[k] - on).abs().max().item() for k in ("peft", "merged"))
        print(f"{name}: max |logits| difference from apiary's: PEFT {peft_diff:.2e}, merged {merged_diff:.2e}")
        assert peft_diff < 2e-4 and merged_diff < 2e-4, name
        # the generator on the latest published version (the adapters alone, applied to the base by peft);
        # qwen3's were published in bfloat16: rounding them moves these tiny random models' logits by up to
        # ~0.8 (measured), so its generator is compared with PEFT's own loading of the same folder
        gen_diff = (got["generator"] - (on if name == "q35" else got["published_peft"])).abs().max().item()
        assert got["version"] == (8 if name == "q3" else 2) and gen_diff < 2e-4, (name, gen_diff)


def _published_adapters_are_the_export(work: Path) -> None:
    """publish.interval > 0 with adapter=lora: each version is the adapters alone in PEFT's format, the
    export of the checkpoint of the same step (bitwise; cast with publish.dtype), for the HF base."""
    from safetensors.torch import load_file

    from framework.train import published

    for name, run, last, dtype in (("q3", "lora", 8, torch.bfloat16), ("q35", "q35", 2, torch.float32)):
        weights = work / run / "weights"
        assert published.versions(weights) == ([0, 4, 8] if run == "lora" else [0, 2])
        assert published.read_latest(weights).name == f"step-{last}"
        got = weights / f"step-{last}"
        assert sorted(f.name for f in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                           published.VERSION_FILE]  # no base weights, no tokenizer
        exported = work / f"{name}_peft"
        mine, ref = load_file(got / "adapter_model.safetensors"), load_file(exported / "adapter_model.safetensors")
        assert sorted(mine) == sorted(ref)
        for k in ref:
            assert mine[k].dtype == dtype and torch.equal(mine[k], ref[k].to(dtype)), k
        assert json.loads((got / "adapter_config.json").read_text()) == \
            json.loads((exported / "adapter_config.json").read_text())
        first = load_file(weights / "step-0" / "adapter_model.safetensors")  # the starting adapters: B = 0
        assert all(not v.any() for k, v in first.items() if ".lora_B." in k)


def test_a_resume_trains_on_and_another_base_is_refused(runs, capsys):
    from framework.cli import train_main

    recipe, args = runs["q3_args"]
    run = runs["work"] / "lora"
    lora = ["adapter=lora", f"adapter.targets={Q3_TARGETS}", "adapter.rank=4", "optimizer.lr=1e-2",
            "checkpoint.interval=4", f"output_dir={run}", "checkpoint.resume=true"]
    weights = runs["base"] / "model.safetensors"
    original = weights.read_bytes()
    try:  # the base folder's weights changed under the adapters: refused before launch, naming the file
        from safetensors.torch import load_file, save_file

        sd = load_file(weights)
        sd["lm_head.weight"][0, 0] += 1.0
        save_file(sd, str(weights), metadata={"format": "pt"})
        code = train_main([f"recipe={recipe}", *args, *lora, "training.steps=10"])
        err = " ".join(capsys.readouterr().err.split())
        assert code == 2 and "checkpoint.resume=true: the base model.hf_checkpoint=" in err, err
        assert "has changed since the adapters in" in err and "model.safetensors has checksum" in err, err
    finally:
        weights.write_bytes(original)
    more = _trainer_run(recipe, [*args, *lora, "training.steps=10"])  # the same base: it continues
    assert [r["step"] for r in more] == list(range(1, 11))
    assert more[-1]["loss"] < runs["lora"][0]["loss"] - 0.3


# ---------------------------------------------------------------- refusals, planner


@pytest.mark.parametrize("recipe", ["debug_moe", "qwen35_debug_moe"])
def test_lora_on_an_moe_recipe_freezes_the_routing_bias_and_counts_the_adapters(recipe, workdir):
    """`train adapter=lora` on a shipped MoE recipe (moe.load_balance_coeff set): the routing bias is
    frozen with the base, said in one line, and the model is built without its load-balancing updates;
    the first lines count the trainable parameters."""
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    r = resolve(recipe, ["adapter=lora", "output_dir=run"])
    assert r.cfg.moe.load_balance_coeff is not None
    lines = r.data_summary.splitlines()
    lora = next(x for x in lines if x.startswith("adapter: LoRA"))
    assert re.search(r"; [\d,]+ trainable parameters \([\d.e-]+% of the base's [\d,]+\); frozen base", lora), lora
    assert any(x.startswith("adapter: the MoE routing bias is frozen with the base (moe.load_balance_coeff=")
               for x in lines), lines
    from torchtitan.models.common.moe import MoE

    moes = [m for _, m, _, _ in trainer_config(r).model_spec.model.traverse(MoE.Config)]
    assert moes and all(m.load_balance_coeff is None for m in moes)


@pytest.mark.parametrize("argv,needles", [
    (["adapter=lora", "adapter.rank=0"], ["adapter=lora: adapter.rank must be >= 1"]),
    (["adapter=lora", "adapter.rank=40", "adapter.targets=[k]"],
     ["adapter.rank=40 is above the width of the narrowest targeted layer: k", "min(in, out) = 32",
      "adapter.rank <= 32"]),
    (["adapter=lora", "adapter.targets=[q,expert]"], ["unknown 'expert'", "Did you mean 'experts'"]),
    (["adapter=lora", "adapter.targets=[in_proj_z]"],
     ["in_proj_z, which model.family=qwen3 model.flavor=tiny_moe does not have", "its linear kinds are q, k, v, o"]),
    (["adapter.rank=8", "adapter.dropout=0.1"],
     ["adapter=none: adapter.rank=8, adapter.dropout=0.1 configures LoRA adapters", "would be ignored",
      "Add adapter=lora"]),
    (["adapter=lora", "moe.load_balance_coeff=null", "adapter.targets=[q,lm_head]", "loss=linear_ce"],
     ["loss=linear_ce reads lm_head.weight", "would be ignored"]),
    (["adapter=lora", "moe.load_balance_coeff=null", "state=zero1"], ["state=zero1 is not. Use state=fsdp2"]),
    (["adapter=lora", "moe.load_balance_coeff=null", "precision=fp8"], ["precision=fp8 would convert"]),
    (["adapter=lora", "moe.load_balance_coeff=null", "publish.interval=2"],
     ["publish.interval=2 with adapter=lora publishes the adapters alone", "initialised from training.seed",
      "model.hf_checkpoint=DIR"]),
])
def test_bad_adapter_settings_are_refused_before_launch(argv, needles, workdir, capsys):
    from framework.cli import train_main

    code = train_main(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert err.startswith("error apiary:") and "Traceback" not in err and err.count("error apiary") == 1
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()


def test_adapters_are_not_sent_in_memory(hf_dirs, workdir, capsys):
    """A LoRA run's versions are PEFT folders that vLLM loads as adapters: an in-memory transport (which
    sends the whole model) is refused before launch, naming the one to use."""
    from framework.cli import train_main

    code = train_main(["recipe=debug_grpo_vllm", "adapter=lora", "moe.load_balance_coeff=null", "data.path=r",
                       f"model.hf_checkpoint={hf_dirs / 'qwen3_moe'}", "publish.dir=w", "--cfg", "job"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "Traceback" not in err, err
    assert "publish.transport=vllm_ipc sends the whole model to the engine in memory" in err, err
    assert "Use publish.transport=hf_folder" in err, err


def test_exports_that_cannot_be_written_are_refused(workdir, capsys):
    from omegaconf import OmegaConf

    from framework.compose.recipes import load
    from toolkit.cli import apiary_main

    for name, overrides in (("full", []), ("seeded", ["adapter=lora", "moe.load_balance_coeff=null"])):
        (workdir / name / "checkpoint" / "step-2").mkdir(parents=True)
        (workdir / name / "config.yaml").write_text(OmegaConf.to_yaml(load("debug_moe", overrides)))
        (workdir / name / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    (workdir / "seeded" / "checkpoint" / "step-2" / "adapter_base.json").write_text(json.dumps(
        {"base": {"kind": "seed", "key": "training.seed", "seed": 42, "family": "qwen3", "flavor": "tiny_moe"}}))
    from framework.train import integrity

    for name in ("full", "seeded"):  # a complete step has its manifest (the export verifies it first)
        step = workdir / name / "checkpoint" / "step-2"
        integrity.write_manifest(step, 2, integrity.entries(step, integrity.list_files(step)))
    assert apiary_main(["export", "full", "--hf", "out", "--merged"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "apiary export full --merged: folds adapters into their base" in err and "adapter=none" in err, err
    assert apiary_main(["export", "seeded", "--hf", "out"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "trained on weights initialised from training.seed=42 (qwen3 tiny_moe), a base that exists on no disk" \
        in err, err
    assert not (workdir / "out").exists()


def test_the_planner_counts_the_frozen_base_once():
    from framework.plan.planner import plan
    from framework.resolve.resolver import resolve

    # both with full recompute (the recipes' default, auto, would choose other blocks for each)
    r = resolve("qwen35_35b_lora_128k", ["recompute=full"], for_training=False)
    lora = plan(r)
    full = plan(resolve("qwen35_35b_128k", ["parallel.gpus=8", "recompute=full"], for_training=False))  # trained whole
    assert lora.dims == full.dims and lora.gpu_memory_bytes == full.gpu_memory_bytes
    assert lora.verdict != "OOM" and full.verdict == "OOM"  # on the GPUs the recipe names
    mem, full_mem = lora.memory_bytes, full.memory_bytes
    shard = r.layout.dp_shard * r.layout.cp
    n = adapter_counts(r.facts, list(r.cfg.adapter.targets), int(r.cfg.adapter.rank))
    adapters = n["dense"] + n["experts"]
    # the base once at the fp32 master's 4 B (a third of full training's 12 B master + Adam), no gradient;
    # the adapters as any trained parameter: 4 B gradient, 4 B master + 8 B Adam
    assert mem["frozen_base"] == pytest.approx(full_mem["optimizer_states"] / 3, rel=1e-6)
    assert mem["gradients"] == pytest.approx(adapters / shard * 4, rel=1e-6)
    assert mem["optimizer_states"] == pytest.approx(adapters / shard * 12, rel=1e-6)
    assert 0.03 < adapters / r.facts.n_params < 0.04  # 1.28B adapters on 34.7B, experts included
    assert full.total_bytes - lora.total_bytes > 40 * 2 ** 30
    assert lora.time_s["compute_dense"] < full.time_s["compute_dense"]  # no weight gradient for the base
    # the fused LM head allocates its dW accumulator only for a trained head (linear_ce_fn: need_dw)
    assert "loss_dw_accum" in full_mem and "loss_dw_accum" not in mem


def test_the_lora_recipes_description_says_what_full_training_needs_as_planned():
    """recipes/qwen35_35b_lora_128k.yaml's description names the factor of GPUs full training needs
    (was "4x", guessed): computed, the whole model at qwen35_35b_128k's derived layout plans OOM on the
    recipe's GPUs and fits on that factor of them."""
    import re

    from framework.plan.planner import plan
    from framework.resolve.resolver import resolve

    lora = resolve("qwen35_35b_lora_128k", [], for_training=False)
    gpus = int(lora.cfg.parallel.gpus)
    factor = int(re.search(r"full training, qwen35_35b_128k at its derived layout, needs (\d+)x the GPUs",
                           lora.cfg.description).group(1))
    assert plan(lora).verdict != "OOM"

    def whole(n):
        return plan(resolve("qwen35_35b_128k", [f"parallel.gpus={n}"], for_training=False)).verdict

    assert whole(gpus * (factor - 1)) == "OOM" and whole(gpus * factor) != "OOM"
    assert f"gpus={gpus}` OOM, gpus={gpus * factor} fits" in lora.cfg.description


def test_the_lora_pages_memory_numbers_are_todays_plans(capsys):
    """docs/skills/lora.md quoted 71.5, 39.3, 90.0 and 73.7 GiB after the planner had moved to 71.13, 41.40,
    92.07 and 70.94: each number it quotes is `apiary plan`'s total for the command it names, within 0.1 GiB."""
    import json
    import re

    from toolkit.plan import plan_main

    from conftest import ROOT

    text = " ".join((ROOT / "docs" / "skills" / "lora.md").read_text().split())
    quoted = re.search(r"1\.28B adapter parameters\): ([\d.]+) GiB per GPU, fits .*?; ([\d.]+) GiB with `recompute=full`, "
                       r"([\d.]+) GiB of it the frozen base\); .*?`apiary plan recipe=qwen35_35b_128k gpus=8`\): ([\d.]+) GiB, "
                       r"OOM .*? fits on 16 \(([\d.]+) GiB", text)
    assert quoted, "the memory paragraph of docs/skills/lora.md changed shape"

    def planned(*args):
        capsys.readouterr()
        assert plan_main([*args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    lora, full = planned("recipe=qwen35_35b_lora_128k"), planned("recipe=qwen35_35b_lora_128k", "recompute=full")
    whole8, whole16 = planned("recipe=qwen35_35b_128k", "gpus=8"), planned("recipe=qwen35_35b_128k", "gpus=16")
    frozen = next(t["bytes"] for t in full["terms"] if t["name"] == "frozen_base")
    want = [lora["total_bytes"], full["total_bytes"], frozen, whole8["total_bytes"], whole16["total_bytes"]]
    for doc, b in zip(quoted.groups(), want):
        assert float(doc) == pytest.approx(b / 2**30, abs=0.1), (quoted.groups(), [round(x / 2**30, 2) for x in want])
    assert lora["verdict"] != "OOM" and whole8["verdict"] == "OOM" and whole16["verdict"] != "OOM"


# ---------------------------------------------------------------- two ranks (opt-in)


@pytest.mark.slow
def test_two_ranks_fsdp2_and_ep_match_one_rank(hf_dirs, workdir):
    """FSDP2 over 2 gloo ranks with EP 2 (the experts' adapters sharded over the experts like their
    weights) trains the adapters as 1 rank does, on the same DCP base (a seed checkpoint of the HF
    qwen3 MoE, whose experts compute in fp32)."""
    small = [a for a in SMALL if not a.startswith("training.local_batch")]
    model = ["recipe=debug_moe", f"model.hf_checkpoint={hf_dirs / 'qwen3_moe'}", *small]
    p = run_cli(["train", *model, "checkpoint.create_seed=true", "output_dir=seed"], cwd=workdir)
    assert p.returncode == 0, p.stderr[-2000:]
    lora = [*model, "adapter=lora", f"adapter.targets={Q3_TARGETS}", "adapter.rank=4", "optimizer.lr=1e-2",
            f"checkpoint.load_path={workdir / 'seed' / 'checkpoint' / 'step-0'}", "training.steps=4",
            "checkpoint.enable=false"]
    one = run_cli(["train", *lora, "training.local_batch=4", "output_dir=one"], cwd=workdir)
    two = run_cli(["train", *lora, "training.local_batch=2", "nproc=2", "output_dir=two"], cwd=workdir)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert "ep 2" in two.stdout and "frozen base: checkpoint.load_path=" in one.stdout
    a, b = read_metrics(workdir / "one"), read_metrics(workdir / "two")
    assert_same_trajectory(a, b)
    assert a[-1]["loss"] < a[0]["loss"] - 0.1
