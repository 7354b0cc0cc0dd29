"""Every shell command in README.md and docs/ (docs/skills/ included) runs as written, or runs in a
cheap equivalent that still checks its arguments, or is listed with the reason it cannot run on a
CPU; and the docs point at pages that exist (registry names' skill pages, links, anchors).

HOW TO ADD A COMMAND. test_every_doc_command_is_classified finds every command line in a fenced
code block (every line of a bash/sh block; in any other block, the lines that start with train,
apiary, python, torchrun, pytest, ruff, pip, bash, git, ...) and fails for each one that COMMANDS
below lacks, naming its file:line. Add it to COMMANDS, keyed by the line as written (a trailing
`# comment` dropped, `\\` continuations joined, runs of spaces collapsed), as one of:

- ``RUN``: runs on this CPU as written, in an empty temporary folder, and must exit 0;
- ``CFG`` / ``DRY`` or ``Run(...)``: a cheap equivalent. ``CFG`` appends ``--cfg job`` to a `train`
  that would train for minutes (Hydra parses it and apiary resolves and validates every override,
  nothing trains); ``DRY`` appends ``--dry-run`` to an `apiary launch`. ``Run(subs={TEXT: VALUE})``
  fills placeholders (RUN, PATH, DIR, X, ...) with fixture values: ``{run}``/``{run2}`` (two
  finished debug_moe runs), ``{tok}`` (a tokenizer folder), ``{rollouts}`` (the packaged
  rollouts), ``{tmp}`` (the command's folder); ``drop`` removes tokens, ``setup`` makes the files
  the page says to have (``tokenizer:PATH``), ``before`` runs doc commands first, ``expect`` is
  the exit code the page shows. `apiary compare` runs its own preflight only (every variant
  resolved, nothing trained: tests/test_compare.py trains them);
- ``SUITE``: runs (part of) this test suite or its linter: the test paths it names must exist;
- ``Skip("reason")``: cannot run here (a GPU, a cluster, the network, a model download, ...).

An entry whose command no longer appears in any doc fails test_no_stale_entries: delete or update it.
Commands run in-process (train_main, apiary_main) to save interpreter start-ups.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import _RANK_ENV, ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "skills").glob("*.md"))]
_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:train|apiary|python3?|torchrun|pytest|ruff|pip|bash|sh|git|"
                     r"sbatch|srun|scancel|squeue|\.venv/bin/\S+|\./\S+)(?:\s|$)")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
_HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")


@dataclass(frozen=True)
class Run:
    add: tuple = ()
    subs: dict = field(default_factory=dict)
    drop: tuple = ()
    setup: tuple = ()
    before: tuple = ()
    expect: int = 0


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Suite:
    pass


RUN, CFG, DRY, SUITE = Run(), Run(add=("--cfg", "job")), Run(add=("--dry-run",)), Suite()
TOP1 = Run(add=("--top=1",))  # a search re-resolves each row it shows (~0.35 s each): show one
GPU = "needs a GPU"
TUTORIAL = Skip("tests/test_tutorial.py runs docs/tutorial.md's blocks in order, as written")
Q3_TOKENIZER = "tokenizer:assets/hf/Qwen3-30B-A3B"  # where the recipe expects it (docs/recipes.md)

COMMANDS: dict[str, Run | Skip | Suite] = {
    # README.md
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && train":
        Skip("creates a virtualenv and installs from the package registry (network); this suite runs in one, "
             "and `train` alone is tests/test_train_cpu.py's run"),
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && python -m pytest -q":
        Skip("creates a virtualenv and installs from the package registry (network), then runs this suite"),
    "python -m pytest -q tests/test_state.py::test_zero1_matches_fsdp2_for_10_steps": SUITE,
    "python -m pytest -q -m slow": SUITE,
    "python -m pytest -q tests/gpu": SUITE,
    "ruff check .": SUITE,
    "train recipe=debug_moe training.steps=100 loss=chunked loss.num_chunks=4 recompute=full": CFG,
    "train recipe=debug_moe nproc=2": CFG,
    "train recipe=qwen35_35b_128k parallel.cp=8 --cfg job": RUN,
    "train recipe=debug_grpo loss=dapo loss.entropy_coef=1e-3": CFG,
    "train recipe=debug_grpo_live output_dir=live/run &": Run(drop=("&",), add=("--cfg", "job")),
    "python examples/rl_loop/generator.py --weights live/weights --out live/rollouts --shards 31":
        Skip("samples from the weights the live trainer publishes, so it runs beside it for minutes; "
             "tests/test_rl_loop.py runs the pair"),
    "torchrun --nproc_per_node 8 $(which train) recipe=qwen3_30b_a3b_64k": Skip("needs 8 GPUs of 141 GB"),
    "pip install -e '.[vllm]'": Skip("installs vLLM from the package registry (network)"),
    "python benchmarks/bad_inputs_third_pass.py --timeout 60 [--only 3,7] [--json rows.json] [--keep]":
        Skip("a measurement of about 12 minutes (117 cases, each a fresh interpreter; two-rank trainings)"),
    "apiary warmup recipe=qwen35_debug_grpo_vllm training.kernel_cache=kc": RUN,
    "train recipe=debug_grpo_vllm output_dir=live/run &": Run(drop=("&",), add=("--cfg", "job")),
    "train recipe=debug_grpo_vllm adapter=lora model.hf_checkpoint=base/step-0 publish.transport=hf_folder "
    "output_dir=live/run &":
        Skip("needs an HF base folder at base/step-0; tests/test_lora.py publishes adapters on such a base and "
             "tests/gpu/test_vllm_gpu.py runs this training beside vLLM"),
    "python examples/rl_loop/vllm_generator.py --weights live/weights --out live/rollouts":
        Skip("needs vLLM and a GPU (tests/gpu/test_vllm_gpu.py); tests/test_vllm_generator.py runs its loop with a "
             "stand-in for vLLM's LLM"),
    "apiary ls": RUN,
    "apiary show debug_moe": RUN,
    "apiary cp debug_moe my_recipe.yaml": RUN,
    "apiary plan recipe=qwen35_35b_128k gpus=32 gpu_memory=80GiB": RUN,
    "apiary plan recipe=qwen35_35b_128k gpus=32 --search": TOP1,
    "apiary compare recipe=debug_moe loss=ce,linear_ce training.steps=20 --check": RUN,
    "apiary plot runs/debug_moe/A runs/debug_moe/B --out ab.png":
        Run(subs={"runs/debug_moe/A": "{run}", "runs/debug_moe/B": "{run2}"}),
    "apiary launch recipe=qwen3_30b_a3b_64k launcher=slurm nodes=2 gpus_per_node=8 --dry-run":
        RUN,  # no tokenizer folder here: the dry run renders the script and warns (test_recipes_shipped.py)
    "apiary autotune-table /shared/kc --out table.json":
        Skip("reads the kernel cache `apiary warmup` fills on a GPU (tests/test_autotune_table.py: the command "
             "on recorded caches)"),
    # docs/install.md
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]'":
        Skip("creates a virtualenv and installs from the package registry (network)"),
    "bash scripts/deepep_source.sh": Skip("packs DeepEP's source from the fetched git mirrors and downloads build "
                                          "helpers (network); its output is gitignored"),
    "export PYTHONPATH=/tmp/gpu-site:$PWD": Skip("the GPU machines' stack folder"),
    "bash scripts/build_deepep.sh": Skip("builds DeepEP's CUDA extension on a GPU machine (CUDA, NCCL, NVSHMEM)"),
    "PART=build bash benchmarks/deepep_sitting.sh": Skip("the DeepEP GPU sitting: builds DeepEP on the GPU machine"),
    "PART=parity bash benchmarks/deepep_sitting.sh": Skip("needs 2 GPUs and DeepEP (tests/gpu/test_deepep_gpu.py)"),
    "PART=layer bash benchmarks/deepep_sitting.sh": Skip("needs 2 GPUs and DeepEP (moe_layer_bench)"),
    "PART=train COMM=alltoall bash benchmarks/deepep_sitting.sh": Skip("needs 2 H200s (Qwen3.5-35B-A3B at 128K)"),
    "PART=train COMM=deepep bash benchmarks/deepep_sitting.sh": Skip("needs 2 H200s and DeepEP"),
    "PY=.venv/bin/python MAX_JOBS=16 OUT=dist/te bash scripts/build_te.sh":
        Skip("builds TransformerEngine's torch extension (13 minutes on 2 cores; downloads headers)"),
    "pip install dist/te/transformer_engine_torch-2.20.2-*.whl transformer_engine==2.20.2 transformer_engine_cu13==2.20.2":
        Skip("installs the wheel the build writes, and TransformerEngine from the package registry (network)"),
    "python -c \"import transformer_engine.pytorch\"": Skip("needs TransformerEngine (a CUDA build)"),
    # docs/launching.md
    "train recipe=debug_moe": CFG,
    "apiary launch recipe=debug_moe launcher=local nproc=2": DRY,
    "apiary launch recipe=qwen3_30b_a3b_64k launcher=slurm nodes=4 gpus_per_node=8 partition=gpu account=myproj "
    "time=04:00:00 [overrides] [--dry-run] [--wait]":
        Run(drop=("[overrides]", "[--wait]"), subs={"[--dry-run]": "--dry-run"}, setup=(Q3_TOKENIZER,)),
    "torchrun --standalone --nproc_per_node=8 -m framework.cli train recipe=X output_dir=runs/X/mine":
        Skip("needs 8 GPUs on this node"),
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 --rdzv-id=myrun -m "
    "framework.cli train recipe=X output_dir=/shared/runs/X/mine": Skip("needs 2 nodes of 8 GPUs"),
    "apiary launch recipe=X launcher=slurm nodes=4 gpus_per_node=8 partition=gpu account=proj time=04:00:00 "
    "qos=normal training.steps=2000": Run(subs={"recipe=X": "recipe=debug_moe"}, add=("--dry-run",)),
    "apiary warmup recipe=X training.kernel_cache=/shared/kc [the job's overrides]":
        Skip(f"{GPU}: compiles and tunes the recipe's kernels on one device"),
    "apiary launch recipe=X launcher=slurm nodes=4 gpus_per_node=8 training.kernel_cache=/shared/kc":
        Run(subs={"recipe=X": "recipe=debug_moe", "/shared/kc": "{tmp}/kc"}, add=("--dry-run",)),
    "apiary launch recipe=X launcher=slurm nodes=4 gpus_per_node=8 --dry-run > job.sbatch":
        Run(subs={"recipe=X": "recipe=debug_moe"}),
    "apiary cp-template slurm my.sbatch.j2": RUN,
    "apiary launch ... launcher=slurm launcher.template=my.sbatch.j2 --dry-run":
        Run(subs={"...": "recipe=debug_moe"}, before=("apiary cp-template slurm my.sbatch.j2",)),
    ".venv/bin/python -m pytest tests/test_slurm.py -q -x": SUITE,
    # docs/recipes.md
    "apiary plan recipe=qwen35_35b_128k": RUN,
    "train recipe=qwen35_35b_128k --cfg job": RUN,
    "apiary launch recipe=qwen35_35b_128k launcher=slurm nodes=4 gpus_per_node=8 data.tokenizer=PATH --dry-run":
        Run(subs={"PATH": "{tok}"}),
    # docs/architecture.md
    "python benchmarks/walk_count.py": Skip("tests/test_walk_count.py runs it (~30 s) and checks the table's last row"),
    # docs/benchmarks.md
    "python benchmarks/step_time_check.py": Skip("tests/test_step_time_check.py runs it (the planner on CPU against "
                                                  "the measured points, ~40 s)"),
    # docs/testing.md
    "OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/fp32_divergence.py 8 1":
        Skip("a measurement of minutes (8 trials of paired 10-step trainings per setting)"),
    # docs/troubleshooting.md
    "train recipe=debug_moe --cfg job": RUN,
    "apiary plan recipe=qwen35_35b_128k gpus=32 gpu=H200 --search": TOP1,
    "train recipe=debug_moe output_dir=RUN checkpoint.resume=true training.steps=30 lr.total_steps=30":
        Run(subs={"output_dir=RUN": "output_dir={run}"}, add=("--cfg", "job")),
    # docs/tutorial.md
    "apiary show my_model": TUTORIAL,
    "train model.hf_checkpoint=my_model data.path=my_data.jsonl validation.fraction=0.1 validation.interval=5 "
    "training.steps=10 output_dir=runs/mine": TUTORIAL,
    "train model.hf_checkpoint=my_model data.path=my_data.jsonl validation.fraction=0.1 validation.interval=5 "
    "training.steps=15 lr.total_steps=15 output_dir=runs/mine checkpoint.resume=true": TUTORIAL,
    "apiary export runs/mine --hf my_model_trained": TUTORIAL,
    # docs/skills/compare.md
    "apiary compare recipe=debug_moe loss=ce,chunked training.steps=20 --check": RUN,
    "apiary compare recompute=none,full training.steps=10 --check": RUN,
    "apiary compare nproc=1,2 training.global_batch=8 --check": RUN,
    "apiary compare optimizer.lr=1e-3,3e-3 --json > lr.json": RUN,
    # docs/skills/fp8.md
    "train recipe=qwen3_30b_a3b_64k precision=fp8": CFG,
    "train recipe=qwen3_30b_a3b_64k precision=fp8 precision.scaling=rowwise": CFG,
    "train recipe=qwen3_30b_a3b_64k precision=fp8 precision.backend=te precision.experts=false": CFG,
    "apiary compare recipe=qwen3_30b_a3b_64k precision=bf16,fp8 --check":
        Skip("FP8 needs an H100/H200 (compute capability 8.9+); the preflight refuses it on CPU "
             "(tests/test_precision.py::test_compare_fp8_refused_on_cpu)"),
    "apiary plan recipe=qwen3_30b_a3b_64k precision=fp8": RUN,
    # docs/skills/lora.md
    "train recipe=debug_moe adapter=lora": CFG,
    "train recipe=debug_moe adapter=lora adapter.rank=8 adapter.targets=[q,k,v,o,experts] nproc=2": CFG,
    "apiary plan recipe=qwen35_35b_lora_128k": RUN,
    "apiary export RUN --hf OUT": Skip("exports a LoRA run on an HF base (tests/test_lora.py trains one, exports it "
                                       "and loads it with PEFT)"),
    "apiary export RUN --hf OUT --merged": Skip("as above (tests/test_lora.py)"),
    "python -m pytest -q tests/test_lora.py": SUITE,
    "OUT=/some/dir bash benchmarks/lora_bench.sh": Skip(f"{GPU}: LoRA against full training on one H200"),
    # docs/skills/logprobs.md
    "apiary logprobs runs/sft/20261126-1200 rollouts/step_0042.parquet --out scored/":
        Run(subs={"runs/sft/20261126-1200": "{run}", "rollouts/step_0042.parquet": "{rollouts}"}),
    "apiary logprobs Qwen/Qwen3-30B-A3B-local rollouts/ --out scored/ --temperature 0.7":
        Skip("needs a downloaded Qwen3-30B-A3B folder (60 GB) and a GPU to score with it"),
    "train recipe=debug_grpo data.path=scored/ loss.kl_coef=1e-3":
        Run(add=("--cfg", "job"), before=("apiary logprobs runs/sft/20261126-1200 rollouts/step_0042.parquet "
                                          "--out scored/",)),
    "apiary logprobs live/weights/step-7 rollouts/ --out decoupled/ --field old_logprobs":
        Skip("reads a weight version the live loop published (docs/rl.md; tests/test_logprobs_cli.py scores "
             "published weights)"),
    # docs/skills/models.md: `apiary export` of the resumed debug_moe run (checkpoints at steps 8, 10, 12)
    "apiary export runs/debug_moe/20260101-120000 --hf exported": Run(subs={"runs/debug_moe/20260101-120000": "{run}"}),
    "apiary export runs/debug_moe/20260101-120000 --hf exported_fp32 --step 8 --dtype float32":
        Run(subs={"runs/debug_moe/20260101-120000": "{run}"}),
    # docs/skills/planner.md
    "apiary plan recipe=qwen35_35b_128k gpus=32 loss=ce parallel.tp=2 --json": RUN,
    "apiary plan recipe=qwen35_35b_128k gpus=32 parallel.pp=1 --search --top=10": TOP1,
    "apiary plan --constants": RUN,
    "python - <<'EOF'": RUN,  # the heredoc: the table's numbers from Python
    # docs/skills/plot.md
    "apiary plot runs/debug_moe/20260101-120000": Run(subs={"runs/debug_moe/20260101-120000": "{run}"}),
    "apiary plot runs/compare/debug_moe-loss-*/0-ce runs/compare/debug_moe-loss-*/1-chunked":
        Run(subs={"runs/compare/debug_moe-loss-*/0-ce": "{run}", "runs/compare/debug_moe-loss-*/1-chunked": "{run2}"}),
    # docs/skills/preflight.md: the refusal it shows
    "train recipe=qwen35_35b_128k model.n_layers=4 training.seq_len=32768 parallel.cp=1 parallel.ep=1 "
    "parallel.dp_shard=1 loss=ce recompute=full nproc=1 gpu=H200 data.name=packaged data.tokenizer=byte": Run(expect=2),
    # docs/skills/publish.md
    "train recipe=debug_grpo publish.interval=5": CFG,
    "train recipe=qwen35_35b_128k publish.interval=10 publish.dir=/shared/weights publish.keep=2 "
    "publish.background=true": CFG,
    "train recipe=debug_moe training.steps=20 checkpoint.enable=false publish.interval=2 publish.background=false":
        CFG,
    "train recipe=debug_moe training.steps=20 checkpoint.enable=false publish.interval=2 publish.background=true":
        CFG,
    # docs/skills/resume.md: the pair the run_folders fixture runs as written
    "train training.steps=8": RUN,
    "train checkpoint.resume=true training.steps=12 lr.total_steps=12": RUN,
    # docs/skills/rl_objectives.md, routing_replay.md, tis.md, validation.md
    "train recipe=debug_grpo": CFG,
    "train recipe=qwen35_35b_128k loss=grpo loss.kl_coef=0.04 loss.temperature=1.0 data.format=rollouts "
    "data.path=rollouts/step_0042/ model.hf_checkpoint=PATH":
        Skip("needs a Qwen3.5-35B-A3B HF checkpoint folder (a download of 70 GB) and GPUs"),
    "train recipe=debug_grpo loss=dapo loss.eps_high=0.3": CFG,
    "apiary compare recipe=debug_grpo loss=grpo,dapo training.steps=10": RUN,
    "train recipe=debug_grpo data.path=rollouts_with_routing.jsonl moe.routing_replay=true": CFG,
    "train recipe=qwen35_35b_128k loss=grpo data.format=rollouts data.path=rollouts/ moe.routing_replay=true": CFG,
    "train recipe=debug_grpo rl.tis_cap=2": CFG,
    "train recipe=debug_grpo loss=dapo rl.tis_cap=2 rl.mismatch_threshold=0.05": CFG,
    "train recipe=debug_grpo data.path=ROLLOUTS_WITH_GEN rl.tis_cap=2":
        Run(subs={"ROLLOUTS_WITH_GEN": "{rollouts}"}, add=("--cfg", "job")),
    "train validation.fraction=0.05 validation.interval=10 validation.steps=4": CFG,
}
FIXTURE_COMMANDS = ("train training.steps=8", "train checkpoint.resume=true training.steps=12 lr.total_steps=12")


# ------------------------------------------------------------------------ extraction


@dataclass
class DocCommand:
    text: str  # the key: as written, comment dropped, continuations joined, spaces collapsed
    where: str  # file:line
    heredoc: str = ""  # the body of a `<<EOF` heredoc


def _strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a # outside quotes, at a word start)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"" and (i == 0 or line[i - 1].isspace() or line[i - 1] in "=("):  # a quote opens a word
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands() -> list[DocCommand]:
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        fence, lang, pending, start, i = None, "", "", 0, 0
        while i < len(lines):
            line = lines[i]
            i += 1
            m = _FENCE.match(line)
            if m and (fence is None or line.strip().startswith(fence)):
                fence, lang = (m.group(1), m.group(2).lower()) if fence is None else (None, "")
                pending = ""
                continue
            if fence is None:
                continue
            s = line.strip()
            if not pending:
                start = i
                if not s or s.startswith("#"):
                    continue
            s = (pending + " " + s).strip() if pending else s
            if s.endswith("\\"):
                pending = s[:-1].rstrip()
                continue
            pending = ""
            s = " ".join(_strip_comment(s).split())
            if not s or not (lang in ("bash", "sh", "shell", "console") or _PREFIX.match(s)):
                continue
            cmd = DocCommand(s, f"{path.relative_to(ROOT)}:{start}")
            h = _HEREDOC.search(s)
            if h:
                body = []
                while i < len(lines) and lines[i].strip() != h.group(1):
                    body.append(lines[i])
                    i += 1
                i += 1
                cmd.heredoc = "\n".join(body) + "\n"
            out.append(cmd)
    return out


_FOUND = doc_commands()


def _where(text: str) -> list[str]:
    return [c.where for c in _FOUND if c.text == text]


# ------------------------------------------------------------------------ the table against the docs


def test_every_doc_command_is_classified():
    missing = [c for c in _FOUND if c.text not in COMMANDS]
    assert not missing, (
        "commands in the docs that tests/test_doc_commands.py does not classify:\n"
        + "\n".join(f"  {c.where}: {c.text}" for c in missing)
        + "\nAdd each to COMMANDS (keyed by the line above) as RUN (runs on CPU as written), CFG / DRY / Run(...) "
          "(a cheap equivalent; placeholders filled by subs), SUITE (a pytest or ruff command) or Skip('why it "
          "cannot run on CPU'); the module docstring says how.")


def test_no_stale_entries():
    found = {c.text for c in _FOUND}
    stale = [k for k in COMMANDS if k not in found]
    assert not stale, ("COMMANDS entries whose command no longer appears in README.md or docs/ (delete or update "
                       "them in tests/test_doc_commands.py):\n" + "\n".join(f"  {k}" for k in stale))


def test_the_extraction_finds_what_it_should():
    """A guard for the extractor itself: known commands of several shapes are found where they are."""
    texts = {c.text: c for c in _FOUND}
    assert "apiary ls" in texts and texts["apiary ls"].where.startswith("README.md:")
    q3 = "apiary launch recipe=qwen3_30b_a3b_64k launcher=slurm nodes=2 gpus_per_node=8 --dry-run"
    assert q3 in texts  # its trailing comment dropped
    assert any(t.startswith("torchrun --nnodes=2 ") and t.endswith("output_dir=/shared/runs/X/mine") for t in texts)
    assert "from framework.plan import planner" in texts["python - <<'EOF'"].heredoc  # a heredoc's body
    assert not any(t.startswith("train.sbatch") for t in texts)  # a file listing is not a command


@pytest.mark.parametrize("text", [k for k, v in COMMANDS.items() if isinstance(v, Suite)])
def test_suite_commands_name_tests_that_exist(text):
    for tok in shlex.split(text):
        path, _, name = tok.partition("::")
        if path.startswith("tests"):
            assert (ROOT / path).exists(), (text, path)
            if name:
                assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), (text, name)
    argv = shlex.split(text)
    for k, tok in enumerate(argv[:-1]):
        if tok == "-m" and argv[k + 1] != "pytest":  # a marker: declared in pyproject.toml
            assert re.search(rf"['\"]{argv[k + 1]}:", (ROOT / "pyproject.toml").read_text()), argv[k + 1]
    if argv[0] == "ruff":  # the suite runs it (tests/test_lint.py) on what the command names, as configured
        assert argv[1] == "check" and all((ROOT / a).exists() for a in argv[2:] if not a.startswith("-")), text
        lint = (ROOT / "tests" / "test_lint.py").read_text()
        assert '"ruff", "check"' in lint and "str(ROOT)" in lint, "tests/test_lint.py no longer runs ruff check"
        assert "[tool.ruff.lint]" in (ROOT / "pyproject.toml").read_text()
    else:
        assert any(t.startswith("tests") for t in argv) or argv[:3] == ["python", "-m", "pytest"], text


# ------------------------------------------------------------------------ running


@contextlib.contextmanager
def _own_environment():
    """A command as from a fresh shell: no rank variables (an in-process training leaves RANK,
    WORLD_SIZE, ... behind, which would make the next `train` think torchrun started it), and the
    environment restored afterwards."""
    import os

    saved = dict(os.environ)
    for k in _RANK_ENV:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def run_folders(tmp_path_factory):
    """docs/skills/resume.md's pair, run as written in one folder: a finished debug_moe run of 8
    steps resumed to 12 ({run}); {run2} is a copy (commands comparing two runs)."""
    from framework.cli import train_main

    d = tmp_path_factory.mktemp("doc_runs")
    codes = {}
    err = io.StringIO()
    with contextlib.chdir(d), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        for text in FIXTURE_COMMANDS:
            with _own_environment():
                codes[text] = train_main(shlex.split(text)[1:])
    assert all(c == 0 for c in codes.values()), (codes, err.getvalue()[-3000:])
    runs = sorted((d / "runs" / "debug_moe").iterdir())
    assert len(runs) == 1, runs
    run2 = d / "runs" / "debug_moe" / "second"
    shutil.copytree(runs[0], run2)
    return {"run": runs[0], "run2": run2, "codes": codes}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """A loadable HF tokenizer folder (4 ids) standing in for a model's own."""
    d = tmp_path_factory.mktemp("tok")
    _tokenizer(d)
    return d


