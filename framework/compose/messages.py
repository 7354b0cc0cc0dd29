"""A composition error said in one paragraph: an override's value its key's type cannot hold, and the
first lines of Hydra's and OmegaConf's own messages."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

from framework.errors import UserError

EXPECTED = {"IntegerNode": "an integer", "FloatNode": "a number", "BooleanNode": "true or false",
            "StringNode": "a string", "ListConfig": "a list"}


def wrong_type(e: Exception, overrides: list[str]) -> UserError | None:
    """An override whose value the key's type cannot hold (``training.steps=five``), as one sentence naming
    the key, the value as typed and the type (was: the override twice, then OmegaConf's words); None for
    any other composition error."""
    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    expected = EXPECTED.get(type(getattr(cause, "child_node", None)).__name__)
    typed = [o.partition("=")[2] for o in overrides if o.lstrip("+").partition("=")[0] == key]
    if not (key and expected and typed):
        return None
    now = cause.parent_node.get(cause.key) if isinstance(cause.parent_node, DictConfig) else None
    now = f"[{','.join(map(str, now))}]" if isinstance(now, ListConfig) else str(now).lower() if isinstance(now, bool) else now
    example = f" (for example {key}={now})" if now is not None else ""
    return UserError(key, f"takes {expected}, not {typed[-1]!r}{example}.")


def first_line(e: Exception) -> str:
    msg = str(e).strip()
    if e.__cause__ is not None:
        msg = f"{msg}: {e.__cause__}"
    for prefix in ("Error merging override ", "Error merging "):
        msg = msg.replace(prefix, "")
    lines = [ln.strip() for ln in msg.splitlines()
             if ln.strip() and not ln.strip().startswith(("full_key", "object_type", "reference_type"))]
    keep = len(lines) if any(ln.startswith("Available options") for ln in lines) else 3  # the whole list
    return " ".join(lines[:keep]).rstrip(".")


def list_expected(e: Exception, key: str | None, data: dict) -> str | None:
    """A list key given one value in a recipe file (``targets: q``), in the command line's words: "takes a
    list, not 'q'" (was OmegaConf's "AnyNode is not a ListConfig, list or tuple"); None for anything else."""
    if not key or "is not a ListConfig" not in str(e):
        return None
    node = data
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    leaf = key.rsplit(".", 1)[-1]
    return "takes a list" + (f", not {node!r} (for example {leaf}: [{node}])" if node is not None else "")

