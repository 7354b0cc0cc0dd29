"""`apiary`'s subcommands on one argparse parser: each tool adds its flags with `add_arguments`;
its `k=v` overrides are positional and may sit between the flags. Parse errors are UserErrors
(one paragraph, exit code 2) rather than argparse's usage dump.
"""

from __future__ import annotations

import argparse

from framework.errors import UserError


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, flags_hint: str = "", **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.flags_hint = flags_hint

    def error(self, message: str):
        raise UserError(self.prog, f"{message}.", f"See `{self.prog} --help`.")


def overrides_arg(p: argparse.ArgumentParser, help: str = "recipe=NAME and key=value overrides (Hydra's grammar)"):
    p.add_argument("overrides", nargs="*", metavar="k=v", help=help)


def finish(ns: argparse.Namespace, extra: list[str], prog: str, flags_hint: str,
           where: str | None = None) -> argparse.Namespace:
    """Positional words argparse left over join the overrides in order; a leftover flag is refused."""
    flags = [a for a in extra if a.startswith("-")]
    if flags:
        raise UserError(where.format(flag=flags[0]) if where else f"{prog} {flags[0]}", "unknown flag.",
                        flags_hint or f"See `{prog} --help`.")
    ns.overrides = [*getattr(ns, "overrides", []), *extra]
    return ns


def parse(p: Parser, argv: list[str], where: str | None = None) -> argparse.Namespace:
    ns, extra = p.parse_known_args(argv)
    return finish(ns, extra, p.prog, p.flags_hint, where)


def run(p: Parser, argv: list[str], where: str | None = None):
    """parse(), with --help as a return value: (namespace or None, exit code for help)."""
    try:
        return parse(p, argv, where), None
    except SystemExit as e:  # --help (argparse prints it and exits 0)
        return None, int(e.code or 0)
