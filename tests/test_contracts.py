"""framework/contracts/: every registry entry satisfies its kind's Protocol, and every
component's bad option is refused before launch (exit 2, one paragraph naming the key)."""

import dataclasses
import inspect

import pytest

from framework import contracts
from framework.compose import registry

from conftest import run_cli


def _entries():
    for kind in contracts.KINDS:
        for name in registry.names(kind):
            yield kind, name


@pytest.mark.parametrize("kind,name", list(_entries()))
def test_registry_entry_satisfies_its_protocol(kind, name):
    comp = registry.resolve(kind, name)
    assert contracts.missing_members(kind, comp) == []
    assert_declared_members(kind, name, comp)
    assert dataclasses.is_dataclass(comp.Options)
    assert all(f.kw_only for f in dataclasses.fields(comp.Options)), f"{kind}={name}: Options is not kw_only"
    docs = contracts.field_docs(comp.Options)
    assert [f.name for f in dataclasses.fields(comp.Options) if not docs.get(f.name)] == [], "undocumented fields"
    # the recipe schema OmegaConf checks types against (Literal fields stored as their base type)
    assert {f.name for f in dataclasses.fields(contracts.schema_of(comp.Options))} == \
        {f.name for f in dataclasses.fields(comp.Options)}


def assert_declared_members(kind, name, comp):
    """Every member the contract of ``kind`` declares, none excluded: a required one is there; an
    optional one, when there, has its declared shape (a function, or a value); both read back
    through ``contracts.member``."""
    declared = contracts.declared_members(kind)
    optional = contracts.OPTIONAL_MEMBERS[kind]
    for m, is_function in declared.items():
        if m not in optional:
            assert hasattr(comp, m), f"{kind}={name}: lacks the required member {m}"
        elif not hasattr(comp, m):
            assert contracts.member(comp, kind, m) is optional[m]
            continue
        value = contracts.member(comp, kind, m)
        assert value == getattr(comp, m)  # (a classmethod is a new bound method each time)
        if is_function:
            assert callable(value), f"{kind}={name}: {m} is declared a function, got {type(value).__name__}"
        else:
            assert not inspect.isroutine(value), f"{kind}={name}: {m} is declared a value, got a function"


def test_kinds_and_apply_order_cover_the_registry():
    assert set(registry.entries()) == set(contracts.KINDS)
    assert set(contracts.APPLY_ORDER) <= set(contracts.KINDS)
    assert set(contracts.SELECT) == set(contracts.KINDS)
    # missing_members does see a kind's required members (the registry test above is not vacuous)
    assert {"Options", "check", "apply"} <= set(contracts.missing_members("loss", object()))
    assert {"BATCH_KEYS", "STEP_KEYS", "summary"} <= set(contracts.missing_members("data", object()))
    assert {"FLAVORS", "facts", "model_spec"} <= set(contracts.missing_members("model", object()))


def test_optional_members_are_declared_in_their_protocols():
    """One table per kind (and per runtime contract), each optional name a member of its Protocol."""
    assert set(contracts.OPTIONAL_MEMBERS) == set(contracts.KINDS) | set(contracts.RUNTIME_PROTOCOLS)
    for kind, table in contracts.OPTIONAL_MEMBERS.items():
        assert set(table) <= set(contracts.declared_members(kind)), kind
        assert set(contracts.required_members(kind)).isdisjoint(table)
    # what the framework and the tools read as optional (a component without them still runs)
    assert {"NUMERICS", "SKILL"} <= set(contracts.OPTIONAL_MEMBERS["state"])
    assert {"plan_terms", "NEEDS_DATA", "RL_KEYS"} <= set(contracts.OPTIONAL_MEMBERS["loss"])
    assert {"hf_writer", "HF_MODEL_TYPES", "export_hf", "hf_key_shapes", "save_hf"} <= set(contracts.OPTIONAL_MEMBERS["model"])
    assert {"render", "preflight", "check_options", "TEMPLATE"} <= set(contracts.OPTIONAL_MEMBERS["launcher"])
    assert set(contracts.OPTIONAL_MEMBERS["loss_fn"]) == {"set_batch", "metrics", "metric_weight"}


def test_member_gives_the_component_s_own_or_the_declared_default():
    class Bare:
        RUNS_HERE = True

    local = registry.resolve("launcher", "local")
    assert contracts.member(local, "launcher", "check_options") is local.check_options
    assert contracts.member(local, "launcher", "render") is None  # optional: not offered
    assert contracts.member(Bare, "launcher", "RUNS_HERE") is True
    assert dict(contracts.member(Bare, "launcher", "NUMERICS")) == {}
    assert contracts.member(Bare, "loss", "RL_KEYS") == ()
    assert contracts.member(object(), "loss_fn", "metric_weight") is None
    with pytest.raises(AttributeError):  # a required member has no default
        contracts.member(Bare, "launcher", "world_size")


