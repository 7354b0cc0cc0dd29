"""Text data for pretraining-style runs: the packaged corpus, local jsonl/parquet/txt, or HF names.

Documents are tokenized and packed into ``seq_len`` windows by torchtitan's
``HuggingFaceTextDataset`` (per-document positions, so attention stays inside a
document; its state is checkpointed, so a resumed run sees the same next batch).
apiary only registers where the text comes from.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
from datasets import load_dataset
from torch import distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets import DatasetConfig, text_datasets

from components.data.local_text import (  # noqa: F401
    LOCAL_FORMATS,
    PACKAGED_CORPUS,
    has_bom,
    held_out_count,
    local_data_files,
    source_kind,
)


def _text_of(sample: dict) -> str:
    return sample["text"]


@contextlib.contextmanager
def _no_progress_bars():
    """datasets' progress bars ("Generating train split", ...) off while apiary loads a local source in
    the run (the run's own lines say what it reads), then as they were; a user's
    HF_DATASETS_DISABLE_PROGRESS_BARS wins."""
    if "HF_DATASETS_DISABLE_PROGRESS_BARS" in os.environ or datasets.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def _load_local(path: str) -> "object":
    files = local_data_files(path)
    kinds = {LOCAL_FORMATS[Path(f).suffix] for f in files}
    if len(kinds) != 1:
        raise ValueError(f"{path}: expected files of one format among {sorted(LOCAL_FORMATS)}")
    kind = kinds.pop()
    # a file that starts with a UTF-8 byte-order mark: read as utf-8-sig, so the mark is dropped (the
    # pre-launch check reads it the same way); other files keep the loader's plain utf-8 fast path
    extra = {"encoding": "utf-8-sig"} if kind in ("json", "text") and any(map(has_bom, files)) else {}
    with _no_progress_bars():
        return load_dataset(kind, data_files=files, split="train", **extra)


def _load_part(path: str, part: str, fraction: float) -> "object":
    """A local source's documents before (``train``) or from (``validation``) its held-out last ones."""
    ds = _load_local(path)
    n = len(ds)
    k = held_out_count(n, fraction)
    return ds.select(range(n - k)) if part == "train" else ds.select(range(n - k, n))


def register(name: str, path: str | None, part: str = "all", fraction: float = 0.0) -> str:
    """Register a dataset under ``name`` with torchtitan's text loader; return the name to use.
    ``part`` = train | validation: a local source split in two by ``fraction`` (its last documents are
    the validation set, never trained on)."""
    kind = source_kind(name, path)
    if kind == "packaged":
        key, loc, loader = "apiary_packaged", str(PACKAGED_CORPUS), _load_local
    elif kind == "local":
        key, loc, loader = f"apiary_local_{abs(hash(os.path.abspath(path)))}", path, _load_local
    else:  # a HuggingFace hub dataset name, streamed
        key, loc = f"apiary_hf_{name.replace('/', '_')}", name
        loader = partial(load_dataset, split="train", streaming=True)
    if part != "all":
        if kind == "hub":
            raise ValueError("a held-out split needs a local source")  # refused before launch (formats.py)
        key, loader = f"{key}_{part}_{fraction}", partial(_load_part, part=part, fraction=fraction)
    text_datasets.DATASETS[key] = DatasetConfig(path=loc, loader=loader, sample_processor=_text_of)
    return key


class _NotReloopLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "is being re-looped" not in str(record.msg)


class Passes(text_datasets.HuggingFaceTextDataset):
    """torchtitan's packed text dataset, whose every pass over a small dataset logged a warning
    ("Dataset apiary_local_... is being re-looped (epoch N)", the tutorial printed several): that
    line is dropped around its call only; the first pass of a launch is said once, by rank 0, and
    each step's record carries the pass (``data/epoch``, 0 for the first), which the summary counts."""

    _said = False
    passes_done = 0  # the re-reads so far (torchtitan's epoch: kept in the dataset's state, so a resume goes on counting)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.passes_done = int(state_dict.get("epoch", 0))

    def reloop(self) -> None:
        quiet = _NotReloopLines()
        root = logging.getLogger()  # torchtitan's logger
        root.addFilter(quiet)
        try:
            super().reloop()
        finally:
            root.removeFilter(quiet)
        self.passes_done += 1
        if not self._said and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"apiary: the training data ran out; training goes over it again, reshuffled (pass "
                  f"{self.passes_done + 1}); later passes are not announced: the summary counts them", flush=True)
        self._said = True

    def step_metrics(self, step: int) -> dict[str, float]:
        return {"data/epoch": self.passes_done}


class RankBlocks(IterableDataset, Stateful):
    """Every rank packs the same document stream; packed windows go to ranks in blocks of
    ``local_batch``. A global step therefore sees the same sequences for any data-parallel
    size (1 rank with gradient accumulation == N ranks), which makes runs comparable
    across world sizes. Costs each rank a pass over the whole text stream.
    """

    def __init__(self, inner: "text_datasets.HuggingFaceTextDataset", dp_rank: int, dp_world_size: int,
                 block: int):
        self.inner, self.rank, self.world, self.block = inner, dp_rank, dp_world_size, block
        self._window = 0  # packed windows seen by this rank, its own and others'

    def __iter__(self):
        for sample in self.inner:
            mine = (self._window // self.block) % self.world == self.rank
            self._window += 1
            if mine:
                yield sample

    def step_metrics(self, step: int) -> dict[str, float]:
        return self.inner.step_metrics(step)

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "window": self._window}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        self._window = state["window"]


class PackedTextDataLoader(ParallelAwareDataloader):
    """Packed causal-LM windows from a registered text source (see ``register``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "apiary_packaged"
        infinite: bool = True
        sharding: str = "blocks"  # blocks: identical global batches for any DP size | documents

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        by_docs = config.sharding == "documents"
        ds = Passes(
            dataset_name=config.dataset, dataset_path=config.dataset_path, tokenizer=tokenizer,
            seq_len=seq_len, dp_rank=dp_rank if by_docs else 0, dp_world_size=dp_world_size if by_docs else 1,
            infinite=config.infinite,
        )
        if not by_docs:
            ds = RankBlocks(ds, dp_rank, dp_world_size, local_batch_size)
        super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size, num_workers=config.num_workers,
                         batch_size=local_batch_size, snapshot_every_n_steps=snapshot_every_n_steps)
