"""`apiary logprobs MODEL ROLLOUTS --out DIR`: a reference model's token log-probabilities
written into rollout records (``ref_logprobs``, the KL term of the policy losses).

MODEL is a HuggingFace folder (config.json; the family whose ``HF_MODEL_TYPES`` holds its
``model_type`` builds it with ``hf_checkpoint=``) or an apiary run folder (config.yaml; its latest
complete checkpoint, or ``--step N``, loaded into the run's own model, routing bias included; a run
that trained adapters (adapter=lora): its base with the latest step's adapters folded in).
ROLLOUTS is a rollout .jsonl / .parquet file or a folder of them (components/data/rollouts.py).
Each record is written back as jsonl under DIR with the same relative name (``x.parquet`` ->
``x.jsonl``), every field kept, ``ref_logprobs`` set: ``ref_logprobs[t] = log p(input_ids[t] |
input_ids[:t])`` under ``softmax(logits / --temperature)``, ``ref_logprobs[0] = 0``. The
log-probabilities come from the model's final hidden states and its output weight through the
fused head (``components.losses.logprob.token_logprobs``), never [tokens, vocab] logits.

One process (this machine's accelerator, else the CPU), fp32, no gradients. Records are scored in
batches of similar length, right-padded (causal models: padding never changes a real token's
output) up to ``--batch-tokens`` tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from components.data.rollout_sources import located_records, record_where, rollout_files
from framework import compat, contracts
from framework.compose import registry
from framework.errors import UserError
from framework.report import no_step
from framework.resolve.context import model_kwargs
from framework.resolve.inputs import writable_folder
from framework.train import integrity

if TYPE_CHECKING:  # annotations only: torch and the model load when a model is scored (start-up time)
    import torch


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help="a HuggingFace model folder, or an apiary run folder (its checkpoint)")
    p.add_argument("rollouts", metavar="ROLLOUTS", help="a rollout .jsonl/.parquet file or a folder of them")
    p.add_argument("--out", required=True, metavar="DIR", help="where the scored rollouts go (jsonl, same names)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="a run folder's checkpoint step (default: its latest complete one)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="divide the logits by T (the sampler's temperature; default 1.0)")
    p.add_argument("--field", default="ref_logprobs", choices=FIELDS,
                   help="the field to fill: ref_logprobs (a reference model, for a KL term) or old_logprobs "
                        "(the trainer's own old policy, for rl.tis_cap's decoupled form; the record's old "
                        "old_logprobs, the engine's, move to gen_logprobs)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter folder (apiary export of a LoRA run) applied to MODEL, a HuggingFace "
                        "folder of its base (merged by peft; needs transformers and peft)")
    p.add_argument("--batch-tokens", type=int, default=8192, metavar="N",
                   help="padded tokens per forward (default 8192)")
    p.add_argument("--unverified", action="store_true",
                   help="a run folder's step without manifest.json: load it unverified (refused otherwise)")


# -------------------------------------------------------------------------------- the model

def _family_of(folder: Path, where: str) -> str:
    from components.models.hf import read_config  # reason: start-up time (torch, torchtitan)

    mt = str(read_config(folder).get("model_type", ""))
    family = registry.family_of(mt)
    if family is not None:
        return family
    raise UserError(where, f"{folder}/config.json has model_type={mt or '(none)'}, which no model family of the "
                    "registries reads.", f"The families read model_type {', '.join(registry.model_types())}.")


def load_model(model: str, step: int | None, device, unverified: bool = False) -> tuple[torch.nn.Module, str]:
    """(the model in eval mode, a description of what was loaded)."""
    from framework.api import build_model  # reason: start-up time (torch)

    where = f"apiary logprobs {model}"
    p = Path(model)
    if (p / "config.json").is_file():
        if step is not None or unverified:
            flag = "--step" if step is not None else "--unverified"
            raise UserError(where, f"is a HuggingFace folder; {flag} applies to a checkpoint of a run folder.",
                            f"Drop {flag}.")
        family = _family_of(p, where)
        flavor = next(iter(registry.resolve("model", family).FLAVORS))  # defaults only: config.json is the architecture
        return build_model(f"{family}:{flavor}", hf_checkpoint=str(p), device=str(device)).eval(), f"HF folder {p}"
    if (p / "config.yaml").is_file():
        return _run_model(p, step, device, where, unverified)
    pointer = p if p.name == "latest" and p.is_file() else p / "latest"  # publish.dir's `latest`, or publish.dir
    if pointer.is_file() and (pointer.parent / pointer.read_text().strip()).is_dir():
        version = pointer.parent / pointer.read_text().strip()
        what = "a publication folder's `latest` pointer (a text file)" if pointer == p else \
            "a publication folder (publish.dir: one folder per published weight version)"
        raise UserError(where, f"is {what}, not a model folder; `latest` names "
                        f"{version.name}, the HF folder of the newest version.", f"Pass it: apiary logprobs {version} ...")
    raise UserError(where, "is neither a HuggingFace model folder (config.json) nor an apiary run folder "
                    "(config.yaml)" + ("" if p.exists() else "; it does not exist") + ".",
                    "Pass a folder written by save_pretrained (or a published weights/step-N), or runs/RECIPE/TIME.")


def run_folder_paths(run: Path, cfg, where: str) -> None:
    """A run's config.yaml keeps ``model.hf_checkpoint`` as it was given: a relative path is relative to
    the folder the run was launched from. Refused with that said, and the folder named where it is
    found (was: "model.hf_checkpoint=my_model: no such folder" from `apiary export`/`logprobs` run
    elsewhere, the run folder itself unmentioned)."""
    hf = OmegaConf.select(cfg, "model.hf_checkpoint", default=None)
    if not hf or Path(str(hf)).is_absolute() or Path(str(hf)).is_dir():
        return
    homes = [a.parent for a in Path(run).resolve().parents if a.name == "runs" and (a.parent / str(hf)).is_dir()]
    fix = (f"Run it from {homes[0]}, where the run was launched: cd {homes[0]}, the run folder then being "
           f"{Path(run).resolve().relative_to(homes[0])}." if homes
           else f"Run it from the folder the run was launched in (where {hf} is).")
    raise UserError(where, f"the run's config.yaml names model.hf_checkpoint={hf}, a path relative to the folder the "
                    f"run was launched from, and there is no {hf} in this one ({Path.cwd()}).", fix)


def _run_model(run: Path, step: int | None, device, where: str, unverified: bool = False):
    import torch.distributed.checkpoint as dcp  # reason: only run folders read DCP checkpoints

    from framework.api import build_model  # reason: start-up time (torch)

    cfg = OmegaConf.load(run / "config.yaml")
    run_folder_paths(run, cfg, where)
    steps = integrity.complete_steps(run / "checkpoint")
    if not steps:  # was: "Train with checkpointing on", for a run that had it on (framework/report/no_step.py)
        raise UserError(where, *no_step.refusal(run, "Or pass a HuggingFace folder."))
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise UserError(f"{where} --step {step}", f"no complete checkpoint of that step; complete: "
                        f"{', '.join(map(str, sorted(steps)))}.", "Pick one of those steps.")
    adapter = str(OmegaConf.select(cfg, "adapter.name", default="none") or "none")
    if adapter != "none":
        return _adapter_run_model(run, cfg, adapter, step, max(steps), device, where)
    kw = model_kwargs(cfg)
    kw["moe_comm_backend"] = "standard"  # one process: no expert-parallel dispatch
    model = build_model(f"{cfg.model.family}:{cfg.model.flavor}", device=str(device), **kw)
    step_dir = integrity.step_dirs(run / "checkpoint")[step]
    integrity.check_step(step_dir, where, unverified_ok=unverified, override="--unverified", fresh="train again",
                         pick="Score the previous complete step with --step {n} (it is verified the same way)")
    saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    sd = model.state_dict()
    buffers = {n for n, _ in model.named_buffers()}
    missing = [k for k in sd if k not in saved and k not in buffers]
    if missing:
        raise UserError(where, f"checkpoint step {step} lacks {len(missing)} of the model's weights, e.g. "
                        f"{', '.join(missing[:3])}.", "Was it saved by this run's model? Try another --step.")
    sd = {k: v for k, v in sd.items() if k in saved}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    model.load_state_dict(sd, strict=False)
    return model.eval(), f"{run} checkpoint step {step}"


def _adapter_run_model(run: Path, cfg, adapter: str, step: int, latest: int, device, where: str):
    """A run that trained adapters (adapter=lora) on a frozen base: its checkpoints hold the adapters
    alone, so the model scored is the base with the adapters folded in, written by the adapter's own
    exporter (what `apiary export RUN --hf OUT --merged` writes) to a temporary folder and loaded
    from there."""
    import tempfile  # reason: only for adapter runs

    how = (f"Export the merged model and score it: apiary export {run} --hf OUT --merged, then apiary logprobs "
           "OUT ROLLOUTS --out DIR.")
    export = contracts.member(registry.resolve("adapter", adapter), "adapter", "export_hf")
    if export is None:
        raise UserError(where, f"the run trained adapters (adapter={adapter}), whose component has no exporter "
                        "(export_hf) to fold them into the base.", "Score the base (its HF folder) instead.")
    if step != latest:
        raise UserError(f"{where} --step {step}", f"the run trained adapters (adapter={adapter}); the base with "
                        f"its adapters is scored at the latest step ({latest}) only.", f"Drop --step. {how}")
    family = registry.resolve("model", cfg.model.family)
    with tempfile.TemporaryDirectory(prefix="apiary-merged-") as tmp:
        try:
            folder, _ = export(str(run), str(Path(tmp) / "merged"), family, merged=True)
        except UserError as e:
            raise UserError(where, f"the run trained adapters (adapter={adapter}) on a base, and the base with "
                            f"them cannot be built: {e.reason}", e.suggestion) from None
        model, _ = load_model(str(folder), None, device)
    return model, f"{run} checkpoint step {step} (adapter={adapter} folded into its base)"


# -------------------------------------------------------------------------------- scoring

def score(model: torch.nn.Module, sequences: list[list[int]], temperature: float = 1.0,
          batch_tokens: int = 8192) -> list[list[float]]:
    """Per sequence: [0.0, log p(x1 | x0), log p(x2 | x0 x1), ...] (fp32, through the fused head)."""
    import torch  # reason: start-up time (`apiary --help` builds this command's parser without torch)

    with torch.no_grad():
        return _score(model, sequences, temperature, batch_tokens)


def _score(model, sequences: list[list[int]], temperature: float, batch_tokens: int) -> list[list[float]]:
    import torch  # reason: start-up time (`apiary --help` builds this command's parser without torch)

    from components.losses.logprob import token_logprobs  # reason: start-up time (torch)
    from components.models.hf import causal_masks  # reason: start-up time (torch, torchtitan)

    device = next(model.parameters()).device
    weight = model.lm_head.weight
    out: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    with compat.hidden_states_only(model):  # the decoder returns its final hidden states (after the last norm)
        i = 0
        while i < len(order):
            width = len(sequences[order[i]])
            batch = [order[i]]
            while (i + len(batch) < len(order)
                   and (len(batch) + 1) * len(sequences[order[i + len(batch)]]) <= max(batch_tokens, width)):
                batch.append(order[i + len(batch)])
            width = max(len(sequences[j]) for j in batch)
            tokens = torch.zeros(len(batch), width, dtype=torch.long)
            for r, j in enumerate(batch):
                tokens[r, :len(sequences[j])] = torch.tensor(sequences[j])
            tokens = tokens.to(device)
            hidden = model(tokens, attention_masks=causal_masks(model, tokens))  # as the trainer builds them
            # position t's output predicts token t + 1
            lp, _ = token_logprobs(hidden[:, :-1].float(), weight.float(), tokens[:, 1:], temperature)
            for r, j in enumerate(batch):
                out[j] = [0.0] + lp[r, :len(sequences[j]) - 1].cpu().tolist()
            i += len(batch)
    return out


def _read(files: list[Path], root: Path, where: str) -> list[tuple[Path, list[tuple[str, dict]]]]:
    """Each file's records with their file:line, checked for what scoring needs."""
    out = []
    for f in files:
        recs = []
        try:
            for line, _, rec in located_records(f):
                at = record_where(f, line)
                ids = rec.get("input_ids") if isinstance(rec, dict) else None
                if not isinstance(ids, list) or len(ids) < 2 or not all(isinstance(t, int) and t >= 0 for t in ids):
                    raise UserError(f"{where} {at}", "is not a rollout record: it needs input_ids, a list of at "
                                    "least 2 non-negative token ids (components/data/rollouts.py).",
                                    "Point ROLLOUTS at rollout files (the generator's output).")
                recs.append((at, rec))
        except ValueError as e:  # a jsonl line that is not JSON, a parquet file that is not parquet
            raise UserError(f"{where} {f}", f"cannot be read as rollouts: {e}.",
                            "Rollouts are .jsonl (one JSON object per line) or .parquet files.") from None
        if not recs:
            raise UserError(f"{where} {f}", "holds no rollout records.", "Remove the empty file or fill it.")
        out.append((f, recs))
    return out


