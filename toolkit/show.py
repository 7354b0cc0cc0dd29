"""`apiary show DIR` on a HuggingFace model folder: the architecture apiary derives from its
config.json, parameter counts (total, active) and the planner's per-GPU memory for a layout.

The family is the one whose ``HF_MODEL_TYPES`` holds the config's ``model_type``; the training
settings (sequence length, batch, loss, recompute) are those of the first recipe of the family laid
out for GPUs (``parallel.gpus``), found by reading the recipe files (not composing them), with the
folder's architecture in place of the recipe's flavor, the sequence at most the folder's
``max_position_embeddings``, and as many GPUs as the folder's model needs (``gpus_for``: its
training state in half an H100, at most the recipe's count), not the recipe's. One recipe compose.
``apiary plan recipe=R model.hf_checkpoint=DIR gpus=N ...`` plans any other layout.
"""

from __future__ import annotations

from pathlib import Path

from components.models.hf_folder import read_config  # the config reader every family uses (no torch)
from framework.compose import recipe_files, recipes, registry
from framework.errors import UserError
from framework.plan import planner
from framework.resolve.context import model_facts as resolve_facts
from framework.resolve.resolver import resolve


def _gib(b: float) -> str:
    return f"{b / 2**30:,.2f}"


def family_for(path: Path) -> tuple[str, str]:
    c = read_config(path)
    mt = str(c.get("model_type", ""))
    family = registry.family_of(mt)
    if family is not None:
        return family, mt
    raise UserError(f"apiary show {path}", f"config.json has model_type={mt or '(none)'}, which no model family "
                    "of the registries reads.", f"The families read model_type {', '.join(registry.model_types())}.")


def _setting(name: str, dotted: str, seen: tuple = ()):
    """A recipe's own setting (its file, else the recipes it extends), read from the YAML files
    without composing them; None where none of them sets it."""
    if name in seen or len(seen) > 8:
        return None
    try:
        data = recipe_files._read_yaml(recipes.recipe_path(name))
    except Exception:  # noqa: BLE001  (an unreadable recipe is not the one to plan with)
        return None
    node = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is not None:
        return node
    for parent in (data.get("defaults") or []) if isinstance(data, dict) else []:
        if isinstance(parent, str) and parent not in ("_self_", "_defaults"):
            found = _setting(parent, dotted, (*seen, name))
            if found is not None:
                return found
    return None


def plan_recipe(family: str) -> tuple[str, int]:
    """The first recipe of ``family`` laid out for GPUs (else its first), and its GPU count."""
    first = None
    for name in recipes.recipe_names():
        if _setting(name, "model.family") != family:
            continue
        gpus = _setting(name, "parallel.gpus")
        if gpus:
            return name, int(gpus)
        first = first or name
    return first, 8


GPU_BYTES = 80 * 2**30  # an H100's memory (the planner's default GPU)
STATE_BYTES_PER_PARAM = 16  # bf16 weights, fp32 master weights and gradients, Adam's two moments: FSDP-sharded


def gpus_for(n_params: int, most: int) -> int:
    """The fewest GPUs (a power of two, at most ``most``) over which the model's training state
    takes at most half of each GPU (the rest for activations)."""
    n = 1
    while n < most and STATE_BYTES_PER_PARAM * n_params / n > GPU_BYTES / 2:
        n *= 2
    return min(n, max(most, 1))


def short_count(n: int) -> str:
    """A parameter count at a glance: 34.66B, 115.1M, 115.1K (was: always billions, 0.000B for a small model)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def show_hf(path: str, console) -> int:
    p = Path(path)
    family, mt = family_for(p)
    recipe, most = plan_recipe(family)
    overrides = [f"model.hf_checkpoint={p}"]
    notes = []
    rope = read_config(p).get("max_position_embeddings")
    seq = _setting(recipe, "training.seq_len")
    if rope and isinstance(seq, int) and seq > rope:  # beyond the folder's RoPE length
        overrides.append(f"training.seq_len={int(rope)}")
        notes.append(f"training.seq_len={int(rope)}: the folder's max_position_embeddings")
    chosen = []

    def world(cfg) -> int:  # the folder's model's size picks the GPUs (resolve composes once)
        chosen.append(gpus_for(resolve_facts(cfg).n_params, most))
        return chosen[-1]

    for _ in range(3):  # the recipe's layout, adapted to what a small checkpoint cannot take
        try:
            r = resolve(recipe, overrides, world_size=world, for_training=False)
            gpus = chosen[-1]
            break
        except UserError as e:
            if e.where.startswith("training.seq_len") and rope and "training.seq_len" not in str(overrides):
                overrides.append(f"training.seq_len={int(rope)}")  # beyond the folder's RoPE length
                notes.append(f"training.seq_len={int(rope)}: the folder's max_position_embeddings")
            elif "parallel.ep=1" not in overrides:  # the table's EP may not divide a small checkpoint's experts
                overrides.append("parallel.ep=1")
                notes.append(f"parallel.ep=1: {e.reason.split(':')[0]}")
            else:
                raise
    note = f" ({'; '.join(notes)})" if notes else ""
    f = r.facts
    console.print(f"[bold]{p}[/bold]: model_type {mt} -> model.family={family}", highlight=False)
    console.print(f"architecture: {f.source.split(': ', 1)[1]}", markup=False)
    console.print(f"parameters: {f.n_params:,} total ({short_count(f.n_params)}), {f.n_active_params:,} active per "
                  f"token ({short_count(f.n_active_params)})" + (f"; {f.num_experts} experts, top-{f.top_k}"
                                                                 if f.num_experts else ""), markup=False)
    plan = planner.plan(r)
    console.print(f"planner: the folder's model with recipe {recipe}'s training settings on {gpus} x "
                  f"{plan.choices['gpu']} (the fewest GPUs for its size; the recipe's: {most}), dims {r.layout.dims}, seq "
                  f"{r.cfg.training.seq_len:,}, local_batch {r.cfg.training.local_batch}, loss {plan.choices['loss']}, "
                  f"recompute {plan.choices['recompute']}{note}: {_gib(plan.total_bytes)} GiB per GPU of "
                  f"{_gib(plan.gpu_memory_bytes)} -> {plan.verdict}", markup=False)
    for term in sorted(plan.terms, key=lambda t: -t.bytes)[:6]:
        console.print(f"  {term.name:<28} {_gib(term.bytes):>9} GiB", markup=False)
    console.print(f"other layouts: apiary plan recipe={recipe} model.hf_checkpoint={p} gpus=N "
                  "[training.seq_len=S parallel.cp=C ...] (--search ranks those that fit)", markup=False)
    return 0
