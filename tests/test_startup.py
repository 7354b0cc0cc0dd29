"""Start-up of the command-line tools: `apiary --help`, `apiary ls`, `apiary show NAME`, every
`apiary COMMAND --help` and `train --help` run without importing torch or torchtitan (through the
console scripts' entry functions in a fresh interpreter, sys.modules read after each command) and
still print what they printed, and so does `train --cfg job` on a recipe of each model family;
importing ``framework`` loads no torch, and the device shims still run before torchtitan is first
imported. The timings themselves are benchmarks/startup_bench.py's (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# What a start-up path must not load: torch and torchtitan (seconds each), and what comes with
# the models, the data and the plots.
HEAVY = ("torch", "torchtitan", "triton", "transformers", "fla", "datasets", "matplotlib")
_MARK = "@@startup "

# Runs each argv through the console script's entry function in this one fresh interpreter, then
# reports on stderr each run's exit code and which of the modules asked about were imported by then
# (imports only accumulate, so the first run after which a module shows is the one that imported it).
_CHILD = r"""
import importlib, json, sys
entry, argvs, asked = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
module, _, func = entry.partition(":")
runs = []
for argv in argvs:
    sys.argv = [module, *argv]
    print("@@argv " + " ".join(argv), flush=True)
    try:
        getattr(importlib.import_module(module), func)()
        code = None
    except SystemExit as e:
        code = e.code
    sys.stdout.flush()
    runs.append({"code": code, "imported": [m for m in asked if m in sys.modules]})