def test_member_refuses_an_undeclared_name():
    local = registry.resolve("launcher", "local")
    with pytest.raises(contracts.UndeclaredMember, match="'check_warmup' is not a member of the launcher contract"):
        contracts.member(local, "launcher", "check_warmup")
    with pytest.raises(contracts.UndeclaredMember, match="not a member of the loss contract"):
        contracts.member(registry.resolve("loss", "ce"), "loss", "set_batch")  # the built loss's, not the component's


def test_a_component_without_a_required_member_is_refused_before_launch(monkeypatch):
    """resolve's member check reads the same table: an optional member may be left out, a required one not."""
    from framework.errors import UserError
    from framework.resolve import context as resolve_mod

    full = registry.resolve("loss", "ce")
    no_optional = type("NoOptional", (), {n: getattr(full, n) for n in ("Options", "check", "apply")})
    resolve_mod._check_members("loss", "ce", no_optional)  # NUMERICS, plan_terms, NEEDS_DATA, ... may go
    no_apply = type("NoApply", (), {n: getattr(full, n) for n in ("Options", "check")})
    with pytest.raises(UserError, match="lacks apply, which every loss provides"):
        resolve_mod._check_members("loss", "ce", no_apply)


def test_literal_choices_are_checked_by_options():
    from components.losses.linear_ce import LinearCrossEntropy
    from components.state.fsdp2 import FSDP2

    with pytest.raises(ValueError, match="loss.backend must be auto|torch"):
        LinearCrossEntropy.Options(backend="cuda")
    with pytest.raises(ValueError, match=r"state.offload must be none\|optimizer\|all for fsdp2, got 'disk'"):
        FSDP2.Options(offload="disk")
    assert FSDP2.Options(offload="all").offload == "all"


@pytest.mark.parametrize("kind,name,key,bad,says", [
    ("state", "zero1", "bucket_mb", 0, "state.bucket_mb must be > 0"),
    ("state", "fsdp2", "offload", "disk", "state.offload must be none|optimizer|all"),
    ("launcher", "local", "master_port", 0, "launcher.master_port must be a TCP port"),
    ("precision", "fp8", "scaling", "e4m3", "precision.scaling must be"),
    ("loss", "grpo", "temperature", 0.0, "loss.temperature must be > 0"),
    ("loss", "chunked", "num_chunks", 0, "loss.num_chunks must be >= 1"),
    ("loss", "linear_ce", "z_loss", -1.0, "loss.z_loss must be >= 0"),
])
def test_options_refuse_a_bad_value_as_they_are_built(kind, name, key, bad, says):
    """An Options' value checks live in its ``__post_init__`` once (check() does not run them again):
    the options resolve builds from a recipe section with the bad value are refused there, and the
    same options with a good value pass the kind's check."""
    from omegaconf import OmegaConf

    comp = registry.resolve(kind, name)
    comp.check(comp.Options(), None)
    section = OmegaConf.structured(contracts.schema_of(comp.Options)(name=name, **{key: bad}))
    with pytest.raises(ValueError) as e:
        contracts.make_options(comp, section)
    assert says in str(e.value)


def test_chunked_num_chunks_zero_exits_2_before_any_worker(workdir):
    p = run_cli(["train", "recipe=debug_moe", "loss=chunked", "loss.num_chunks=0"], cwd=workdir, timeout=300)
    assert p.returncode == 2, p.stderr
    err = " ".join(p.stderr.split())
    assert err.startswith("error apiary: loss=chunked: loss.num_chunks must be >= 1")
    assert "Traceback" not in p.stderr and "step" not in p.stdout
    assert len(p.stderr.strip().splitlines()) == 1  # one paragraph
    assert not (workdir / "runs").exists()  # nothing started, nothing written


