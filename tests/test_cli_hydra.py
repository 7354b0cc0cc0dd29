"""`train` on Hydra's command line (-m sweeps, --cfg job|hydra|all, ~key, --help from the schema),
`apiary` on argparse subcommands, user registry files, and text printed without rich markup."""

import json
import os
import textwrap

import pytest
import yaml

from framework.cli import train_main
from toolkit.cli import apiary_main

from conftest import ROOT, run_cli

TINY = ["training.seq_len=32", "model.n_layers=1", "checkpoint.enable=false", "logging.tensorboard=false"]

USER_LOSS = '''
from dataclasses import dataclass

from torchtitan.components.loss import CrossEntropyLoss


class ScaledCE(CrossEntropyLoss):
    """torchtitan's cross-entropy times a constant."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        scale: float = 2.0

    def __init__(self, config, *, compile_config=None):
        super().__init__(config, compile_config=compile_config)
        self.scale = config.scale

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        loss, extra = super().__call__(pred, labels, global_valid_tokens, **kwargs)
        return loss * self.scale, extra


class Scaled:
    @dataclass(kw_only=True)
    class Options:
        name: str = "scaled_ce"
        scale: float = 2.0
        """multiplies the cross-entropy"""

    @staticmethod
    def check(options, ctx):
        if options.scale <= 0:
            raise ValueError(f"loss.scale must be > 0, got {options.scale}")

    @staticmethod
    def apply(options, tc, ctx):
        tc.loss = ScaledCE.Config(global_vocab_size=ctx.facts.vocab_size, scale=options.scale)
'''


@pytest.fixture(autouse=True)
def package_registry_after():
    """User registry files merged in-process are forgotten after each test."""
    from framework.compose import registry

    yield
    registry.entries.cache_clear()
    registry._USED.clear()


@pytest.fixture
def user_registry(tmp_path):
    """A loss in the user's own module (outside the package) and a registry file naming it."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "my_losses.py").write_text(USER_LOSS)
    reg = d / "my_registry.yaml"
    reg.write_text(textwrap.dedent('''\
        loss:
          scaled_ce:
            target: my_losses:Scaled
            doc: "cross-entropy x scale [a user's loss]"
    '''))
    return reg


def _err(capsys, argv, main=train_main):
    code = main(argv)
    return code, " ".join(capsys.readouterr().err.split())


def _sweep_dir(workdir):
    sweeps = list((workdir / "runs" / "debug_moe").glob("multirun-*"))
    assert len(sweeps) == 1, sweeps
    assert (sweeps[0] / "multirun.yaml").is_file()  # Hydra's record of the sweep
    return sweeps[0]


def test_multirun_2x2_sweep_one_resolved_config_per_job(workdir):
    """`train -m` through Hydra's BasicSweeper and BasicLauncher: 2 x 2 = 4 jobs, one directory each
    under the sweep directory, each with its own resolved config (each job writes its run files and
    stops short of training; the next test trains). In a fresh interpreter: Hydra configures logging."""
    import subprocess
    import sys

    script = textwrap.dedent(f"""
        import sys
        from framework import cli
        from framework.train import run
        from framework.resolve.resolver import resolve

        def job_without_training(recipe, job, output_dir, verbose):
            run.write_run_files(resolve(recipe, [*job, "output_dir=" + output_dir]))
            return 0

        cli._run_job = job_without_training
        sys.exit(cli.train_main(["-m", "loss=ce,chunked", "training.steps=1,2", "~training.global_batch",
                                 *{TINY!r}]))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=workdir, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Launching 4 jobs locally" in p.stdout + p.stderr
    sweep = _sweep_dir(workdir)
    assert sorted(d.name for d in sweep.iterdir() if d.is_dir()) == ["0", "1", "2", "3"]
    seen = set()
    for job in range(4):
        d = sweep / str(job)
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert cfg["output_dir"] == str(d) and cfg["parallel"]["dp_shard"] == 1  # resolved: dims derived
        assert cfg["training"]["global_batch"] is None  # ~key reaches every job
        overrides = yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())
        assert f"loss={cfg['loss']['name']}" in overrides and f"training.steps={cfg['training']['steps']}" in overrides
        seen.add((cfg["loss"]["name"], cfg["training"]["steps"]))
    assert seen == {("ce", 1), ("ce", 2), ("chunked", 1), ("chunked", 2)}


