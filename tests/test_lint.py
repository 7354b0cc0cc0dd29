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


MAX_LINES = 400  # a file longer than this holds more than one reason to change: split it by reason


def test_no_source_file_is_longer_than_the_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for top in ("framework", "components", "toolkit")
            for p in sorted((ROOT / top).rglob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split by reason (at most {MAX_LINES} lines a file):\n" + "\n".join(long)