@pytest.mark.parametrize("argv,needles", [
    (["loss=linear_ce", "loss.z_loss=-1"], ["loss=linear_ce", "loss.z_loss must be >= 0"]),
    (["loss=linear_ce", "loss.backend=cuda"], ["loss=linear_ce", "loss.backend must be"]),
    (["loss=grpo", "loss.temperature=0", "data.format=rollouts"], ["loss=grpo", "loss.temperature must be > 0"]),
    (["state=zero1", "state.bucket_mb=0"], ["state=zero1", "state.bucket_mb must be > 0"]),
    (["recompute=partial"], ["unknown recompute 'partial'", "selective"]),
    (["launcher.master_port=0"], ["launcher=local", "launcher.master_port must be a TCP port"]),
    (["precision=fp8", "precision.scaling=e4m3"], ["precision=fp8", "precision.scaling must be one of"]),
    (["model.n_layers=0"], ["model.family=qwen3", "model.n_layers must be >= 1"]),
    (["data.format=parquet"], ["data.format=parquet", "unknown data 'parquet'", "rollouts"]),
    (["data.sharding=rows"], ["data.sharding=rows", "valid: blocks, documents"]),
])
def test_bad_component_option_refused_before_launch(capsys, workdir, argv, needles):
    from framework.cli import train_main

    code = train_main(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert err.startswith("error apiary:") and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()


def test_loss_refuses_data_it_does_not_train_on(capsys, workdir):
    from components.losses.policy import GRPO, SFT
    from framework.cli import train_main

    assert GRPO.NEEDS_DATA == ("rollouts",) and "text" in SFT.NEEDS_DATA
    code = train_main(["loss=grpo"])  # data.format=text (the default)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert "loss=grpo: is a policy objective: it trains on RL rollouts" in err and "data.format=rollouts" in err
    code = train_main(["loss=sft", "loss.norm=sequence"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "with loss.norm=sequence needs the rollouts' sequence boundaries" in err
    assert not (workdir / "runs").exists()


def test_data_kind_supplies_the_batch_keys_the_trainer_forwards(tmp_path):
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    text = trainer_config(resolve("debug_moe", [f"output_dir={tmp_path / 'a'}"], for_training=False))
    assert text.batch_keys == () and text.step_keys == ()
    rl = trainer_config(resolve("debug_grpo", [f"output_dir={tmp_path / 'b'}"], for_training=False))
    assert "rl_advantages" in rl.batch_keys and rl.step_keys == ("rl_num_seqs",)
    assert type(rl.dataloader).__qualname__.startswith("RolloutDataLoader")


def test_field_docs_and_choices_reach_train_help():
    from components.losses.chunked import ChunkedCrossEntropy
    from framework.compose.hydra_cli import help_text

    assert contracts.field_docs(ChunkedCrossEntropy.Options)["num_chunks"].startswith("sequence chunks per step")
    text = help_text()
    assert "loss.backend: auto|torch|triton|cublas|mixed|fwdgrad = 'auto'" in text
    assert "state.offload: none|optimizer|all = 'none'" in text
    assert "data (a key's value): text, rollouts" in text


def test_refusal_points_at_a_skill_page_that_exists(capsys, workdir):
    from framework.cli import train_main

    for argv, page in ((["loss=grpo", "data.format=rollouts", "loss.temperature=0"], "docs/skills/rl_objectives.md"),
                       (["state=zero1", "state.bucket_mb=0"], "docs/skills/zero1.md")):
        assert train_main(argv) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert page in err, err
        assert (registry.ROOT / page).is_file()


def test_user_component_missing_contract_members_is_refused(capsys, workdir):
    """A user's loss without `apply` (the trainer would fail in the worker) exits 2 before launch,
    naming the entry, its registry file and the missing member."""
    (workdir / "half_loss.py").write_text(
        "from dataclasses import dataclass\n\n"
        "class Half:\n"
        "    @dataclass(kw_only=True)\n"
        "    class Options:\n"
        "        name: str = 'half'\n\n"
        "    @staticmethod\n"
        "    def check(options, ctx):\n"
        "        return None\n")
    reg = workdir / "reg.yaml"
    reg.write_text("loss:\n  half:\n    target: half_loss:Half\n    doc: a loss without apply\n")
    p = run_cli(["train", "recipe=debug_moe", f"registry={reg}", "loss=half"], cwd=workdir, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "loss 'half'" in p.stderr and "lacks apply" in p.stderr and str(reg) in p.stderr
    assert "Traceback" not in p.stderr
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("loss", ["linear_ce", "grpo"])
def test_cuda_only_loss_backend_refused_on_a_machine_without_cuda(workdir, loss):
    """loss.backend=mixed on CPU failed in the worker with Triton's "0 active drivers"; now exit 2
    before launch, with the backends that run here."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the backend runs")
    extra = ["data.format=rollouts"] if loss == "grpo" else []
    p = run_cli(["train", "recipe=debug_moe", f"loss={loss}", "loss.backend=mixed", *extra], cwd=workdir, timeout=120,
                env={"TRITON_INTERPRET": "0"})
    assert p.returncode == 2, p.stderr[-2000:]
    assert "loss.backend=mixed runs CUDA kernels" in p.stderr and "loss.backend=auto" in p.stderr
    assert "Traceback" not in p.stderr and not (workdir / "runs").exists()


def test_a_key_nothing_reads_is_refused(capsys, workdir):
    """layout.min_local_seq was declared but never read (silently ignored); it is gone, so setting it
    is an unknown key (exit 2) rather than a setting without effect."""
    from framework.cli import train_main

    assert train_main(["recipe=debug_moe", "layout.min_local_seq=1000"]) == 2
    err = capsys.readouterr().err
    assert "layout.min_local_seq" in err and "Traceback" not in err
