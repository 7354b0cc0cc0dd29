"""`apiary compare`: run a primitive against its baseline from one seed checkpoint and show the two
side by side (the full description: toolkit.compare.args.USAGE, printed by `apiary compare --help`).

Seams: args (the command line), tolerance (what two runs may differ by), running (the plan and the
variants' subprocesses), diffs (differences and --check), report (tables, compare.md and compare.png).
"""

from __future__ import annotations

import json
import sys

from rich.text import Text

from framework.errors import UserError
from toolkit.compare.args import USAGE, HelpShown, Options, add_arguments, parse_args, parser
from toolkit.compare.diffs import check, differences
from toolkit.compare.report import markdown, plot, print_report
from toolkit.compare.running import SHAPE_KEYS, Plan, SeedFailed, Variant, err_console, out_console, plan, run_plan
from toolkit.compare.tolerance import KEY_KINDS, RESHARDED_NORM, TOL_CHOICES, TOLERANCES, Tolerance, classify

__all__ = ["KEY_KINDS", "RESHARDED_NORM", "SHAPE_KEYS", "TOLERANCES", "TOL_CHOICES", "USAGE", "Options", "Plan",
           "Tolerance", "Variant", "add_arguments", "check", "classify", "compare_main", "differences", "markdown",
           "parse_args", "parser", "plan", "plot", "print_report", "run_plan"]


def compare_main(argv: list[str] | None = None, ns=None) -> int:
    """`apiary compare ARGV`; ns: the namespace when `apiary`'s parser has already parsed argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        o = parse_args(argv, ns)
        p = plan(o)
    except HelpShown as h:  # argparse printed the help
        return int(h.args[0]) if h.args else 0
    except UserError as e:
        err_console.print("[bold red]error[/bold red]", Text(str(e)), soft_wrap=True)
        return e.exit_code
    try:
        result = run_plan(p)
    except SeedFailed as e:
        err_console.print("[bold red]error[/bold red]", Text(f"apiary compare: {e}"), soft_wrap=True)
        return 1
    try:
        plot(result, p.compare_dir / "compare.png")
        result["plot"] = "compare.png"
    except Exception as e:  # the runs took minutes: a failed picture still leaves compare.json and compare.md
        result["plot"] = None
        err_console.print("[yellow]compare[/yellow]:", Text(f"compare.png not written: {type(e).__name__}: {e}"))
    (p.compare_dir / "compare.json").write_text(json.dumps(result, indent=2, default=str))
    (p.compare_dir / "compare.md").write_text(markdown(result))
    if o.json:
        print(json.dumps(result, indent=2, default=str))
        print_report(result, err_console)
    else:
        print_report(result, out_console)
    return 1 if (o.check and result["check"]["failures"]) else 0

