"""Settings that act only with another one (``_NEEDS``), and the RL keys that act only through a loss
that reads them (``_RL_LOSS_KEYS``): given without it, refused, never ignored.

    check(cfg, overrides, ctx)

runs them all, once every component's check has run (they read what the checks set in ``ctx``).
"""

from __future__ import annotations

import re

from omegaconf import DictConfig, OmegaConf

from framework import contracts
from framework.compose import recipe_files, registry, schema
from framework.errors import UserError


# Settings that act only with another one: (key, the setting it needs, is that setting off?, what the key does).
# Given on the command line while the other is off, the key would be ignored: refused. (A recipe may keep
# such a value for the times the other is on: `train recipe=R checkpoint.enable=false` is not refused for
# the recipe's checkpoint.interval.)
def _in_memory(cfg) -> bool:
    """Whether publish.transport hands weights over in memory (its component's ``IN_MEMORY``)."""
    name = str(cfg.publish.transport)
    return bool(contracts.member(registry.resolve("transport", name, where=f"publish.transport={name}"),
                                 "transport", "IN_MEMORY"))


_NEEDS = [
    ("training.max_skips", "training.on_nonfinite=skip", lambda c: c.training.on_nonfinite != "skip",
     "how many non-finite steps in a row are skipped before the run stops"),
    ("data.wait_timeout", "data.follow=true", lambda c: not c.data.follow,
     "how long a followed folder may stay without new records"),
    ("data.name", "data.follow=false", lambda c: bool(c.data.follow),
     "the dataset a run reads when it does not follow a folder (a followed folder is read from data.path alone)"),
    ("validation.steps", "validation.interval=N", lambda c: c.validation.interval == 0,
     "the batches of each validation pass"),
    *((f"publish.{k}", "publish.interval=N", lambda c: c.publish.interval == 0, what) for k, what in (
        ("dir", "where published weights go"), ("keep", "how many published versions stay"),
        ("background", "how published weights are written"), ("dtype", "the dtype of published weights"),
        ("transport", "how published weights reach the generator"))),
    *((f"publish.{k}", "an in-memory publish.transport", lambda c: not _in_memory(c), what) for k, what in (
        ("engine", "where the trainer listens for the engine"), ("bucket_mb", "the size of a transfer bucket"),
        ("engine_timeout", "how long the trainer waits for the engine"),
        ("when_busy", "what a version due during the last transfer does"))),
    *((f"checkpoint.{k}", "checkpoint.enable=true", lambda c: not c.checkpoint.enable, what) for k, what in (
        ("interval", "the steps between saves"), ("keep_latest_k", "how many saved steps stay"),
        ("model_only_last", "what the last save holds"))),
    ("checkpoint.verify", "checkpoint.resume=true or checkpoint.load_path=STEP",
     lambda c: not c.checkpoint.resume and c.checkpoint.load_path is None,
     "whether a loaded step must match its manifest.json"),
    ("logging.wandb_project", "logging.wandb=true", lambda c: not c.logging.wandb,
     "the W&B project the metrics go to"),
    ("parallel.pp_microbatch_size", "parallel.pp=N (N > 1)",
     lambda c: int(c.parallel.pp if c.parallel.pp is not None else c.layout.pp) == 1,
     "the sequences per pipeline microbatch"),
]


# rl.* settings that act through the loss (the policy losses): (key, set?). A loss component lists the
# ones it acts on in ``RL_KEYS``; one set with a loss that does not act on it is refused, never ignored.
_RL_LOSS_KEYS = (("tis_cap", lambda v: v is not None),
                 ("mismatch_threshold", lambda v: v != schema.RLConfig.mismatch_threshold))  # set: not its default


def check_rl_keys(ctx: contracts.Context) -> None:
    """``rl.tis_cap`` / ``rl.mismatch_threshold`` set with a loss whose ``RL_KEYS`` lacks them: exit 2."""
    section = ctx.cfg.get("rl") if hasattr(ctx.cfg, "get") else None
    if section is None:
        return
    name = ctx.choice("loss")
    acts_on = contracts.member(ctx.components["loss"], "loss", "RL_KEYS")
    for key, is_set in _RL_LOSS_KEYS:
        value = section.get(key)
        if is_set(value) and key not in acts_on:
            raise UserError(f"rl.{key}={value}", f"acts through an RL policy loss; loss={name} does not use it, "
                            "so it would be ignored.",
                            f"Choose an RL policy loss (`apiary ls` lists the losses), or drop rl.{key}. "
                            "See docs/skills/tis.md.")


def check(cfg, overrides: list[str], ctx: contracts.Context, recipe: str | None = None) -> None:
    """The RL keys the loss does not act on, then every setting without effect (``recipe``: as recipe= names
    it, for the keys a recipe file of the user's own sets)."""
    check_rl_keys(ctx)
    check_no_effect(cfg, overrides, ctx, recipe)


def _set_here(cfg, key: str, given: set[str], in_file: dict, reads: tuple[str, ...]) -> str:
    """Whether ``key`` is set by this launch: ' (given)' on the command line; ' (set in recipe file F)' in a
    recipe file of the user's own, to a value other than the schema's default and the packaged recipes', while
    the command line gives none of the keys the verdict ``reads`` (a recipe may keep a value for the times its partner is on:
    `train recipe=R checkpoint.enable=false` is not refused for R's checkpoint.interval); else ''."""
    if key in given:
        return " (given)"
    if key not in in_file or any(g == r or g.startswith(f"{r}.") or r.startswith(f"{g}.") or g == r.split(".")[0]
                                 for g in given for r in reads):
        return ""
    value, default = OmegaConf.select(cfg, key), OmegaConf.select(_SCHEMA, key, default=_SCHEMA)
    if (default is not _SCHEMA and default == value) or value in recipe_files.shipped_values().get(key, []):
        return ""  # the default, or a value a packaged recipe keeps too (a copy of one: `apiary cp`)
    return f" (set in recipe file {in_file[key]})"