def _tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<bos>": 1, "<eos>": 2, "a": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def _compare_preflight(argv: list[str]) -> int:
    """`apiary compare`'s own checks (arguments parsed, every variant resolved), nothing trained."""
    from framework.errors import UserError
    from toolkit.compare.args import parse_args
    from toolkit.compare.running import plan

    try:
        plan(parse_args(argv))
    except UserError as e:
        print(f"error {e}")
        return e.exit_code
    return 0


def _execute(text: str, heredoc: str = "") -> tuple[int, str, str]:
    """One command line in this process (train, apiary, a python heredoc); (code, stdout, stderr)."""
    from framework.cli import train_main
    from toolkit.cli import apiary_main

    argv = shlex.split(text)
    redirect = None
    if ">" in argv:
        k = argv.index(">")
        redirect, argv = argv[k + 1], argv[:k] + argv[k + 2:]
    out, err = io.StringIO(), io.StringIO()
    with _own_environment(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "train":
                code = train_main(argv[1:])
            elif argv[:2] == ["apiary", "compare"]:
                code = _compare_preflight(argv[2:])
            elif argv[0] == "apiary":
                code = apiary_main(argv[1:])
            elif argv[:2] == ["python", "-"] and heredoc:
                exec(compile(heredoc, "<heredoc>", "exec"), {"__name__": "__main__"})
                code = 0
            else:
                raise AssertionError(f"no in-process runner for {argv[0]!r}: make it a Skip or add a runner")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if redirect:
        Path(redirect).write_text(out.getvalue())
    return code, out.getvalue(), err.getvalue()


def _command(text: str, entry: Run, values: dict) -> str:
    for old, new in entry.subs.items():
        assert old in text, (old, text)
        text = text.replace(old, new.format(**values))
    argv = [a for a in shlex.split(text) if a not in entry.drop]
    return shlex.join([*argv, *entry.add])


_RUNNABLE = [k for k, v in COMMANDS.items() if isinstance(v, Run) and k not in FIXTURE_COMMANDS]


@pytest.mark.parametrize("text", _RUNNABLE, ids=[re.sub(r"\W+", "_", k)[:60] for k in _RUNNABLE])
def test_doc_command_runs(text, request, workdir, monkeypatch):
    entry = COMMANDS[text]
    values = {"tmp": str(workdir), "rollouts": str(ROOT / "components" / "data" / "tiny_rollouts.jsonl")}
    if any("{run" in v for v in entry.subs.values()) or any("runs/sft" in b for b in entry.before):
        folders = request.getfixturevalue("run_folders")
        values.update(run=str(folders["run"]), run2=str(folders["run2"]))
    if any("{tok}" in v for v in entry.subs.values()):
        values["tok"] = str(request.getfixturevalue("tokenizer_folder"))
    for s in entry.setup:
        kind, _, where = s.partition(":")
        assert kind == "tokenizer", s
        _tokenizer(workdir / where)
    monkeypatch.setenv("COLUMNS", "200")
    for b in entry.before:
        code, out, err = _execute(_command(b, COMMANDS[b], values) if isinstance(COMMANDS.get(b), Run) else b)
        assert code == 0, (b, err[-2000:])
    heredoc = next((c.heredoc for c in _FOUND if c.text == text), "")
    cmd = _command(text, entry, values)
    code, out, err = _execute(cmd, heredoc)
    assert code == entry.expect, (f"{_where(text)}: `{cmd}` exited {code}, the docs say {entry.expect}\n"
                                  f"{err[-3000:]}\n{out[-2000:]}")
    if entry.expect == 2:
        assert "error apiary:" in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.parametrize("text", FIXTURE_COMMANDS)
def test_resume_pages_pair_runs_as_written(text, run_folders):
    assert run_folders["codes"][text] == 0
    steps = [json.loads(line)["step"] for line in (run_folders["run"] / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # 8 steps, then 4 more on the resumed run


# ------------------------------------------------------------------------ docs that point somewhere


def test_every_registry_name_has_a_skill_page_and_apiary_show_names_it(capsys):
    from framework.compose import registry
    from toolkit.cli import apiary_main

    for kind, names in registry.entries().items():
        for name in names:
            page = registry.skill_page(kind, name)
            assert page.is_file(), f"{kind} {name}: no skill page {page} (add `skill: PAGE` in registry.yaml or write it)"
            own = getattr(registry.resolve(kind, name), "SKILL", None)  # the component's own pointer, if any
            if own and not own.endswith(".md"):
                assert page.stem == own, (kind, name, page.stem, own)
    assert apiary_main(["show", "grpo"]) == 0
    assert "skill page: docs/skills/rl_objectives.md" in capsys.readouterr().out
    assert apiary_main(["show", "chunk2"]) == 0
    assert "skill page: docs/skills/moe_chunk.md" in capsys.readouterr().out


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def test_doc_links_and_paths_point_at_files_in_the_repository():
    problems = []
    for path in DOCS:
        text = path.read_text()
        for target in _LINK.findall(text):
            if re.match(r"\w+://", target) or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{path.relative_to(ROOT)}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md":
                heads = {_anchor(m) for m in re.findall(r"^#+\s+(.*)$", dest.read_text(), re.M)}
                if anchor not in heads:
                    problems.append(f"{path.relative_to(ROOT)}: link to {target}: no such heading")
        for ref in set(re.findall(r"(?<![\w/.])(docs/[\w/.-]+\.md)", text)):
            if not (ROOT / ref).is_file():
                problems.append(f"{path.relative_to(ROOT)}: names {ref}, which does not exist")
        for outside in ("../shared", "FACTS.md", "/work/", "shared/tools"):
            if outside in text:
                problems.append(f"{path.relative_to(ROOT)}: cites {outside!r}, outside the repository")
    assert not problems, "\n".join(problems)