def _target(f: Path, root: Path, out: Path) -> Path:
    rel = f.relative_to(root) if root.is_dir() else Path(f.name)
    return out / rel.with_suffix(".jsonl")


FIELDS = ("ref_logprobs", "old_logprobs")


def logprobs_args(ns) -> int:
    return run(ns.model, ns.rollouts, ns.out, step=ns.step, temperature=ns.temperature, batch_tokens=ns.batch_tokens,
               field=ns.field, adapter=ns.adapter, unverified=ns.unverified)


def merge_adapter(base: str, adapter: str, dest: Path) -> Path:
    """An HF folder of ``base`` with the PEFT adapter folder ``adapter`` merged into its weights (by peft
    itself: the same merge a PEFT user gets), written to ``dest``."""
    where = f"apiary logprobs {base} --adapter {adapter}"
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise UserError(where, f"{adapter} is not a PEFT adapter folder (no adapter_config.json).",
                        "Pass the folder `apiary export RUN --hf OUT` wrote for a LoRA run.")
    if not (Path(base) / "config.json").is_file():
        raise UserError(where, "--adapter applies to a HuggingFace folder of the base (config.json).",
                        "Pass the base model's folder as MODEL, or score the merged export (--merged) instead.")
    from components.adapters.export import check_exported_base  # reason: only with --adapter

    check_exported_base(adapter, base, where)
    try:
        import transformers  # reason: optional dependencies, only for --adapter
        from peft import PeftModel  # reason: as above
    except ImportError as e:
        raise UserError(where, f"needs transformers and peft ({e.name} is not installed).",
                        "pip install transformers peft, or score the merged export (apiary export RUN --hf OUT "
                        "--merged).") from None
    import torch  # reason: start-up time

    with _no_transformers_bars():  # transformers' "Loading weights" / "Writing model shards": apiary's own calls
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        try:
            with warnings.catch_warnings():  # peft reads transformers' deprecated alias (transformers 5): not the user's
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                        category=FutureWarning)
                merged = PeftModel.from_pretrained(hf, adapter).merge_and_unload()
        except (ValueError, KeyError, RuntimeError) as e:
            raise UserError(where, f"peft could not apply {adapter} to {base}: {str(e).splitlines()[0][:300]}.",
                            "Is the adapter one of a run on this base?") from None
        merged.save_pretrained(dest)
    return dest


