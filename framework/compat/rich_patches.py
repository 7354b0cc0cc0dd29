"""The patch of rich's console (rich 15.0.0; pyproject.toml asks for rich >= 13)."""

from __future__ import annotations

from framework.compat.originals import _keep_original


def route_broken_pipe(handler) -> None:
    """rich 15.0.0. ``rich.console.Console.on_broken_pipe(self)`` is rich's hook for a closed output pipe
    (its default exits 1); set it on the class to ``handler`` (framework.launch.pipes.on_broken_pipe), so
    that every console of the process, made in many modules, ends a command quietly with 141 when its
    reader leaves (`train | head`)."""
    from rich.console import Console  # reason: keeps `import framework.compat` free of rich's console

    if Console.on_broken_pipe is not handler:
        _keep_original("rich.console:Console.on_broken_pipe", Console.on_broken_pipe)
        Console.on_broken_pipe = handler
