"""The ``data`` kind: what a run trains on, chosen by ``data.format`` (registry.yaml: text, rollouts).

``check`` refuses bad data settings and unreadable inputs before any worker starts and adds the
run's first line (what it trains on) to ``ctx.summary``; ``apply`` sets torchtitan's dataloader and
tokenizer and the batch keys the trainer hands to the loss (``BATCH_KEYS`` per token, sharded
like the tokens under context parallelism; ``STEP_KEYS`` per sample).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from components.data.local_text import (
    HUB_FREE_NAMES,
    PACKAGED_CORPUS,
    document_tokens,
    held_out_count,
    inspect_local,
    local_data_files,
    source_kind,
)
from framework.contracts import PlanFacts, PlanTerms
from framework.errors import UserError, did_you_mean

SHARDINGS = ("blocks", "documents")


@dataclass(kw_only=True)
class DataOptions:
    """The recipe's ``data:`` section as the ``data`` kind reads it. Its keys, their types, defaults
    and docs are framework/compose/schema.py's DataConfig, their one definition: ``contracts.make_options``
    builds this class over it (format, name, path, tokenizer, num_workers, sharding, follow,
    wait_timeout)."""


def _check_common(o: DataOptions, ctx) -> None:
    lag = ctx.cfg.rl.max_lag
    if lag is not None and not o.follow:
        raise UserError(f"rl.max_lag={lag}", "drops records by their policy_version against the trainer's version, "
                        "which only a followed rollout stream has (data.format=rollouts data.follow=true); without "
                        "it the setting would be silently ignored.",
                        "Add data.follow=true (a folder a generator writes shards into), or drop rl.max_lag.")
    if o.sharding not in SHARDINGS:
        raise UserError(f"data.sharding={o.sharding}", f"unknown; valid: {', '.join(SHARDINGS)}.",
                        did_you_mean(str(o.sharding), SHARDINGS))
    if o.num_workers < 0:
        raise UserError(f"data.num_workers={o.num_workers}", "must be >= 0 (loader processes per rank: 0 loads in "
                        "the training process, 1 in one background process).", "Set data.num_workers=0 or 1.")
    if o.num_workers not in (0, 1):
        raise UserError(f"data.num_workers={o.num_workers}", "each rank's loader is one ordered stream "
                        "(text windows or rollout rows dealt in blocks); with more than one worker process "
                        "every worker would produce the same batches and the run would train on repeats.",
                        "Set data.num_workers=1 to load in one background process, or 0 to load in the "
                        "training process.")


HUB_TIMEOUT_S = 5.0  # the hub reachability check before launch (a worker's loader retried for 30 s, then failed)


def _check_hub_reachable(name: str) -> None:
    """A hub dataset is streamed (never cached): with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or the
    hub's host not reachable within HUB_TIMEOUT_S, say so now, not after each rank's loader retried
    for 30 s and ended in a ``[rank0] ConnectionError`` traceback."""
    fix = ("Train on local files instead (data.name=local data.path=PATH, e.g. the dataset downloaded where "
           "there is a network), or data.name=packaged for the packaged corpus.")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise UserError(f"data.name={name}", f"is a HuggingFace hub dataset, streamed from the hub, and {var}="
                            f"{os.environ[var]} forbids reaching it.", fix)
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), None)
    url = urlparse(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    if proxy:
        endpoint = f"{endpoint} through the proxy {proxy}"
    try:
        socket.create_connection((host, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as e:
        raise UserError(f"data.name={name}", f"is a HuggingFace hub dataset, streamed from {endpoint}, which this "
                        f"machine cannot reach ({host}:{port}: {e.strerror or e or 'timed out'}).",
                        "Check the network (or HF_ENDPOINT, a proxy); or " + fix[0].lower() + fix[1:]) from None


def _tokenizer(o: DataOptions, tc, ctx) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer  # reason: torchtitan after devices.install

    from components.data.tokenizer import ByteTokenizer  # reason: imports torchtitan

    if o.tokenizer == "byte":
        tc.tokenizer, tc.hf_assets_path = ByteTokenizer.Config(), str(ctx.cfg.output_dir)
    else:
        tc.tokenizer, tc.hf_assets_path = HuggingFaceTokenizer.Config(), str(o.tokenizer)


def _check_source_keys(d: DataOptions) -> None:
    """data.path and data.name name one source of text between them."""
    if d.path is not None and d.name not in HUB_FREE_NAMES:
        raise UserError(f"data.path={d.path} with data.name={d.name}", "both name a source of text (a local "
                        "path and a HuggingFace dataset); apiary will not guess which one you meant.",
                        f"Keep data.path and set data.name=local, or drop data.path to stream {d.name}.")
    if d.path is None and d.name == "local":
        raise UserError("data.name=local", "needs data.path (a jsonl / json / parquet / txt file or a folder "
                        "of them).", "Set data.path=PATH, or data.name=packaged for the packaged corpus.")


class Text:
    """Documents packed into training windows (packaged corpus, local files or an HF dataset)."""

    Options = DataOptions
    NUMERICS = {"": "any"}  # apiary compare: other data trains another model
    BATCH_KEYS: tuple[str, ...] = ()
    STEP_KEYS: tuple[str, ...] = ()

    @staticmethod
    def check(options: DataOptions, ctx) -> None:
        _check_common(options, ctx)
        _check_validation_keys(options, ctx)
        if options.follow:
            raise UserError("data.follow=true", "follows a folder of RL rollout shards; it needs "
                            "data.format=rollouts (text data is read as a fixed set of files).",
                            "Add data.format=rollouts with a policy loss (loss=grpo ...), or drop data.follow.")
        _check_source_keys(options)  # the keys alone: `train --cfg job` refuses what a launch would
        if not ctx.for_training:
            return
        if options.tokenizer != "byte":
            from components.data.tokenizer import check_hf_tokenizer  # reason: imports torchtitan

            check_hf_tokenizer(str(options.tokenizer), ctx.facts.vocab_size)
        elif ctx.facts.vocab_size < 258:
            raise UserError("data.tokenizer=byte", f"needs a vocabulary of at least 258; the model has "
                            f"{ctx.facts.vocab_size}.", "Set model.vocab_size=320.")
        line = Text.summary(options, ctx)
        if line:
            ctx.summary.append(line)
        line = _validation_summary(options, ctx)
        if line:
            ctx.summary.append(line)
        _check_enough_text(options, ctx)

    @staticmethod
    def summary(options: DataOptions, ctx) -> str:
        """data.path wins over data.name; every local file parses. The line naming what trains."""
        d = options
        _check_source_keys(d)
        if d.path is None and d.name not in ("packaged", "", "tiny"):
            _check_hub_reachable(str(d.name))
            return (f"data: HuggingFace dataset {d.name} (streamed; size unknown before it is read), "
                    f"tokenizer {d.tokenizer}")
        path = str(PACKAGED_CORPUS) if d.path is None else str(d.path)
        if int(os.environ.get("RANK", "0")) != 0 and local_data_files(path):
            return ""  # a torchrun worker: rank 0 reads every line (and refuses for all); the others start
        try:
            summary = inspect_local(path)
        except ValueError as e:
            msg = str(e)
            if msg.endswith("no such file or folder"):
                msg = "no jsonl, json, parquet or txt file there (nothing at that path)"
            raise UserError(f"data.path={d.path}", f"{msg}.", "Fix the file or point data.path at another "
                            "(jsonl/json: one JSON object with a string 'text' per line; txt: UTF-8, a document "
                            "per line; parquet: a 'text' column).") from None
        kind = "packaged" if d.path is None else "local"
        ctx.shared.text_source = summary  # _check_enough_text: at least one step's tokens
        return f"data: {summary.describe(kind, d.tokenizer)}, tokenizer {d.tokenizer}"

    @staticmethod
    def plan_terms(options: DataOptions | None, ctx) -> PlanTerms:
        """The documents a packed row holds (``document_tokens``): counted in the packaged corpus or a
        local jsonl / txt source, in the byte tokenizer's tokens (an upper bound for a subword
        tokenizer); a hub dataset or a parquet source is not read (None: documents as long as a row)."""
        d = options if options is not None else ctx.cfg.data
        try:
            kind = source_kind(str(d.name), None if d.path is None else str(d.path))
        except ValueError:
            return PlanTerms()
        path = str(PACKAGED_CORPUS) if kind == "packaged" else str(d.path) if kind == "local" else None
        n = document_tokens(path) if path is not None else None
        return PlanTerms(facts=PlanFacts(document_tokens=n),
                         notes=[f"data: documents of {n:,.0f} tokens (sum L^2 / sum L, byte tokenizer's count)"]
                         if n else [])

    @staticmethod
    def apply(options: DataOptions, tc, ctx) -> None:
        from components.data import text  # reason: imports datasets and torchtitan (slow; only to train)

        v = ctx.cfg.validation
        part = "train" if v.interval > 0 and v.path is None else "all"  # validation.fraction: hold out the last documents
        tc.dataloader = text.PackedTextDataLoader.Config(
            dataset=text.register(options.name, options.path, part, v.fraction),
            num_workers=options.num_workers, sharding=options.sharding)
        if v.interval > 0:  # the held-out text's loader; the framework runs validation (framework/train/validation.py)
            held = (text.register("local", v.path) if v.path is not None
                    else text.register(options.name, options.path, "validation", v.fraction))
            tc.validation_dataloader = text.PackedTextDataLoader.Config(dataset=held, sharding=options.sharding)
        _tokenizer(options, tc, ctx)
        tc.batch_keys, tc.step_keys = Text.BATCH_KEYS, Text.STEP_KEYS


def _check_enough_text(d: DataOptions, ctx) -> None:
    """A local ``data.path`` must hold at least the tokens one optimizer step trains on (global batch x
    seq_len); with less, every batch repeats the same text and torchtitan re-loops the file, warning
    at every pass. Tokens: the byte tokenizer's count, an upper bound for a subword tokenizer (each of
    its tokens covers at least one byte); parquet is not read before launch and is not checked. The
    packaged corpus (data.name=packaged, 251K tokens) is exempt: benchmarks re-loop it on purpose."""
    summary = ctx.shared.text_source
    tokens = summary.tokens() if summary is not None and d.path is not None else None
    if tokens is None or ctx.layout is None:
        return
    t = ctx.cfg.training
    gb = int(t.global_batch) if t.global_batch is not None else int(t.local_batch) * ctx.layout.dp
    need = gb * int(t.seq_len)
    if tokens >= need:
        return
    how = ("the byte tokenizer's count" if d.tokenizer == "byte" else
           f"at most that many for the tokenizer {d.tokenizer}, whose tokens cover at least one byte each")
    batch = (f"training.global_batch={gb}" if t.global_batch is not None else
             f"training.local_batch={t.local_batch} x {ctx.layout.dp} data-parallel rank(s) = {gb} sequences")
    raise UserError(f"data.path={d.path}", f"holds {tokens:,} tokens ({summary.text_bytes:,} bytes of text in "
                    f"{summary.documents:,} document(s) plus BOS and EOS each; {how}), fewer than one optimizer "
                    f"step trains on: {batch} x training.seq_len={t.seq_len} = {need:,} tokens. Every step would "
                    "train on the same text "
                    "over and over (the loader re-loops the file many times per step).",
                    f"Add text (at least {need:,} tokens), or lower training.seq_len and training.local_batch until "
                    f"a step's sequences x seq_len is at most {tokens:,}.")


def _check_validation_keys(d: DataOptions, ctx) -> None:
    """validation.*: every key takes effect or is refused (text data only; rollout_format.Rollouts refuses it)."""
    v = ctx.cfg.validation
    if v.interval < 0 or v.steps < 1:
        bad = f"validation.interval={v.interval}" if v.interval < 0 else f"validation.steps={v.steps}"
        raise UserError(bad, "validation.interval must be >= 0 (0: no validation) and validation.steps >= 1 (batches "
                        "per validation pass).", "For example validation.interval=50 validation.steps=4.")
    if not 0 <= v.fraction <= 0.5:
        raise UserError(f"validation.fraction={v.fraction}", "must be in (0, 0.5]: the share of the training text's "
                        "last documents held out for validation.", "For example validation.fraction=0.05.")
    source = v.path is not None or v.fraction > 0
    if v.interval == 0 and source:
        key = f"validation.path={v.path}" if v.path is not None else f"validation.fraction={v.fraction}"
        raise UserError(key, "names held-out text, but validation.interval is 0, so no validation would run.",
                        "Add validation.interval=N (validate every N steps), or drop it.")
    if v.interval > 0 and not source:
        raise UserError(f"validation.interval={v.interval}", "needs held-out text: validation.path (files, as "
                        "data.path) or validation.fraction (the last share of the training text's documents).",
                        "For example validation.fraction=0.05.")
    if v.path is not None and v.fraction > 0:
        raise UserError(f"validation.path={v.path} with validation.fraction={v.fraction}", "both name the held-out "
                        "text; apiary will not guess which one you meant.", "Keep one of them.")
    if v.fraction > 0 and d.path is None and d.name not in ("packaged", "", "tiny"):
        raise UserError(f"validation.fraction={v.fraction}", f"holds out documents of a local source; {d.name} is "
                        "streamed from the hub (its size is unknown before it is read).",
                        "Give held-out files with validation.path=PATH instead.")


def _validation_summary(d: DataOptions, ctx) -> str:
    """Before launch: the held-out text parses and leaves documents to train on; its line."""
    v = ctx.cfg.validation
    if v.interval == 0:
        return ""
    when = f"at step 1, every {v.interval} steps and at the last; {v.steps} batch(es) per pass"
    if int(os.environ.get("RANK", "0")) != 0:
        return ""
    if v.path is not None:
        try:
            held = inspect_local(str(v.path))
        except ValueError as e:
            raise UserError(f"validation.path={v.path}", f"{e}.", "Point it at held-out text in data.path's formats "
                            "(jsonl/json with a string 'text', UTF-8 txt, parquet with a 'text' column).") from None
        _check_held_out(d, ctx, held)
        return f"validation: {held.describe('local', d.tokenizer)}, {when}"
    path = str(PACKAGED_CORPUS) if d.path is None else str(d.path)
    n = inspect_local(path).documents  # parsed already by the data line (errors named there)
    k = held_out_count(n, v.fraction)
    if n - k < 1:
        raise UserError(f"validation.fraction={v.fraction}", f"holds out {k} of the {n} documents of {path}, leaving "
                        "none to train on.", "Use a smaller fraction, more documents, or validation.path=PATH.")
    return f"validation: the last {k:,} of {n:,} documents of {path} (never trained on), {when}"


def _check_held_out(d: DataOptions, ctx, held) -> None:
    """validation.path holds validation.steps batches (a pass stops where the file ends: fewer batches
    than asked, or none at all, were accepted without a word); a file that data.path trains on too is
    said in the run's first lines (val_loss then measures trained-on text: a control run may want it)."""
    v = ctx.cfg.validation
    if d.path is not None:
        trained = {os.path.realpath(f) for f in local_data_files(str(d.path))}
        same = [f for f in local_data_files(str(v.path)) if os.path.realpath(f) in trained]
        if same:
            ctx.summary.append(f"validation: NOT held out: validation.path={v.path} holds {same[0]}, which data.path "
                               "trains on, so val_loss measures trained-on text (validation.fraction=0.05 holds "
                               "out data.path's last documents instead)")
    tokens = held.tokens()
    if tokens is None or ctx.layout is None:
        return
    t = ctx.cfg.training
    per_step = int(t.local_batch) * ctx.layout.dp * int(t.seq_len)
    if tokens >= per_step * int(v.steps):
        return
    fits = tokens // per_step
    raise UserError(f"validation.path={v.path}", f"holds {tokens:,} tokens (the byte tokenizer's count, at most that "
                    f"many for a subword tokenizer), fewer than validation.steps={v.steps} batch(es) of "
                    f"training.local_batch={t.local_batch} x {ctx.layout.dp} data-parallel rank(s) x "
                    f"training.seq_len={t.seq_len} = {per_step * int(v.steps):,} tokens: a pass would "
                    + ("validate nothing." if fits == 0 else f"stop after {fits} batch(es)."),
                    (f"Set validation.steps={fits}, or add held-out text." if fits else
                     f"Add held-out text (at least {per_step:,} tokens for one batch), or lower training.seq_len."))
