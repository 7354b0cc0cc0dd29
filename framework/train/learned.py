"""What a run learned about itself while training (contracts.LEARNED_FILE in the run folder): one entry
per component kind, written atomically; a resume's plan reads it back (framework/plan/preflight.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from framework import contracts


def record(run_dir: str | Path, kind: str, learned: dict) -> None:
    """Set ``kind``'s entry of the run folder's learned file to ``learned`` (the others kept)."""
    path = Path(run_dir) / contracts.LEARNED_FILE
    entries = json.loads(path.read_text()) if path.is_file() else {}
    entries[kind] = learned
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    os.replace(tmp, path)
