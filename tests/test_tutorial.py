"""docs/tutorial.md runs as written: every ```python and ```bash block, in order, in an empty folder
(an HF model and local data -> train with validation -> extend -> export -> transformers' logits)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, _child_env

TUTORIAL = ROOT / "docs" / "tutorial.md"


def blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(python|bash)\n(.*?)```", text, re.S)]


def test_the_tutorial_runs_as_written(tmp_path):
    found = blocks(TUTORIAL.read_text())
    assert [k for k, _ in found] == ["python", "bash", "bash", "bash", "bash", "python"], found
    env = _child_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    outputs = []
    for i, (kind, code) in enumerate(found):
        cmd = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"block {i} ({kind}) failed:\n{code}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        outputs.append(p.stdout)
    train, extend = outputs[2], outputs[3]
    assert "validation: the last 20 of 200 documents" in train
    assert "re-looped" not in train + extend and (train + extend).count("the training data ran out") <= 2
    assert "resume: runs/mine/checkpoint/step-10 verified" in extend and "training.steps 10 -> 15" in extend
    assert (tmp_path / "runs/mine/config.resume-1.yaml").is_file()
    assert "max |transformers - apiary| logit difference" in outputs[5]