_SCHEMA = OmegaConf.structured(schema.RecipeConfig)


def check_no_effect(cfg, overrides: list[str], ctx: contracts.Context, recipe: str | None = None) -> None:
    """Every setting takes effect or is refused: what would load nothing, resume nothing or be ignored."""
    ck, given = cfg.checkpoint, {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    in_file = recipe_files.user_file_keys(recipe)
    own_load = ctx.shared.load_path_reader  # a component that loads it itself (its check says)
    if ck.load_path is not None and not ck.enable and not own_load:
        raise UserError(f"checkpoint.load_path={ck.load_path} with checkpoint.enable=false", "with checkpointing off "
                        "nothing is loaded: the run would start from initialised weights, not from that step.",
                        "Drop checkpoint.enable=false (set checkpoint.interval above training.steps to save only "
                        "the last step), or drop checkpoint.load_path.")
    if ck.resume and not ck.enable:
        raise UserError("checkpoint.resume=true with checkpoint.enable=false", "with checkpointing off nothing is "
                        "loaded: the run would start over at step 1 in the run's folder (its records of those steps "
                        "moved aside) instead of continuing it.", "Drop checkpoint.enable=false.")
    if ck.resume and ck.create_seed:
        raise UserError("checkpoint.create_seed=true with checkpoint.resume=true", "a seed checkpoint is the step-0 "
                        "weights of a new run (written, then the process exits); it cannot continue a run, and "
                        "would be written into the run's checkpoints.", "Drop one of them: create the seed in a new "
                        "output_dir.")
    _check_ignored_data_keys(cfg, given, ctx, in_file)  # first: a key the format never reads needs nothing else
    for key, needs, off, what in _NEEDS:
        where = _set_here(cfg, key, given, in_file, tuple(re.findall(r"[a-z_]+\.[a-z_]+", needs)))
        if where and off(cfg):
            source = where.removeprefix(" (set in recipe file ").removesuffix(")")
            raise UserError(f"{key}={OmegaConf.select(cfg, key)}{where if where != ' (given)' else ''}",
                            f"sets {what}, which acts only with {needs}, and this run does not have it, so the "
                            "setting would be ignored.",
                            f"Add {needs}, or drop {key}" + (f" from {source}." if where != " (given)" else "."))
    model = cfg.model
    if "model.flavor" in given and model.get("hf_checkpoint") and ctx.facts is not None:
        mod = ctx.components["model"]
        flavor_moe = bool(mod.facts(model.flavor).num_experts)
        if flavor_moe != bool(ctx.facts.num_experts):
            kinds = ("an MoE", "a dense") if flavor_moe else ("a dense", "an MoE")
            raise UserError(f"model.flavor={model.flavor} with model.hf_checkpoint={model.hf_checkpoint}",
                            f"the flavor is {kinds[0]} model, and the checkpoint's config.json describes {kinds[1]} "
                            "one, which is what would load (with hf_checkpoint the architecture comes from "
                            "config.json; the flavor only supplies defaults).",
                            "Drop model.flavor, or point model.hf_checkpoint at the model you mean.")
    if ctx.facts is not None and not ctx.facts.num_experts:
        # every moe.* key (schema.MoEConfig's fields, and any option of the moe kinds) acts on the MoE layers only
        file_moe = [] if any(g.startswith("model") for g in given) else \
            [k for k in in_file if k.startswith("moe.") and k != "moe.name" and not isinstance(
                OmegaConf.select(cfg, k), DictConfig)]
        for key in sorted(k for k in given if k == "moe" or k.startswith("moe.")) + file_moe:
            src = f" (set in recipe file {in_file[key]})" if key not in given else ""
            raise UserError(f"{key}={OmegaConf.select(cfg, key)}{src}", f"{ctx.facts.family} {ctx.facts.flavor} "
                            "is a dense model: it has no MoE layers, so the setting would be ignored.",
                            f"Drop {key}{f' from {in_file[key]}' if src else ''}, or choose an MoE flavor.")


def _check_ignored_data_keys(cfg, given: set[str], ctx: contracts.Context, in_file: dict) -> None:
    """A ``data.*`` (or ``validation.*``) key given on the command line, or set in a recipe file of the user's
    (``_set_here``), that the data format declares it does not read (its ``ignored_keys``) is refused; a packaged
    recipe's value of it stays accepted."""
    data = ctx.components.get("data")
    ignored = contracts.member(data, "data", "ignored_keys") if data is not None else None
    if ignored is None:
        return
    section, key = contracts.SELECT["data"]
    for name, (instead, fix) in ignored(ctx.options["data"], ctx).items():
        if where := _set_here(cfg, name, given, in_file, ()):  # the command line, or a recipe file of the user's
            src = where.removeprefix(" (set in recipe file ").removesuffix(")") if where != " (given)" else ""
            raise UserError(f"{name}={OmegaConf.select(cfg, name)}{where if src else ''} with {section}.{key}="
                            f"{ctx.choice('data')}", f"this data format does not read {name}: {instead}, so the "
                            "setting would be ignored.", (fix or f"Drop {name}.") + (f" (in {src})" if src else ""))
