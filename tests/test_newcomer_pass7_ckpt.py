"""Newcomer pass 7, checkpoints: a model-only last step, keep_latest_k, and what a crashed launch records."""

import json
import re
import shlex
import shutil

import pytest

from framework.errors import UserError
from framework.train import integrity

from conftest import ROOT, train_here

SMALL = ["recipe=debug_moe", "training.seq_len=64", "model.n_layers=1"]


@pytest.fixture(scope="module")
def model_only_run(tmp_path_factory):
    """3 steps, a save every step, keep 2, the last save model-only (copied by each test)."""
    root = tmp_path_factory.mktemp("model_only")
    p = train_here(["train", *SMALL, "training.steps=3", "checkpoint.interval=1", "checkpoint.keep_latest_k=2",
                    "checkpoint.model_only_last=true", "output_dir=run"], root)
    assert p.returncode == 0, p.stderr[-3000:]
    return root / "run"


@pytest.fixture
def run(model_only_run, workdir):
    dst = workdir / "run"
    shutil.copytree(model_only_run, dst)
    return dst


def test_keep_latest_k_leaves_exactly_k_complete_steps(model_only_run):
    """keep_latest_k=2 over saves at steps 1, 2, 3 leaves step-2 and step-3 (was: step-1..3, k+1; with more
    steps k+2: torchtitan's purge ran before the newest saves were renamed into place)."""
    ck = model_only_run / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-3"]
    assert integrity.is_model_only(ck / "step-3") and not integrity.is_model_only(ck / "step-2")
    assert json.loads((ck / "step-3" / integrity.MANIFEST).read_text())["model_only"] is True


def test_prune_keeps_the_newest_and_leaves_later_steps(tmp_path):
    """The deletion counts the step just completed and never touches a step above it (an earlier launch's,
    after checkpoint.load_step) nor an incomplete folder."""
    ck = tmp_path / "checkpoint"
    for n in (1, 2, 3, 4, 6):
        (ck / f"step-{n}").mkdir(parents=True)
        (ck / f"step-{n}" / ".metadata").write_bytes(b"train_state")
    (ck / "step-0").mkdir()  # incomplete: no .metadata, no manifest
    assert integrity.prune(ck, 4, 2) == [1, 2]
    assert sorted(p.name for p in ck.iterdir()) == ["step-0", "step-3", "step-4", "step-6"]
    assert integrity.prune(ck, 4, 0) == []


def test_printed_resume_after_a_model_only_last_step_runs(run, capsys):
    """The summary's resume command, run as printed, goes on from the last full step (was: `resume: step-3
    verified`, then `RuntimeError: Missing key in checkpoint state_dict: dataloader.dp_rank_0.`, exit 1)."""
    printed = json.loads((run / "summary.json").read_text())["next"]["resume"]
    argv = shlex.split(printed)
    assert argv[0] == "train" and "checkpoint.load_step" not in printed
    argv = [a if not a.startswith("training.steps=") else "training.steps=4" for a in argv]
    p = train_here([a if not a.startswith("output_dir=") else f"output_dir={run}" for a in argv], run.parent, capsys)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"resume: {run}/checkpoint/step-2 verified" in p.stdout or "checkpoint/step-2 verified" in p.stdout
    assert "holds the model's weights only" in p.stdout and "goes on from step 2" in p.stdout
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    assert not integrity.is_model_only(run / "checkpoint" / "step-3")  # re-saved whole by the resume


def test_load_step_naming_a_model_only_step_is_refused(run):
    with pytest.raises(UserError) as e:
        integrity.check_resume(run, 3, "checkpoint.resume=true")
    msg = str(e.value)
    assert "checkpoint.load_step=3" in msg and "weights only" in msg
    assert "checkpoint.load_step=2" in msg and f"checkpoint.load_path={run / 'checkpoint' / 'step-3'}" in msg
    assert integrity.check_resume(run, None, "checkpoint.resume=true") == 2


def test_a_resume_that_crashes_before_training_is_not_recorded(run, capsys, monkeypatch):
    """A resume whose trainer build fails (here: made to) leaves no config.resume-1.yaml and no launches.jsonl
    line, so the next resume keeps and compares with the last launch that trained (was: the crashed launch's
    overrides were kept by every later resume)."""
    from framework.train import build

    real = build.trainer_config

    def failing(resolved):
        tc = real(resolved)

        class Fails:
            def __getattr__(self, name):
                return getattr(tc, name)

            def build(self):
                raise RuntimeError("the build failed")

        return Fails()

    monkeypatch.setattr(build, "trainer_config", failing)
    before = (run / "launches.jsonl").read_text()
    with pytest.raises(RuntimeError, match="the build failed"):  # in this process: the worker's traceback
        train_here(["train", *SMALL, f"output_dir={run}", "checkpoint.resume=true", "training.steps=4",
                    "checkpoint.interval=1", "checkpoint.keep_latest_k=2", "lr.total_steps=4"], run.parent, capsys)
    assert not (run / "config.resume-1.yaml").exists()
    assert (run / "launches.jsonl").read_text() == before


def _doc_example(page, after: str) -> tuple[list[str], str]:
    """The command (its first lines, `\\` joined) and the output the fenced block after ``after`` shows."""
    text = page.read_text()
    block = text[text.index(after):].split("```", 2)[1].strip("\n").splitlines()
    n = next(i for i, line in enumerate(block) if not line.rstrip().endswith("\\")) + 1
    return shlex.split(" ".join(line.rstrip("\\") for line in block[:n])), "\n".join(block[n:])