def test_multirun_of_a_recipe_file_that_chooses_a_component_in_its_own_section(workdir):
    """A recipe file setting `loss: {name: chunked, num_chunks: 4}` trains as written, and a `-m` sweep of it
    composes every job with that choice (Hydra's own composition had the default loss's schema refuse
    num_chunks: a traceback, exit 1)."""
    import subprocess
    import sys

    (workdir / "mine.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\nloss:\n  name: chunked\n  num_chunks: 4\n")
    script = textwrap.dedent(f"""
        import sys
        from framework import cli
        from framework.train import run
        from framework.resolve.resolver import resolve

        def job_without_training(recipe, job, output_dir, verbose):
            run.write_run_files(resolve(recipe, [*job, "output_dir=" + output_dir]))
            return 0

        cli._run_job = job_without_training
        sys.exit(cli.train_main(["-m", "recipe=mine.yaml", "training.steps=1,2", *{TINY!r}]))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=workdir, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    (sweep,) = (workdir / "runs" / "mine").glob("multirun-*")
    for job in range(2):
        cfg = yaml.safe_load((sweep / str(job) / "config.yaml").read_text())
        assert (cfg["loss"]["name"], cfg["loss"]["num_chunks"], cfg["training"]["steps"]) == ("chunked", 4, job + 1)


def test_multirun_trains_a_user_loss_from_a_registry_file(workdir, user_registry):
    """A real sweep of 2 runs; the loss comes from a user registry file (registry=PATH) and a module
    outside the package, and takes effect (step-1 loss = 2 x cross-entropy's)."""
    p = run_cli(["train", "-m", f"registry={user_registry}", "loss=ce,scaled_ce", "training.steps=1", *TINY],
                cwd=workdir, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Launching 2 jobs locally" in p.stdout + p.stderr
    sweep = _sweep_dir(workdir)
    first = {}
    for job in range(2):
        d = sweep / str(job)
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1]
        first[cfg["loss"]["name"]] = records[0]["loss"]
    assert first["scaled_ce"] == pytest.approx(2 * first["ce"], rel=1e-5)


def test_multirun_checks_every_job_before_the_first_starts(capsys, workdir):
    code, err = _err(capsys, ["-m", "training.steps=1,0", *TINY])
    assert code == 2 and "training.steps=0: must be >= 1" in err, err
    code, err = _err(capsys, ["-m", "loss=ce,bogus", *TINY])
    assert code == 2 and "unknown loss 'bogus'" in err, err
    code, err = _err(capsys, ["-m", "loss=ce,chunked", "output_dir=x"])
    assert code == 2 and "hydra.sweep.dir" in err, err
    assert not (workdir / "runs").exists() and not (workdir / "x").exists()


def test_cfg_all_hydra_job_print_and_exit(capsys, workdir):
    assert train_main(["--cfg", "all", "training.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and "\nhydra:\n" in out and "derived layout for 1 GPU:" in out
    assert train_main(["--cfg", "hydra", "-p", "hydra.sweep"]) == 0
    out = capsys.readouterr().out
    assert "# @package hydra.sweep" in out and "dir: runs/debug_moe/multirun-" in out and "steps:" not in out
    assert train_main(["-c", "job", "-p", "training", "training.steps=4"]) == 0
    out = capsys.readouterr().out
    assert "steps: 4" in out and "model:" not in out
    assert not (workdir / "runs").exists()  # nothing trained
    code, err = _err(capsys, ["--cfg", "everything"])
    assert code == 2 and "invalid choice: 'everything'" in err and "[recipe=NAME]" in err  # brackets kept
    code, err = _err(capsys, ["--resolve"])
    assert code == 2 and "--resolve flag can only be used in conjunction with --cfg" in err
    code, err = _err(capsys, ["-m", "--cfg", "job"])
    assert code == 2 and "Only one of" in err
    code, err = _err(capsys, ["--config-name", "x"])
    assert code == 2 and "--config-name: is not used by apiary" in err and "recipe=NAME" in err
    assert train_main(["--version"]) == 0
    assert "Hydra 1.3" in capsys.readouterr().out


def test_info_prints_hydras_search_path(capsys, workdir):
    assert train_main(["--info", "searchpath"]) == 0
    out = capsys.readouterr().out
    assert "pkg://hydra.conf" in out and "recipes" in out


def test_tilde_unsets_an_optional_key(capsys, workdir):
    base = ["recipe=qwen35_35b_128k", "training.seq_len=4096", "parallel.cp=1", "--cfg", "job"]
    assert train_main(base) == 0
    assert "derived layout for 32 GPUs" in capsys.readouterr().out  # the recipe's parallel.gpus
    assert train_main([*base, "~parallel.gpus"]) == 0
    out = capsys.readouterr().out
    assert "derived layout for 1 GPU:" in out and "gpus: null" in out
    assert train_main([*base, "~parallel.gpus=32"]) == 0  # Hydra's ~key=VALUE: only when it matches
    assert "gpus: null" in capsys.readouterr().out
    code, err = _err(capsys, [*base, "~parallel.gpus=8"])
    assert code == 2 and "parallel.gpus is 32, not 8" in err
    code, err = _err(capsys, ["~training.steps", "--cfg", "job"])
    assert code == 2 and "training.steps is a required setting" in err and "training.steps=VALUE" in err
    code, err = _err(capsys, ["~loss", "--cfg", "job"])
    assert code == 2 and "loss is a component group" in err and "loss=ce|chunked" in err


def test_train_help_is_generated_from_the_schema(capsys):
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: train [recipe=NAME] [key=value | group=option | +key=value | ~key ...] [-m]" in out
    assert "groups (registry.yaml" in out
    for needle in ("  loss:", "linear_ce", "materialised [tokens, vocab] logits", "loss.num_chunks: int = 8",
                   "  recompute:", "  launcher:", "launcher.nproc", "moe_chunk (a key's value)",
                   "training.steps: int = 20", "parallel.cp: int|null = None", "--multirun", "--cfg job|hydra|all"):
        assert needle in out, needle


def test_apiary_help_lists_commands_and_options(capsys):
    assert apiary_main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("ls", "show", "cp", "plan", "compare", "launch", "cp-template", "export"):
        assert f"    {cmd}" in out, cmd
    assert apiary_main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--json", "--search", "--top N", "--constants", "gpu_memory=80GiB", "calibration=FILE"):
        assert flag in out, flag
    assert apiary_main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "--wait" in out and "--verbose" in out
    assert apiary_main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--check", "--json", "--no-probe", "--keep-checkpoints", "--tol", "--jobs", "--timeout", "--max-numel"):
        assert flag in out, flag


def test_apiary_subcommand_errors(capsys, workdir):
    code, err = _err(capsys, ["bogus"], apiary_main)
    assert code == 2 and "invalid choice: 'bogus'" in err
    code, err = _err(capsys, ["plan", "recipe=debug_moe", "--bogus"], apiary_main)
    assert code == 2 and "argument --bogus: unknown flag" in err
    code, err = _err(capsys, ["plan", "recipe=debug_moe", "--top=0"], apiary_main)
    assert code == 2 and "--top=0: must be a positive integer" in err
    code, err = _err(capsys, ["show"], apiary_main)
    assert code == 2 and "NAME" in err
    code, err = _err(capsys, ["export", "nowhere"], apiary_main)
    assert code == 2 and "--hf" in err
    # flags between overrides: the override after --json still applies
    assert apiary_main(["plan", "recipe=debug_moe", "--json", "gpus=1", "training.seq_len=64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 1


def test_apiary_ls_keeps_brackets_and_names_the_source(workdir, user_registry):
    p = run_cli(["apiary", "ls"], cwd=workdir, timeout=300, env={"COLUMNS": "400"})
    assert p.returncode == 0, p.stderr
    assert "materialised [tokens, vocab] logits" in p.stdout  # was "materialised  logits"
    assert "scaled_ce" not in p.stdout
    p = run_cli(["apiary", "ls"], cwd=workdir, timeout=300,
                env={"COLUMNS": "400", "APIARY_REGISTRY": str(user_registry)})
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if "scaled_ce" in line)
    assert "cross-entropy x scale [a user's loss]" in row and str(user_registry) in row
    assert "registry.yaml" in next(line for line in p.stdout.splitlines() if " linear_ce " in line)


def test_user_registry_from_a_recipe_and_its_errors(capsys, workdir, user_registry):
    assert apiary_main(["cp", "debug_moe", str(user_registry.parent / "mine.yaml")]) == 0
    capsys.readouterr()
    recipe = user_registry.parent / "mine.yaml"
    recipe.write_text(recipe.read_text() + "registry: my_registry.yaml\n")  # relative to the recipe
    assert train_main([f"recipe={recipe}", "loss=scaled_ce", "loss.scale=5", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert "name: scaled_ce" in out and "scale: 5.0" in out
    bad = workdir / "bad.yaml"
    bad.write_text("losss:\n  x:\n    target: m:X\n")
    code, err = _err(capsys, [f"registry={bad}", "--cfg", "job"])
    assert code == 2 and "unknown component kind 'losss'" in err and "'loss'" in err
    bad.write_text("loss:\n  ce:\n    target: m:X\n")
    code, err = _err(capsys, [f"registry={bad}", "--cfg", "job"])
    assert code == 2 and "loss 'ce' is already defined by registry.yaml" in err
    bad.write_text("loss:\n  broken:\n    target: no_such_module_here:X\n")
    code, err = _err(capsys, [f"registry={bad}", "loss=broken", "--cfg", "job"])
    assert code == 2 and "cannot import no_such_module_here:X" in err and str(bad) in err
    code, err = _err(capsys, ["registry=/nonexistent/reg.yaml", "--cfg", "job"])
    assert code == 2 and "no user registry file at /nonexistent/reg.yaml" in err
    assert not (workdir / "runs").exists()


def test_apiary_ls_piped_prints_every_row_whole(capsys, monkeypatch):
    """`apiary ls | grep ...` cut the registry's targets and docs with an ellipsis (rich fitted the table
    to 80 columns when stdout is not a terminal): piped, each row is whole on one line."""
    from framework.compose import registry

    monkeypatch.delenv("COLUMNS", raising=False)
    assert apiary_main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    lines = out.splitlines()
    for kind, names in registry.entries().items():
        for name, e in names.items():
            row = next(ln for ln in lines if ln.split()[:2] == [kind, name])
            assert e["target"] in row and " ".join(e["doc"].split()) in row, row
