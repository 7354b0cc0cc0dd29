"""What a resume may change (framework/resolve/resume.py): the learning-rate schedule against torchtitan's
own, every schema key classified, refusals that name the key and both values, and one real run
extended past its end (the schedule continues as chosen; the first config is never overwritten)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from framework.compose.schema import RecipeConfig
from framework.resolve import resume
from tests.conftest import read_metrics, train_here

SMALL = ["recipe=debug_moe", "logging.tensorboard=false", "training.local_batch=2", "training.seq_len=128",
         "checkpoint.interval=3"]


def _torchtitan_lrs(steps: int, total, warmup: int, decay_ratio, decay_type: str, min_lr_factor: float) -> list:
    """The rates torchtitan's scheduler (built through apiary's build) gives training steps 1..steps."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from framework.train.build import _held_schedule_config

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = _held_schedule_config(LRSchedulersContainer.Config)(
        warmup_steps=warmup, total_steps=total, decay_ratio=decay_ratio, decay_type=decay_type,
        min_lr_factor=min_lr_factor)
    sched = cfg.build(optimizers=[opt], training_steps=steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])  # the rate this step's update uses
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("total,warmup,decay_ratio,decay_type,min_lr", [
    (10, 2, None, "linear", 0.0), (10, 3, 0.5, "cosine", 0.1), (7, 0, None, "sqrt", 0.0),
    (6, 2, None, "linear", 0.0),  # 4 steps past the horizon: the final rate is held (torchtitan's goes negative)
    (5, 1, 0.4, "cosine", 0.25),
])
def test_schedule_factor_matches_the_built_scheduler(total, warmup, decay_ratio, decay_type, min_lr):
    steps = 10
    got = [resume.schedule_factor(s, total, warmup, decay_ratio, decay_type, min_lr) for s in range(1, steps + 1)]
    want = _torchtitan_lrs(steps, total, warmup, decay_ratio, decay_type, min_lr)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert min(want) >= 0.0


