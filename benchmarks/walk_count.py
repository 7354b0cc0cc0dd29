"""How often the walk of `train`'s spine returns to a file already left (docs/architecture.md, "How
often the walk returns to a file already left"), counted, not estimated.

    python benchmarks/walk_count.py [--steps] [--json FILE] [-- TRAIN ARGS ...]

Runs ``train recipe=debug_moe training.steps=1 launcher=local`` (one rank; other arguments after
``--``) in this process, from ``framework/cli.py`` ``train_entry`` until ``ApiaryTrainer.__init__``
is entered, under ``sys.setprofile``. A reader reads the spine's functions (``SPINE``) and follows
each call they make into another file one level: it reads the callee and comes back to the spine
function. Calls the callees make are not followed, nor imports (a module's top level), nor a spine
function's calls to a function of its own file (nor what that one calls); entering a
spine function, wherever it is called from, the reader descends into it, and comes back to where it
was when it returns. Calls through the standard library's wrappers (``contextlib``'s ``with``, a
dataclass's generated ``__init__``: the class's file) count as calls into the file a reader would
open; comprehensions and lambdas are read as part of the function that holds them, and so is what a builtin
calls on its own (``print``'s ``write`` and ``flush`` of ``sys.stdout``, a stream wrapper of the repository's:
the line names no such call).

The files of ``framework/`` the reader is in, in order, with a file read twice in a row counted once,
are the visits; a return is a visit to a file visited before. The same per phase package
(``framework/<package>/``, each top-level module its own). ``--steps`` prints the walk itself.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (file, qualified name) of the functions the reader reads whole
SPINE = {
    ("framework/cli.py", "train_entry"),
    ("framework/cli.py", "train_main"),
    ("framework/launch/start.py", "launch"),
    ("framework/compose/hydra_cli.py", "parse"),
    ("framework/resolve/resolver.py", "resolve"),
    ("framework/compose/recipes.py", "load"),
    ("components/launchers/local.py", "LocalLauncher.launch"),
    ("framework/train/run.py", "train_here"),
    ("framework/train/run.py", "train"),
    ("framework/train/build.py", "trainer_config"),
}
END = ("framework/train/trainer.py", "ApiaryTrainer.__init__")  # the walk ends where it is entered
INLINE = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>"}  # read with their function
IMPLICIT = ("write", "flush")  # what print calls on sys.stdout; read with the line that prints (Reader.implicit)
WRAPPERS = ("contextlib.py", "functools.py")  # standard-library frames a call passes through to the repository's
DEFAULT_ARGS = ["recipe=debug_moe", "training.steps=1", "launcher=local"]


class WalkDone(Exception):
    """Raised from the profiler where ``END`` is entered: the run goes no further."""


def rel(path: str) -> str | None:
    """The path of a file of the repository, relative to it (None: not the repository's)."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None


def phase(path: str) -> str:
    """A file's phase package: ``framework/<package>``, or the top-level module itself."""
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


class Reader:
    def __init__(self):
        self.stack: list = []  # (frame, file) the reader is in: spine functions and the callees it followed
        self.walk: list[tuple[str, str]] = []  # (file, what) in reading order
        self._files: dict = {}

    def file_of(self, frame) -> str | None:
        code = frame.f_code
        if code.co_filename == "<string>" and code.co_name == "__init__":  # a dataclass's generated __init__
            cls = type(frame.f_locals.get("self"))
            mod = sys.modules.get(cls.__module__)
            return rel(getattr(mod, "__file__", "") or "") if mod is not None else None
        if code.co_filename not in self._files:
            self._files[code.co_filename] = rel(code.co_filename)
        return self._files[code.co_filename]

    def caller(self, frame):
        """The frame a reader would say made this call: past comprehensions, lambdas and wrappers."""
        f = frame.f_back
        while f is not None and (f.f_code.co_name in INLINE or f.f_code.co_filename.endswith(WRAPPERS)):
            f = f.f_back
        return f

    @staticmethod
    def implicit(frame) -> bool:
        """A stream's ``write``/``flush`` that a builtin (``print``) calls for the spine: the line the reader
        reads names no such call, so there is nothing to follow."""
        if frame.f_code.co_name not in IMPLICIT:
            return False
        caller = frame.f_back
        line = linecache.getline(caller.f_code.co_filename, caller.f_lineno) if caller is not None else ""
        return f".{frame.f_code.co_name}(" not in line

    def profile(self, frame, event, _arg):
        if event == "return":
            if self.stack and self.stack[-1][0] is frame:
                self.stack.pop()
                if self.stack:
                    self.walk.append((self.stack[-1][1], "back"))
            return
        if event != "call" or frame.f_code.co_name == "<module>" or frame.f_code.co_name in INLINE:
            return
        path = self.file_of(frame)
        if path is None:
            return
        name = frame.f_code.co_qualname
        if (path, name) == END:
            sys.setprofile(None)
            self.walk.append((path, name))
            raise WalkDone
        if (path, name) in SPINE:
            self.stack.append((frame, path))
            self.walk.append((path, f"{name} (spine)"))
        elif self.stack and self.caller(frame) is self.stack[-1][0] and path != self.stack[-1][1] \
                and (self.stack[-1][1], self.stack[-1][0].f_code.co_qualname) in SPINE \
                and not self.implicit(frame):  # one level from the spine
            self.stack.append((frame, path))
            if frame.f_code.co_filename == "<string>":  # a dataclass's generated __init__
                name = f"{type(frame.f_locals.get('self')).__qualname__}.__init__"
            self.walk.append((path, name))


def collapse(items: list[str]) -> list[str]:
    return [x for i, x in enumerate(items) if i == 0 or x != items[i - 1]]


def returns(visits: list[str]) -> int:
    seen, n = set(), 0
    for v in visits:
        n += v in seen
        seen.add(v)
    return n


def count(walk: list[tuple[str, str]]) -> dict:
    files = collapse([f for f, _ in walk if f.startswith("framework/")])
    phases = collapse([phase(f) for f in files])
    again = Counter(f for i, f in enumerate(files) if f in files[:i])
    return {"visits": len(files), "returns": returns(files), "phase_visits": len(phases),
            "phase_returns": returns(phases), "returns_by_file": dict(again.most_common()),
            "returns_by_phase": dict(Counter(p for i, p in enumerate(phases) if p in phases[:i]).most_common())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", action="store_true", help="print the walk, file by file")
    ap.add_argument("--json", help="write the counts to this file")
    ap.add_argument("train_args", nargs="*", help=f"train's arguments (default: {' '.join(DEFAULT_ARGS)})")
    args = ap.parse_args()
    from framework import cli  # reason: imported before the walk starts (imports are not counted)

    out = tempfile.mkdtemp(prefix="walk_count-")
    train_args = (args.train_args or DEFAULT_ARGS) + [f"output_dir={out}/run"]
    reader = Reader()
    sys.argv = ["train", *train_args]
    cwd = os.getcwd()
    os.chdir(out)
    sys.setprofile(reader.profile)
    try:
        cli.train_entry()
    except WalkDone:
        pass
    except SystemExit as e:
        sys.setprofile(None)
        print(f"train exited ({e.code}) before ApiaryTrainer.__init__", file=sys.stderr)
        return 1
    finally:
        sys.setprofile(None)
        os.chdir(cwd)
    c = count(reader.walk)
    console = Console(highlight=False)
    if args.steps:
        for path, what in reader.walk:
            console.print(f"{path:45s} {what}", markup=False)
    table = Table(title=f"train {' '.join(train_args[:-1])}: the walk to ApiaryTrainer.__init__")
    for col in ("visits", "returns to a file already left", "phase visits", "returns to a phase package already left"):
        table.add_column(col, justify="right")
    table.add_row(str(c["visits"]), str(c["returns"]), str(c["phase_visits"]), str(c["phase_returns"]))
    console.print(table)
    by = Table(title="returns by file")
    by.add_column("file")
    by.add_column("returns", justify="right")
    for f, n in c["returns_by_file"].items():
        by.add_row(f, str(n))
    console.print(by)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": train_args[:-1], **c}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
