"""benchmarks/walk_count.py counts the walk of `train`'s spine (docs/architecture.md, "How often the walk
returns to a file already left"); the table's last row says what it counts for the code as it is, and the
walk returns to a file already left at most RETURNS_AT_MOST times (issue 47 asked for at most 15)."""

import json
import os
import re
import subprocess
import sys

from conftest import ROOT

RETURNS_AT_MOST = 11  # 10 when each spine function became a short sequence of steps; + the hydra.* keys' check


def test_the_documented_walk_count_is_the_measured_one(tmp_path):
    out = tmp_path / "walk.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "walk_count.py"), "--json", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    c = json.loads(out.read_text())
    section = (ROOT / "docs" / "architecture.md").read_text().split("### How often the walk returns")[1]
    table = section.split("\n| layout")[1].split("\n\n")[0]  # the section's first table
    rows = [r for r in table.splitlines() if re.match(r"\| [^-]", r)]
    cells = [x.strip() for x in rows[-1].strip("|").split("|")]
    assert [int(cells[1]), int(cells[2]), int(cells[3])] == [c["visits"], c["returns"], c["phase_returns"]], \
        f"the table's last row {rows[-1]} against the count {c}"
    assert c["returns"] <= RETURNS_AT_MOST, \
        f"the walk returns {c['returns']} times (at most {RETURNS_AT_MOST}): {c['returns_by_file']}"