@contextlib.contextmanager
def _no_transformers_bars():
    """transformers' progress bars off for the block, the setting as it was afterwards."""
    from transformers.utils import logging as hf_logging  # reason: optional dependency, only for --adapter

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _filled(rec: dict, field: str, lp: list[float], at: str) -> dict:
    """``rec`` with ``field`` set to ``lp``; for old_logprobs the engine's numbers move to gen_logprobs
    (refused when the record already has gen_logprobs: they would be lost)."""
    if field == "ref_logprobs":
        return {**rec, "ref_logprobs": lp}
    if rec.get("gen_logprobs") is not None:
        raise UserError(f"apiary logprobs --field old_logprobs {at}", "the record already has gen_logprobs; "
                        "moving its old_logprobs there would lose them.",
                        "Score rollouts that carry the engine's log-probs in old_logprobs only.")
    return {**rec, "gen_logprobs": rec.get("old_logprobs"), "old_logprobs": lp}


TEMPERATURE_RANGE = (1e-3, 100.0)  # --temperature: a sampler's (log-probs past it overflow or say nothing)


def run(model_path: str, rollouts: str, out: str, *, step: int | None = None, temperature: float = 1.0,
        batch_tokens: int = 8192, field: str = "ref_logprobs", echo=print, adapter: str | None = None,
        unverified: bool = False) -> int:
    where = f"apiary logprobs {model_path} {rollouts}"
    if field not in FIELDS:
        raise UserError(f"apiary logprobs --field {field}", f"unknown; valid: {', '.join(FIELDS)}.")
    if not TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]:  # nan and inf too: no sampler's temperature
        raise UserError(f"apiary logprobs --temperature {temperature}", "must be a number from {:g} to {:g}.".format(
            *TEMPERATURE_RANGE), "Use the sampler's temperature.")
    if batch_tokens < 1:
        raise UserError(f"apiary logprobs --batch-tokens {batch_tokens}", "must be >= 1.", "For example 8192.")
    root = Path(rollouts)
    try:
        files = rollout_files(root)
    except ValueError as e:  # a folder, a device or a dangling link under a rollout file's name
        raise UserError(where, f"{e}.", "Remove that entry or replace it with the file.") from None
    if not files:
        raise UserError(where, f"{rollouts} " + ("is not a .jsonl or .parquet file, or a folder holding them"
                                                if root.exists() else "does not exist") + ".",
                        "Pass a rollout file or a folder of them (components/data/rollouts.py).")
    records = _read(files, root, "apiary logprobs")
    dest = Path(out)
    clash = [str(f) for f in files if _target(f, root, dest).absolute() == f.absolute()]
    if clash:
        raise UserError(f"apiary logprobs --out {out}", f"would overwrite the input {clash[0]}.", "Write to another folder.")
    if dest.is_dir() and any(dest.iterdir()):  # (a file: writable_folder names it)
        raise UserError(f"apiary logprobs --out {out}", "is not an empty folder; scoring there would overwrite or "
                        "mix with what it holds.", "Choose a new folder (it is created), or empty this one.")
    writable_folder(dest, f"apiary logprobs --out {out}", "no scored rollouts could be written")
    import torch  # reason: start-up time (the checks above need no torch)

    from framework import devices  # reason: start-up time (torch)

    devices.install()
    device = torch.device(devices.device_type())
    if adapter is not None:  # the base with the adapters merged, scored as any HF folder
        import tempfile  # reason: only with --adapter

        with tempfile.TemporaryDirectory(prefix="apiary-merged-") as tmp:
            model, what = load_model(str(merge_adapter(model_path, adapter, Path(tmp))), None, device)
        what = f"HF folder {model_path} with the adapter {adapter}"
    else:
        model, what = load_model(model_path, step, device, unverified)
    vocab = int(model.lm_head.weight.shape[0])
    for f, recs in records:
        for at, rec in recs:
            top = max(rec["input_ids"])
            if top >= vocab:
                raise UserError(f"apiary logprobs {at}", f"token id {top} is outside the model's vocabulary of "
                                f"{vocab} ({what}): the rollouts were tokenized for another model.",
                                "Score them with the model (and tokenizer) that generated them.")
    if field == "old_logprobs":  # refused before anything is written
        for f, recs in records:
            for at, rec in recs:
                _filled(rec, field, [], at)
    n_tok = 0
    for f, recs in records:
        lps = score(model, [rec["input_ids"] for _, rec in recs], temperature, batch_tokens)
        target = _target(f, root, dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        lines = [json.dumps(_filled(rec, field, lp, at)) + "\n" for (at, rec), lp in zip(recs, lps)]
        n_tok += sum(len(lp) for lp in lps)
        with open(tmp, "w") as h:
            h.writelines(lines)
        os.replace(tmp, target)
    n = sum(len(r) for _, r in records)
    moved = " (the engine's old_logprobs kept as gen_logprobs)" if field == "old_logprobs" else ""
    echo(f"{field} of {n} records ({n_tok} tokens, temperature {temperature}) from {what} -> {dest}{moved}")
    return 0
