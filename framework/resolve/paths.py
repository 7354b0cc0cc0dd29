"""The path keys of a run's config, stored absolute.

A path given relative (``model.hf_checkpoint=my_model``, ``data.path=my_data.jsonl``) is relative to
the folder ``train`` ran in. The run's stored config (config.yaml, config.resume-N.yaml and the
ranks' resolved.yaml) keeps each one resolved against that folder, so that ``apiary export`` and
``apiary logprobs`` read the same files from any folder (framework/resolve/resolver.py calls ``absolute``
once every check has read the paths as given, so its messages and the run's first lines name them
as the user wrote them). A Slurm job resolves its recipe again in the folder it was submitted from
(``#SBATCH --chdir``), so on a cluster's shared filesystem its paths are the submitting machine's.

Not resolved: ``output_dir`` (the run folder, named by the commands that take it), ``registry`` (a
recipe's is relative to that recipe's file, framework/compose/recipes.py), a value that is a name rather than
a path (``data.tokenizer=byte``) and a URL (``scheme://...``)."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

# the config keys that name a file or folder on this machine
KEYS = ("model.hf_checkpoint", "data.path", "data.tokenizer", "validation.path", "publish.dir",
        "checkpoint.load_path", "training.kernel_cache")
# the values of a key that are names, not paths (data.tokenizer: the schema's default tokenizer)
NAMES = {"data.tokenizer": ("byte",)}


def absolute(key: str, value):
    """``value`` of ``key`` as an absolute, normalised path (``~`` expanded, symlinks kept); a name, a
    URL, None or an empty value unchanged."""
    if value is None or key not in KEYS:
        return value
    text = str(value)
    if not text.strip() or text in NAMES.get(key, ()) or "://" in text:
        return value
    return os.path.abspath(os.path.expanduser(text))


def absolute_in(cfg) -> None:
    """Every path key of the OmegaConf ``cfg`` made absolute in place."""
    for key in KEYS:
        value = OmegaConf.select(cfg, key)
        new = absolute(key, value)
        if new != value:
            OmegaConf.update(cfg, key, new)


def absolute_leaves(leaves: dict) -> dict:
    """A flat {dotted key: value} with its path keys made absolute (a config stored before paths were:
    relative to this folder, as it was read then)."""
    return {k: absolute(k, v) for k, v in leaves.items()}


def shown(value) -> str:
    """A stored path as the console shows it: relative to this folder when under it, else absolute."""
    text = str(value)
    if not os.path.isabs(text):
        return text
    rel = os.path.relpath(text)
    return rel if not rel.startswith("..") else text