def test_preflight_page_example_shows_what_the_command_prints(workdir, capsys):
    """docs/skills/preflight.md's qwen35_35b_128k example, run as written, prints every number the page shows
    (was: 177.8 / 96.3 / 106.2 / 112.3 GiB on the page, 161.2 / 89.5 / 94.9 / 112.4 GiB printed)."""


    from conftest import ROOT

    argv, shown = _doc_example(ROOT / "docs" / "skills" / "preflight.md", "Example (CPU box")
    p = train_here(argv, workdir, capsys)
    assert p.returncode == 2, p.stderr[-3000:]
    got = " ".join(p.stderr.split())
    for part in " ".join(shown.split()).split("..."):  # the page elides with `...`
        assert part.strip() in got, (part.strip(), got)
    numbers = re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", shown)  # GiB and tok/s; not H200's or fp32's digits
    assert len(numbers) == 11 and all(n in got for n in numbers), numbers


_SEGMENT = re.compile(r"^(?P<dims>(?:(?:EP|CP|PP|TP|dp_shard) \d+(?:, )?)+) on (?P<n>\d+) ranks"
                                    r"(?: with `(?P<with>[^`]+)`)?$")


def test_recipes_table_layouts_on_cpu_ranks_are_what_train_derives(workdir):
    """docs/recipes.md's "Shipped recipes" table: every `DIMS on N ranks [with `override`]` in the layout
    column is what `train recipe=R nproc=N [override] --cfg job` derives (was: qwen35_debug_moe's row said
    "CP 2 on 2 ranks"; 2 ranks derive dp_shard 2, EP 2, and CP 2 needs parallel.cp=2)."""
    from framework.resolve.resolver import resolve

    text = (ROOT / "docs" / "recipes.md").read_text().split("## Shipped recipes", 1)[1].split("\n\n", 2)[1]
    checked = []
    for row in text.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        recipe = cells[0].split()[0]
        for seg in cells[3].split(";"):
            m = _SEGMENT.match(seg.strip())
            if m is None:
                continue
            n = int(m.group("n"))
            r = resolve(recipe, [f"launcher.nproc={n}", *([m.group("with")] if m.group("with") else [])],
                        world_size=n, for_training=False)
            want = {d.lower(): int(v) for d, v in re.findall(r"(EP|CP|PP|TP|dp_shard) (\d+)", m.group("dims"))}
            assert {d: r.layout.dims[d] for d in want} == want, (recipe, seg, r.layout.dims)
            checked.append((recipe, seg.strip()))
    assert ("qwen35_debug_moe", "CP 2, EP 2 on 2 ranks with `parallel.cp=2`") in checked, checked
    assert ("debug_moe", "EP 2 on 2 ranks") in checked, checked


def test_two_rank_context_parallel_run_prints_no_torch_notes(tmp_path):
    """`train recipe=qwen35_debug_moe nproc=2 parallel.cp=2` prints no torch notes (was: per rank, torch's
    `_redistribute.py:394] While redistributing from (_StridedShard...` from torchtitan's init and a FutureWarning
    `torch.distributed.all_gather_into_tensor is deprecated` from the CP gathers of gated_deltanet.py and
    qwen3_5_model.py)."""
    from conftest import run_cli

    p = run_cli(["train", "recipe=qwen35_debug_moe", "nproc=2", "parallel.cp=2", "training.steps=1",
                 "training.local_batch=1", "checkpoint.enable=false", "logging.tensorboard=false", "output_dir=run"],
                cwd=tmp_path, timeout=400, env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    console = p.stdout + p.stderr
    assert "step     1/1" in console, console[-2000:]
    for noise in ("While redistributing", "_redistribute.py", "FutureWarning", "all_gather_into_tensor"):
        assert noise not in console, console[-3000:]


def test_cp_gather_emits_no_future_warning():
    """The CP all-gather (gated_deltanet.all_gather, forward and backward) on a one-rank gloo group: no warning,
    the gathered values and the summed gradient as before."""
    import warnings

    import torch
    import torch.distributed as dist

    from components.models.gated_deltanet import all_gather

    from conftest import free_port

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.arange(6.0).reshape(2, 3).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = all_gather(x, dist.group.WORLD)
            out.sum().backward()
        assert out.shape == (1, 2, 3) and torch.equal(out[0], x.detach()) and torch.equal(x.grad, torch.ones(2, 3))
    finally:
        if owned:
            dist.destroy_process_group()


def test_model_only_last_is_documented_in_help_and_docs(workdir, capsys):
    """`train --help` says what checkpoint.model_only_last does, and the checkpoint keys' table has its row
    (was: the key listed bare, no page naming it)."""
    p = train_here(["train", "--help"], workdir, capsys)
    assert p.returncode == 0
    line = next(x for x in p.stdout.splitlines() if "checkpoint.model_only_last" in x)
    assert "weights only" in line and "resume" in line, line
    page = (ROOT / "docs" / "skills" / "checkpoint_integrity.md").read_text()
    assert "| `checkpoint.model_only_last` | `false` |" in page and "| `checkpoint.keep_latest_k` | `3` |" in page