def test_the_first_resumed_step_uses_the_rate_it_logs():
    """torchtitan loads the scheduler (which recomputes the rate) before the optimizer (whose saved
    groups carry the old rate): after both, the groups hold the schedule's rate for the new settings."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from framework.train.build import _held_schedule_config

    class Box(list):  # the optimizer container's load (torchtitan's: all optimizers from one dict)
        def load_state_dict(self, sd):
            self[0].load_state_dict(sd)

    def build(lr):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        box = Box([opt])
        cfg = _held_schedule_config(LRSchedulersContainer.Config)(warmup_steps=2, total_steps=10, decay_ratio=None,
                                                                  decay_type="linear", min_lr_factor=0.0)
        return opt, box, cfg.build(optimizers=box, training_steps=10)

    opt, box, sched = build(1.0)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt2, box2, sched2 = build(0.5)  # optimizer.lr changed on resume
    sched2.load_state_dict(saved_sched)
    box2.load_state_dict(saved_opt)  # torchtitan's order: the optimizer after the scheduler
    want = 0.5 * resume.schedule_factor(4, 10, 2, None, "linear", 0.0)
    assert opt2.param_groups[0]["lr"] == pytest.approx(want) and sched2.schedulers[0].get_last_lr()[0] == pytest.approx(want)
    assert saved_opt["param_groups"][0]["lr"] == pytest.approx(2 * want)  # what the optimizer's load put back


def test_every_schema_key_is_classified():
    from framework.compose import recipes

    keys = {k for r in ("debug_moe", "debug_grpo", "debug_grpo_live") for k in resume.leaves(recipes.load(r, []))}
    unclassified = [k for k in keys if resume.classify(k) is None]
    assert not unclassified, f"classify these in framework/resolve/resume.py FIXED or FREE: {unclassified}"
    assert resume.classify("loss.name") == "fixed" and resume.classify("loss.clip_eps") == "free"
    assert resume.classify("model.n_layers") == "fixed" and resume.classify("model.attn_backend") == "free"


def _saved(tmp_path, **changes):
    cfg = OmegaConf.structured(RecipeConfig)
    cfg.recipe, cfg.training.steps = "debug_moe", 20
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    new = cfg.copy()
    for k, v in changes.items():
        OmegaConf.update(new, k, v)
    return new


def test_a_fixed_change_is_refused_naming_the_key_and_both_values(tmp_path):
    new = _saved(tmp_path, **{"training.seed": 7, "model.n_layers": 3, "logging.log_freq": 5})
    with pytest.raises(Exception) as e:
        resume.check(new, tmp_path, 10)
    msg = str(e.value)
    assert "training.seed: 42 then, 7 now" in msg and "model.n_layers: null then, 3 now" in msg, msg
    assert "log_freq" not in msg  # a free key is not among the refused
    assert f"checkpoint.load_path={tmp_path}/checkpoint/step-10" in msg


def test_free_changes_are_listed_and_an_unchanged_schedule_needs_no_choice(tmp_path):
    new = _saved(tmp_path, **{"logging.log_freq": 5, "checkpoint.interval": 4})
    lines = resume.check(new, tmp_path, 10).lines(tmp_path)
    assert lines[0].startswith(f"resume: {tmp_path}/checkpoint/step-10 verified") and "from step 11" in lines[0]
    assert "checkpoint.interval 10 -> 4" in lines[1] and "logging.log_freq 1 -> 5" in lines[1]


def test_more_steps_on_a_decaying_schedule_asks_for_a_choice(tmp_path):
    new = _saved(tmp_path, **{"training.steps": 30})
    with pytest.raises(Exception) as e:
        resume.check(new, tmp_path, 20)
    msg = " ".join(str(e.value).split())
    assert "lr.total_steps=30 stretches" in msg, msg
    assert "(lr.total_steps=20) is refused: its final lr is 0, which trains nothing" in msg  # decays to 0
    # a constant rate after warm-up: the next step's rate is the same under both horizons
    (tmp_path / "config.yaml").unlink()
    new = _saved(tmp_path, **{"training.steps": 30, "lr.min_lr_factor": 1.0})
    OmegaConf.update(new, "lr.min_lr_factor", 1.0)
    saved = OmegaConf.load(tmp_path / "config.yaml")
    saved.lr.min_lr_factor = 1.0
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert "spans 30 steps" in resume.check(new, tmp_path, 20).lines(tmp_path)[-1]


def test_a_resume_of_an_unfinished_run_without_its_steps_offers_the_launched_steps(tmp_path):
    """A run launched with training.steps=300 and stopped at step 4, resumed without repeating the steps (a
    resume keeps the launch's overrides, not training.steps): the refusal names the launched steps first."""
    cfg = OmegaConf.structured(RecipeConfig)
    cfg.recipe, cfg.training.steps = "debug_moe", 300
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    new = cfg.copy()
    new.training.steps = 20
    with pytest.raises(Exception) as e:
        resume.check(new, tmp_path, 4)
    msg = " ".join(str(e.value).split())
    assert "Choose one: training.steps=300 finishes the run as it was launched" in msg, msg
    assert "lr.total_steps=20 stretches" in msg


@pytest.mark.parametrize("extra", [[], ["checkpoint.resume=true"]])
def test_steps_past_a_horizon_that_ends_at_lr_0_are_refused(extra, tmp_path):
    """lr.total_steps=30 with training.steps=60 (a 30-step run extended to 60) would train steps 31-60 at
    lr 0: refused before launch naming the horizon that covers them; a final rate above 0 is kept."""
    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve("debug_moe", ["training.steps=60", "lr.total_steps=30", f"output_dir={tmp_path}", *extra],
                for_training=False)
    msg = " ".join(str(e.value).split())
    assert "steps 31-60 of training.steps=60 would train nothing" in msg and "Use lr.total_steps=60" in msg, msg
    resolve("debug_moe", ["training.steps=60", "lr.total_steps=30", "lr.min_lr_factor=0.1"], for_training=False)


def test_launch_configs_are_numbered_and_the_first_is_kept(tmp_path):
    assert resume.config_path_for_launch(tmp_path).name == "config.yaml"
    (tmp_path / "config.yaml").write_text("a: 1\n")
    assert resume.config_path_for_launch(tmp_path).name == "config.resume-1.yaml"
    (tmp_path / "config.resume-1.yaml").write_text("a: 2\n")
    assert resume.config_path_for_launch(tmp_path).name == "config.resume-2.yaml"
    assert [p.name for p in resume.launch_configs(tmp_path)] == ["config.yaml", "config.resume-1.yaml"]


def test_extending_a_finished_run(tmp_path, capsys):
    """6 steps, then `training.steps=9`: refused with the choices (nothing written); a changed
    seed refused; `lr.total_steps=9` trains steps 7-9 at the rates the stretched schedule gives,
    says which checkpoint it loaded, and keeps the first config. The printed resume command stretches the
    schedule from the rate step 6 used (the launch's optimizer.lr=0.002 replaced by 0.000833: the plain
    stretch would raise the lr from 5e-4 to 1.2e-3 at step 7, tests/test_summary.py); the launch's own
    override is kept by a resume that does not give it again; given again, the new value wins."""
    run = tmp_path / "run"
    p = train_here(["train", *SMALL, "training.steps=6", f"output_dir={run}", "optimizer.lr=0.002"], tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    printed = next(x for x in p.stdout.splitlines() if x.strip().startswith("resume "))
    assert f"train recipe=debug_moe output_dir={run} checkpoint.resume=true training.steps=12" in printed
    assert printed.endswith("lr.total_steps=12 optimizer.lr=0.000833") and "overrides)" not in printed, printed
    assert "raises the lr to 0.0012 at step 7" in p.stdout
    first = (run / "config.yaml").read_text()
    # refused before launch (resolve, as `train` runs it first): no choice of schedule, a changed seed
    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    for extra, needle in (([], "lr.total_steps=9 stretches"), (["lr.total_steps=9", "training.seed=1"],
                                                               "training.seed: 42 then, 1 now")):
        with pytest.raises(UserError) as e:
            resolve("debug_moe", [*SMALL[1:], "training.steps=9", f"output_dir={run}", "checkpoint.resume=true", *extra])
        assert needle in " ".join(str(e.value).split())
    assert sorted(x.name for x in run.glob("config*.yaml")) == ["config.yaml"]
    p = train_here(["train", *SMALL, "training.steps=9", f"output_dir={run}", "checkpoint.resume=true",
                    "lr.total_steps=9"], tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resume: {run}/checkpoint/step-6 verified against its manifest" in p.stdout
    assert "training.steps 6 -> 9" in p.stdout and "spans 9 steps (it spanned 6)" in p.stdout
    assert "resume: keeps the last launch's overrides optimizer.lr=0.002 (give one again to change it)" in p.stdout
    assert (run / "config.yaml").read_text() == first
    launch2 = OmegaConf.load(run / "config.resume-1.yaml")
    assert launch2.training.steps == 9 and launch2.lr.total_steps == 9 and launch2.optimizer.lr == 0.002
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == list(range(1, 10))
    cfg1, cfg2 = (OmegaConf.to_container(OmegaConf.load(run / n)) for n in ("config.yaml", "config.resume-1.yaml"))
    assert [r["lr"] for r in recs[:6]] == pytest.approx([resume.lr_at(cfg1, s) for s in range(1, 7)], rel=1e-12)
    assert [r["lr"] for r in recs[6:]] == pytest.approx([resume.lr_at(cfg2, s) for s in range(7, 10)], rel=1e-12)
    assert recs[6]["lr"] > recs[5]["lr"]  # the stretch the user chose: the rate rises at step 7
    assert json.loads((run / "layout.json").read_text())["dims"]["dp_shard"] == 1
    # a rate changed on resume is the rate the first resumed step uses (torchtitan's optimizer load
    # would put back the saved one for that step): with optimizer.lr=0 the weights stay as saved
    p = train_here(["train", *SMALL, "training.steps=12", f"output_dir={run}", "checkpoint.resume=true",
                    "lr.total_steps=12", "optimizer.lr=0", "moe.load_balance_coeff=null"], tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "optimizer.lr 0.002 -> 0.0" in p.stdout and (run / "config.resume-2.yaml").is_file()
    assert [r["lr"] for r in read_metrics(run)[9:]] == [0.0, 0.0, 0.0]
    at9, at12 = _weights(run / "checkpoint" / "step-9"), _weights(run / "checkpoint" / "step-12")
    assert at9.keys() == at12.keys() and all(torch.equal(at9[k], at12[k]) for k in at9)


def _weights(step_dir) -> dict:
    """The model's parameters in a DCP step folder (not the MoE routing bias: a buffer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size) for k, v in md.items()
          if not k.startswith(("optimizer", "lr_scheduler", "dataloader", "train_state")) and "expert_bias" not in k
          and hasattr(v, "size")}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    return sd


def test_a_stopped_run_names_where_to_go_on_from(tmp_path):
    """The non-finite stop's advice: the last complete step and the resume command, or, when no step
    was saved, to start again (was: "resume from none (no complete step)")."""
    from framework.train import integrity

    ck = tmp_path / "checkpoint"
    assert "nothing to resume: run it again from the start" in integrity.restart_hint(ck, "`train ...`")
    (ck / "step-2").mkdir(parents=True)
    integrity.write_manifest(ck / "step-2", 2, {})
    hint = integrity.restart_hint(ck, "`train output_dir=x checkpoint.resume=true`")
    assert hint == f"Last good checkpoint: step-2 in {ck}. Resume from it with `train output_dir=x checkpoint.resume=true`"
