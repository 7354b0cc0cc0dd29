"""The components of a run: each kind's chosen component and its Options (``context``), the model's
facts, and every kind's ``check``; a component's ValueError becomes a UserError naming its key.

    check(cfg, for_training, world_size) -> (ctx, grad_accum)

is what resolve asks of it: the context built, the model's facts, the layout on ``world_size`` ranks
(framework/resolve/layout.py ``lay_out``: the components' checks read it), every kind's check.
"""

from __future__ import annotations

import contextlib

from framework import contracts
from framework.compose import registry
from framework.errors import UserError, did_you_mean
from framework.resolve import layout


def context(cfg, for_training: bool = True) -> contracts.Context:
    """Each kind's chosen component and its Options built from the recipe (before facts or layout).

    A value an ``Options.__post_init__`` refuses (ValueError) becomes a UserError naming the key."""
    ctx = contracts.Context(cfg=cfg, for_training=for_training)
    for kind in contracts.KINDS:
        section, key = contracts.SELECT[kind]
        name = str(cfg[section][key])
        comp = registry.resolve(kind, name, where=_where(kind, name))
        _check_members(kind, name, comp)
        ctx.components[kind] = comp
        with _as_user_error(kind, name, comp):
            ctx.options[kind] = contracts.make_options(comp, cfg[section])
    return ctx


def _check_members(kind: str, name: str, component) -> None:
    """A component (a user's, typically) lacks a required member of its kind's contract: one
    paragraph, not an AttributeError in a worker. Optional members (``contracts.OPTIONAL_MEMBERS``:
    NUMERICS, plan_terms, hf_writer, ...) may be left out; ``contracts.member`` gives their default."""
    missing = contracts.missing_members(kind, component)
    if missing:
        source = registry.entries()[kind][name].get("source", "registry.yaml")
        raise UserError(_where(kind, name), f"{kind} {name!r} (bound by {source}) lacks "
                        f"{' and '.join([', '.join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)}, "
                        f"which every {kind} provides.",
                        "Add them as docs/architecture.md shows (the contract of each kind is in "
                        "framework/contracts/protocols.py).")


def _see(kind: str, name: str, component=None) -> str:
    """Where the options of ``kind=name`` are documented: its skill page (``SKILL`` or its name)
    or its kind's, and `apiary show`."""
    for page in (contracts.member(component, kind, "SKILL") if component is not None else None, name, kind):
        if page and (registry.ROOT / "docs" / "skills" / f"{page}.md").is_file():
            return f"See `apiary show {name}` and docs/skills/{page}.md."
    return f"See `apiary show {name}`."


def _where(kind: str, name: str) -> str:
    """How the command line names a kind's choice: ``KIND=NAME`` for a group kind, else
    ``SECTION.KEY=NAME`` (contracts.SELECT)."""
    section, key = contracts.SELECT[kind]
    return f"{kind}={name}" if (section, key) == (kind, "name") else f"{section}.{key}={name}"


@contextlib.contextmanager
def _as_user_error(kind: str, name: str, component=None):
    """ValueError raised by a component (the reason) -> UserError naming the kind and choice."""
    try:
        yield
    except ValueError as e:
        raise UserError(_where(kind, name), f"{e}.".replace("..", "."), _see(kind, name, component)) from None
    except UserError:
        raise
    except Exception as e:  # a user's component failing in its own code: its error, where it was raised
        source = registry.entries().get(kind, {}).get(name, {}).get("source", "registry.yaml")
        if source == "registry.yaml":
            raise
        import traceback  # the user's frame only on this path

        frames = traceback.extract_tb(e.__traceback__)
        at = next((f for f in reversed(frames) if not f.filename.startswith(str(registry.CODE_ROOT))), frames[-1])
        raise UserError(_where(kind, name), f"{kind} {name!r} (bound by {source}) raised {type(e).__name__}: "
                        f"{e} (at {at.filename}:{at.lineno}, in {at.name}).",
                        "Fix the component's code there; a value it refuses is a ValueError, which apiary "
                        "reports as the component's one-line reason.") from None


def model_kwargs(cfg, ctx: contracts.Context | None = None) -> dict:
    """The model family's ``model_config`` arguments for this recipe."""
    ctx = ctx or context(cfg, for_training=False)
    return ctx.components["model"].model_kwargs(ctx.options["model"], ctx)


def model_facts(cfg, ctx: contracts.Context | None = None):
    ctx = ctx or context(cfg, for_training=False)
    mod, opts = ctx.components["model"], ctx.options["model"]
    flavors = list(mod.FLAVORS)
    if opts.flavor not in flavors:
        raise UserError(f"model.flavor={opts.flavor}",
                        f"unknown flavor for {opts.family}; known: {', '.join(flavors)}.",
                        did_you_mean(opts.flavor, flavors))
    try:
        return mod.facts(opts.flavor, **mod.model_kwargs(opts, ctx))
    except contracts.ModelTypeNotRead as e:
        raise contracts.ModelTypeNotRead(e.where, e.model_type, e.family, _reading_family(e.model_type)) from None
    except TypeError as e:
        if opts.hf_checkpoint and "hf_checkpoint" in str(e):
            raise UserError(f"model.hf_checkpoint={opts.hf_checkpoint}",
                            f"model.family={opts.family} does not load HF checkpoints.",
                            "Drop model.hf_checkpoint, or use a family that loads them "
                            "(`apiary ls` lists the families).") from None
        raise


def _reading_family(model_type: str) -> str:
    """The fix for a config.json of ``model_type`` given to a family that does not read it: the
    registry's family whose ``HF_MODEL_TYPES`` holds it, else the model types apiary reads."""
    other = registry.family_of(model_type)
    if other is None:
        known = [t for f in registry.names("model")
                 for t in contracts.member(registry.resolve("model", f), "model", "HF_MODEL_TYPES")]
        return f"apiary's model families read model_type {', '.join(known)} checkpoints."
    flavors = list(registry.resolve("model", other).FLAVORS)
    return (f"Set model.family={other} model.flavor={flavors[0]} (with hf_checkpoint the flavor only supplies "
            "defaults; the architecture comes from config.json).")


def check_components(ctx: contracts.Context) -> None:
    """Every kind's ``check(options, ctx)``, in ``contracts.KINDS`` order, before any worker starts."""
    for kind in contracts.KINDS:
        with _as_user_error(kind, ctx.choice(kind), ctx.components[kind]):
            ctx.components[kind].check(ctx.options[kind], ctx)


def check(cfg, for_training: bool, world_size: int, *, parallel=None, facts=None) -> tuple[contracts.Context, int]:
    """The run's components and options (``context``), the model's facts (``facts``: known already), the
    layout of ``parallel`` (default ``cfg.parallel``) on ``world_size`` ranks, then every kind's check
    with them; returns the context and the gradient accumulation the batch splits into."""
    ctx = context(cfg, for_training)
    ctx.facts = facts if facts is not None else model_facts(cfg, ctx)
    ctx.layout, grad_accum = layout.lay_out(ctx, cfg.parallel if parallel is None else parallel, world_size)
    check_components(ctx)
    return ctx, grad_accum
