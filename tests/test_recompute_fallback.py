"""recompute=auto at run time: when the CUDA allocator retries in a step after the warm-up, the run
steps back to auto's next cheaper candidate (kept -> FFN rerun -> recomputed), says so in one line,
logs `recompute_fallbacks`, and writes what it learned into the run folder, which a resume starts
from. CPU: the allocator's retry counter is faked (framework.devices.allocator_counters)."""

from __future__ import annotations

import json
import os

import pytest

from framework import contracts
from framework.plan import planner
from framework.plan.planner.constants import GiB
from framework.resolve.resolver import resolve


@pytest.fixture(autouse=True)
def _no_rank_environment(monkeypatch):
    from conftest import _RANK_ENV

    for k in _RANK_ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    for k in _RANK_ENV:
        os.environ.pop(k, None)


def _model(policies, fallbacks, counts):
    """qwen3_5's debug model under PerBlockAC; ``counts`` gets each block's and each MoE's forward calls."""
    import torch

    from components.models import qwen3_5
    from components.recompute.per_block import PerBlockAC
    from framework import devices

    devices.install()
    torch.manual_seed(0)
    model = qwen3_5.model_config("debug_moe").build()
    model.init_states()
    model.train()
    for name, block in model.layers.items():
        for key, mod in ((name, block), (f"{name}.moe", block.moe)):
            mod.register_forward_pre_hook(lambda *_, key=key: counts.__setitem__(key, counts.get(key, 0) + 1))
    PerBlockAC(PerBlockAC.Config(policies=policies, fallbacks=fallbacks,
                                 fallback_blocks=[{"mixer": {"kept": 3 - i, "recomputed": i}} for i in range(len(fallbacks))],
                                 planned_blocks={"planned": 1})).apply(model)
    return model


def _step(model, counts):
    """One forward and backward; (loss, each block's and MoE's forward calls in it, the gradients)."""
    import torch

    counts.clear()
    model.zero_grad()
    torch.manual_seed(1)
    tokens, pos = torch.randint(0, 200, (1, 64)), torch.arange(64).unsqueeze(0)
    loss = model(tokens, positions=pos, attention_masks=model.get_attention_masks(pos)).float().square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss.item(), dict(counts), grads


