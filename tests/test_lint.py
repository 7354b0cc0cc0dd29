"""ruff (configured in pyproject.toml: pycodestyle, pyflakes, import order) is clean on the whole
repository, so README's test command (and CI) fails on an unused import, an undefined name or a
misordered import block."""

import subprocess
import sys

from conftest import ROOT


def test_ruff_check_is_clean():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