print("\n" + MARK + json.dumps(runs), file=sys.stderr)
""".replace("MARK", repr(_MARK))


def run_entry(entry: str, argvs: list[list[str]], asked=HEAVY, timeout: int = 300) -> dict[str, dict]:
    """Run ``entry`` (module:function, the console script's) on each argv in turn in one fresh
    interpreter (wide terminal: no table wraps); per argv (joined by spaces): its exit code, the
    modules of ``asked`` imported by the end of it, and what it printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="250")
    p = subprocess.run([sys.executable, "-c", _CHILD, entry, json.dumps(argvs), json.dumps(list(asked))], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    line = [ln for ln in p.stderr.splitlines() if ln.startswith(_MARK)]
    assert line, f"the child reported nothing (exit {p.returncode}):\n{p.stderr[-3000:]}"
    outs = p.stdout.split("@@argv ")[1:]
    return {" ".join(a): dict(r, out=o.split("\n", 1)[1]) for a, r, o in zip(argvs, json.loads(line[-1][len(_MARK):]), outs)}


APIARY, TRAIN = "toolkit.cli:apiary_entry", "framework.cli:train_entry"
# every command's --help still has its own arguments: in argparse's usage line, which it builds from
# the parser (a description that names them would not do), still without torch
COMMAND_OPTIONS = {
    "ls": ["registry=PATH"], "show": ["NAME"], "cp": ["NAME", "PATH"], "plan": ["--json", "--search", "--top", "--constants"],
    "compare": ["--check", "--json", "--no-probe", "--keep-checkpoints", "--tol", "--jobs", "--timeout", "--max-numel"],
    "launch": ["-n", "--wait", "-v", "k=v"], "warmup": ["-v", "k=v"], "cp-template": ["LAUNCHER", "PATH"],
    "autotune-table": ["--out FILE", "KERNEL_CACHE"], "export": ["--hf OUT", "RUN_DIR"],
    "logprobs": ["--out DIR", "--step N", "--temperature T", "--field", "--batch-tokens N", "MODEL", "ROLLOUTS"],
    "plot": ["--out FILE", "RUN [RUN ...]"],
}


@pytest.fixture(scope="module")
def apiary_runs():
    """`apiary --help`, `ls`, `show debug_moe`, `show grpo`, then every `apiary COMMAND --help`."""
    return run_entry(APIARY, [["--help"], ["ls"], ["show", "debug_moe"], ["show", "grpo"],
                              *([c, "--help"] for c in COMMAND_OPTIONS)])


@pytest.mark.parametrize("argv, expected", [
    ("--help", ["usage: apiary", " ls ", " show ", " plan ", " compare ", " launch ", " warmup ", " cp-template ",
                " autotune-table", " export ", " logprobs ", " plot "]),
    ("ls", ["recipes", "debug_moe", "qwen35_35b_128k", "components.losses.linear_ce:LinearCrossEntropy",
            "components.state.zero1:Zero1", "registry.yaml"]),
    ("show grpo", ["loss grpo: RL: GRPO", "target: components.losses.policy:GRPO", "from: registry.yaml"]),
], ids=["help", "ls", "show-registry-name"])
def test_apiary_starts_without_torch(apiary_runs, argv, expected):
    r = apiary_runs[argv]
    assert r["code"] == 0, r["out"][-2000:]
    assert r["imported"] == [], f"apiary {argv} imported {r['imported']}"
    for s in expected:
        assert s in r["out"], f"apiary {argv} no longer prints {s!r}:\n{r['out'][-3000:]}"


def test_apiary_show_recipe_prints_the_yaml_without_torch(apiary_runs):
    r = apiary_runs["show debug_moe"]
    assert r["code"] == 0 and r["imported"] == []
    assert r["out"] == (ROOT / "recipes" / "debug_moe.yaml").read_text()


def test_every_apiary_command_help_lists_its_options_without_torch(apiary_runs):
    for c, opts in COMMAND_OPTIONS.items():
        r = apiary_runs[f"{c} --help"]
        assert r["code"] == 0 and r["imported"] == [], (c, r["imported"])
        usage = r["out"].split("\n\n")[0]
        assert usage.startswith(f"usage: apiary {c}"), r["out"][:300]
        for o in opts:
            assert o in usage, f"apiary {c} --help lacks {o}:\n{usage}"


def test_train_help_starts_without_torch_and_lists_every_group_option():
    r = run_entry(TRAIN, [["--help"]])["--help"]
    out = r["out"]
    assert r["code"] == 0 and r["imported"] == []
    for s in ("usage: train [recipe=NAME]", "groups (registry.yaml", "loss.num_chunks: int = 8",
              "loss.backend: auto|torch|triton|cublas|mixed|fwdgrad = 'auto'", "state.bucket_mb: float = 256.0",
              "precision.scaling: tensorwise|rowwise|blockwise|mxfp8 = 'tensorwise'", "launcher.nproc",
              "keys (framework/compose/schema.py", "training.seq_len: int"):
        assert s in out, f"train --help no longer prints {s!r}"


@pytest.mark.parametrize("argv, expected", [
    (["recipe=debug_moe", "--cfg", "job"], ["family: qwen3", "# derived layout for"]),
    (["recipe=qwen35_35b_128k", "parallel.cp=8", "--cfg", "job"], ["family: qwen3_5", "cp: 8"]),
    (["recipe=llama3_8b_128k", "--cfg", "job"], ["family: llama3"]),
], ids=["qwen3", "qwen3_5", "llama3"])
def test_cfg_job_resolves_without_torch(argv, expected):
    """`train --cfg job` resolves the recipe (model facts from the family's architecture table,
    layout, every component's check) without importing torch or torchtitan: the family modules
    registry.yaml names import their torchtitan side only to build a model."""
    r = run_entry(TRAIN, [argv])[" ".join(argv)]
    assert r["code"] == 0, r["out"][-2000:]
    assert r["imported"] == [], f"train {' '.join(argv)} imported {r['imported']}"
    for s in expected:
        assert s in r["out"], f"train {' '.join(argv)} no longer prints {s!r}"


def test_framework_imports_no_torch_and_shims_run_before_torchtitan():
    """The device shims move from `import framework` to the first torchtitan import: a finder on
    sys.meta_path runs framework.devices.install() then, whoever imports torchtitan. And the
    ignore index components/labels.py writes out is torchtitan's."""
    code = ("import sys; import framework, components, toolkit; assert 'torch' not in sys.modules, 'torch'\n"
            "from components.labels import IGNORE_INDEX\n"
            "from torchtitan.components.loss import IGNORE_INDEX as theirs\n"
            "from framework import devices; import torch._utils as tu\n"
            "print(devices._INSTALLED, devices.has_accelerator() or tu._get_available_device_type() == 'cpu',"
            " IGNORE_INDEX == theirs)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", "True", "True"]