def test_retries_after_the_warm_up_switch_blocks_to_the_next_cheaper_choice(one_thread):
    """A kept block and a block rerunning its FFN: no switch without retries or in the warm-up; after a
    step with retries the FFN-rerun block is recomputed whole (it and its MoE run twice, not its MoE
    three times), then the kept block reruns its FFN; losses and gradients stay bit for bit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    counts: dict = {}
    fallbacks = [["full", "full", "full", "none"], ["full", "full", "full", "ffn"], ["full"] * 4]
    model = _model(["full", "full", "ffn", "none"], fallbacks, counts)
    (listener,) = contracts.memory_listeners([model])
    loss0, c, grads0 = _step(model, counts)
    assert (c["2"], c["2.moe"], c["3"], c["3.moe"]) == (1, 2, 1, 1), c  # ffn: the MoE reruns; kept: once
    assert listener.metrics == {"recompute_fallbacks": 0}
    assert listener.on_step(2, 2, 7) is None  # the warm-up (compile, autotune): not acted on
    assert listener.on_step(5, 5, 0) is None  # no retries: nothing changes
    assert _step(model, counts)[1] == c

    r = listener.on_step(6, 6, 3)
    assert r is not None and "retried 3 time(s) in step 6" in r.line and "layers.2 FFN rerun -> recomputed" in r.line
    assert "layers.3" not in r.line and "(auto's next cheaper choice: mixer: 3 kept)" in r.line
    assert r.learned == {"planned": {"planned": 1}, "fallbacks": 1, "blocks": {"mixer": {"kept": 3, "recomputed": 0}},
                         "step": 6, "retries": 3}
    assert listener.metrics == {"recompute_fallbacks": 1}
    loss1, c, grads1 = _step(model, counts)
    assert (c["2"], c["2.moe"], c["3"], c["3.moe"]) == (2, 2, 1, 1), c  # block 2 really reruns, whole
    assert model.layers["2"].checkpoint_impl is CheckpointImpl.NO_REENTRANT  # its MoE counts twice now
    assert model.layers["3"].checkpoint_impl is None

    r = listener.on_step(7, 7, 1)
    assert "layers.3 kept -> FFN rerun" in r.line
    loss2, c, grads2 = _step(model, counts)
    assert (c["3"], c["3.moe"]) == (1, 2), c
    assert model.layers["3"].checkpoint_impl is CheckpointImpl.NO_REENTRANT
    assert loss0 == loss1 == loss2
    assert all((a == b).all() and (a == d).all() for a, b, d in zip(grads0, grads1, grads2))

    assert listener.on_step(8, 8, 1) is not None  # the last candidate: every block recomputed
    assert _step(model, counts)[1]["3"] == 2
    assert listener.on_step(9, 9, 1) is None and listener.metrics == {"recompute_fallbacks": 3}  # none left


def test_no_fallbacks_no_listener_and_the_kept_blocks_stay_plain(one_thread):
    """Without cheaper candidates (recompute=auto's choice is the first) nothing listens."""
    counts: dict = {}
    model = _model(["full", "full", "ffn", "none"], [], counts)
    assert contracts.memory_listeners([model]) == []


def _budget_for_a_mix():
    """recompute.budget_gib for qwen35_debug_moe that keeps some blocks and has cheaper candidates."""
    from test_recompute_auto import _chain_totals

    from components.recompute.policies import MARGIN

    r = resolve("qwen35_debug_moe", ["recompute=auto"], for_training=False)
    totals = _chain_totals(r, 0, run_here=True)
    i = next(k for k, (b, t) in enumerate(totals) if k >= 2 and b["attention"]["kept"] and totals[k + 1][1] > t)
    return f"recompute.budget_gib={(totals[i][1] + totals[i + 1][1]) / 2 / (1 - MARGIN) / GiB:.6f}", totals[i][0]


def _train(tmp_path, monkeypatch, name, budget, retry_from_call: int | None):
    """Five steps of qwen35_debug_moe with recompute=auto; the allocator's retry counter grows by one a
    call from call ``retry_from_call`` on (None: never). Each step reads it twice: the metrics record,
    then the trainer's reaction."""
    from framework import devices
    from framework.cli import train_main

    calls = [0]

    def counters():
        calls[0] += 1
        return {"alloc_retries": 0 if retry_from_call is None else max(0, calls[0] - retry_from_call)}

    monkeypatch.setattr(devices, "allocator_counters", counters)
    out = tmp_path / name
    assert train_main(["recipe=qwen35_debug_moe", "recompute=auto", budget, "training.steps=5",
                       "checkpoint.enable=false", "training.seed=3", f"output_dir={out}"]) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return out, recs


def test_a_run_steps_back_after_retries_not_without_them_and_a_resume_starts_there(tmp_path, monkeypatch, capsys,
                                                                                one_thread):
    budget, blocks = _budget_for_a_mix()
    quiet, recs0 = _train(tmp_path, monkeypatch, "quiet", budget, None)
    assert [r["recompute_fallbacks"] for r in recs0] == [0] * 5
    assert not (quiet / contracts.LEARNED_FILE).exists()
    assert "allocator retried" not in capsys.readouterr().out

    # retries from step 2 on: those of the warm-up (steps 1-3) are not acted on; steps 4 and 5 step back
    loud, recs = _train(tmp_path, monkeypatch, "loud", budget, 3)
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if "allocator retried" in x]
    assert len(lines) == 2 and lines[0].startswith("recompute=auto: the CUDA allocator retried 2 time(s) in step 4 "), out
    assert "so from step 5 on layers." in lines[0] and "in step 5 " in lines[1]
    assert [r["recompute_fallbacks"] for r in recs] == [0, 0, 0, 0, 1], recs
    assert [r["loss"] for r in recs] == [r["loss"] for r in recs0]  # recompute changes no value
    learned = json.loads((loud / contracts.LEARNED_FILE).read_text())["recompute"]
    assert learned["planned"] == blocks and learned["fallbacks"] == 2 and learned["step"] == 5

    # read back: the same plan starts from the learned candidate; another plan starts afresh
    r = resolve("qwen35_debug_moe", ["recompute=auto", budget, f"output_dir={loud}"], for_training=False)
    d = r.ctx.derived["recompute"]
    from test_recompute_auto import _here

    fresh = planner.plan(r, gpu="H100", gpu_memory_bytes=int(float(budget.split("=")[1]) * GiB),
                         calibration=_here())
    assert d["planned"] == blocks and d["fallbacks_taken"] == 2
    assert d["blocks"] == learned["blocks"] == fresh.choices["recompute_fallbacks"][1] != blocks
    assert d["fallbacks"] == fresh.choices["recompute_fallbacks"][2:]
    assert "learned in this run: the allocator retried 2 time(s) in step 5" in r.data_summary
    other = resolve("qwen35_debug_moe", ["recompute=auto", "recompute.budget_gib=1000", f"output_dir={loud}"],
                    for_training=False)
    assert "fallbacks_taken" not in other.ctx.derived["recompute"]
    assert "stepped back from another plan; planned afresh" in other.data_summary
