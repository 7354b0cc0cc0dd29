"""What the eighth newcomer pass reported about the docs (a user on CPU), each pinned here."""

from __future__ import annotations

import re


def _help_keys() -> list[tuple[str, str]]:
    from framework.compose.hydra_cli import help_text

    # `  key: type = default  doc` (the groups' option lines too): two spaces or more before the doc
    return [(m.group(1), m.group(2)) for m in re.finditer(r"(?m)^ +([a-z_][a-z_0-9.]*): (\S.*)$", help_text())]


def test_train_help_documents_every_key():
    """#1: README says `train --help` shows every key with its type, default and doc; 31 keys had no doc
    (their comment sat on the line above the field, which was not read: publish.when_busy,
    moe.lean_combine, model.flex_autotune) or none at all (training.deterministic, model.hf_checkpoint).
    Now the comment block above a field is its doc too, every schema key has one, and a `one_of` str
    key shows its choices as its type. A key added without a doc fails here."""
    keys = _help_keys()
    assert len(keys) > 80, keys
    undocumented = [f"{k}: {rest}" for k, rest in keys if not re.search(r"\S {2,}\S", rest)]
    assert not undocumented, "keys with no doc in `train --help`:\n" + "\n".join(undocumented)
    rows = dict(keys)
    assert rows["publish.when_busy"].startswith("wait|skip = 'wait'  ") and "deferred (skip)" in rows["publish.when_busy"]
    assert rows["optimizer.name"].startswith("Adam|AdamW = 'AdamW'  ")
    assert "fp32 copies" in rows["moe.lean_combine"] and "max-autotune" in rows["model.flex_autotune"]
    # a comment above and one on the field's line: both, in order
    assert re.search(r"load balancers.*: headtail \(balanced", rows["parallel.cp_load_balancer"])
