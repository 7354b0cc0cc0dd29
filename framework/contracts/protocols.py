"""The Protocol of each registry kind: the members a component of that kind provides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, runtime_checkable

from framework.contracts.kinds import Context, Tolerance
from framework.contracts.plan import PlanConstant, PlanTerms
from framework.errors import UserError


@runtime_checkable
class Component(Protocol):
    """Members every kind shares (see the module docstring)."""

    Options: ClassVar[type]
    NUMERICS: ClassVar[Mapping[str, Tolerance]]  # optional: {} (compare holds a switch of it to nothing)
    SKILL: ClassVar[str]  # optional: None (the docs/skills page is <name>.md, else the kind's)

    def check(self, options: Any, ctx: Context) -> None: ...

    def apply(self, options: Any, tc: Any, ctx: Context) -> None: ...


class Planned(Protocol):
    """Kinds the planner asks for their share of the estimate (loss, recompute, state, moe_comm, moe_chunk,
    precision, adapter, data). The model's share comes from its ``facts`` (``layer_kinds``: one ``LayerKind``
    per kind of layer); data says what the documents of its rows are (``facts.document_tokens``);
    launchers add none. ``PLAN_CONSTANTS`` (optional) are the
    component's own calibrated constants (``PlanConstant``)."""

    PLAN_CONSTANTS: ClassVar[Mapping[str, PlanConstant]]  # optional: {} (plans with no constant of its own)

    def plan_terms(self, options: Any, ctx: Context) -> PlanTerms: ...


class ModelFamily(Component, Protocol):
    """kind ``model``: a family module. ``FLAVORS`` names its sizes; ``facts`` sizes a flavor
    without building it; ``apply`` puts the model spec on ``tc``; ``model_kwargs`` are the
    ``model_config`` / ``facts`` arguments the recipe asks for.

    ``hf_writer(options, ctx)`` (optional: a family without it cannot publish weights, which
    resolve refuses before launch when ``publish.interval > 0``): called by ``framework.train.build`` on
    each rank, returns ``convert(state_dict) -> (hf_tensors, hf_config)``: a full (unsharded)
    torchtitan state dict of this recipe's model -> HF tensor name -> tensor, and the config.json
    dict, such that transformers' ``AutoModelForCausalLM.from_pretrained`` (and vLLM, SGLang) load
    the folder ``framework/train/publish.py`` writes from them.

    The other optional members (``OPTIONAL_MEMBERS["model"]``) are what the HF tools ask:
    ``HF_MODEL_TYPES`` (config.json ``model_type`` values the family reads: `apiary show`,
    `apiary logprobs`), ``export_hf(run_dir, out_path, *, step, dtype, shard_bytes)`` (`apiary export`:
    checkpoint ``step`` (None: the latest) in ``dtype``, in safetensors shards of at most
    ``shard_bytes``; returns the folder) and
    the pieces the shared HF helpers (``components/models/hf.py``, the adapters' export) build from:
    ``model_config``, ``arch_from_config`` / ``arch_of``, ``hf_config``, ``STATE_DICT_ADAPTER``,
    ``hf_key_shapes`` (a checkpoint key -> canonical (key, shape) pairs) and ``save_hf`` (a
    family's own writer, used instead of the generic one)."""

    FLAVORS: Mapping[str, Any]
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]]  # optional: ()
    LONG_CONTEXT_FLAVORS: ClassVar[Mapping[str, str]]  # optional: {} (flavor -> its RoPE scaling, for hints)
    STATE_DICT_ADAPTER: ClassVar[Any]  # optional: None (torchtitan's HF <-> torchtitan key adapter class)
    PLAN_CONSTANTS: ClassVar[Mapping[str, PlanConstant]]  # optional: {} (its layer kinds' calibrated constants)

    def model_kwargs(self, options: Any, ctx: Context) -> dict: ...

    def facts(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def model_spec(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def hf_writer(self, options: Any, ctx: Context) -> Any: ...

    def export_hf(self, run_dir: str, out_path: str, *, step: int | None = None, dtype: str = "bfloat16",
                  shard_bytes: int | None = None) -> Any: ...

    def model_config(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def arch_from_config(self, model_config: Any) -> Any: ...

    def arch_of(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def hf_config(self, arch: Any) -> dict: ...

    def hf_key_shapes(self, key: str, shape: tuple) -> list: ...

    def save_hf(self, state_dict: dict, arch: Any, out_path: str, model_config: Any) -> Any: ...


class ModelTypeNotRead(UserError):
    """Raised by a family's HF reader for a config.json whose ``model_type`` is not one of its
    ``HF_MODEL_TYPES``. ``framework.resolve`` names in the fix the registry's family that declares
    it (``framework.compose.registry.family_of``); elsewhere the fix points at `apiary show DIR`."""

    def __init__(self, where: str, model_type: str, family: str, fix: str = ""):
        self.model_type, self.family = model_type, family
        super().__init__(where, f"config.json has model_type={model_type}, which model.family={family} does not read.",
                         fix or f"Set model.family to the family that reads model_type={model_type} "
                         "(`apiary show DIR` names it).")


class Loss(Component, Planned, Protocol):
    """kind ``loss``: sets ``tc.loss``. ``NEEDS_DATA`` names the data kinds it trains on (its own
    ``check`` holds it); ``RL_KEYS`` the ``rl.*`` settings it acts on (resolve refuses the others
    when set); ``POLICY_OBJECTIVE`` whether it optimises a policy objective (its loss is no likelihood to
    minimise: the summary reports the reward). The object ``tc.loss`` builds is a ``LossFn``."""

    NEEDS_DATA: ClassVar[tuple[str, ...]]  # optional: None (not declared; the loss's check decides)
    RL_KEYS: ClassVar[tuple[str, ...]]  # optional: () (acts on no rl.* setting)
    POLICY_OBJECTIVE: ClassVar[bool]  # optional: False (a likelihood: the summary names its best loss)


class LossFn(Protocol):
    """Not a registry kind: the loss object torchtitan builds from ``tc.loss``, as the trainer asks
    it (``member(loss_fn, "loss_fn", NAME)``). A loss that reads per-token batch keys (the policy
    losses) has ``set_batch(batch, seq_group)``, called before each micro-batch's forward with the
    data's ``BATCH_KEYS`` / ``STEP_KEYS`` tensors (context-sharded) and the context-parallel group;
    after its forward, ``metrics`` (name -> scalar tensor; ``*_max`` keys are maxima) weighted by
    ``metric_weight`` (the micro-batch's trained tokens) are what the trainer logs."""

    metrics: Mapping[str, Any]  # optional: {}
    metric_weight: Any  # optional: None (nothing to log)

    def set_batch(self, batch: dict, seq_group: Any) -> None: ...  # optional: None (reads no batch keys)


class Recompute(Component, Planned, Protocol):
    """kind ``recompute``: sets ``tc.activation_checkpoint``; its ``plan_terms`` say what is kept.

    ``memory_budget(options) -> float | None`` (optional): the component plans by memory budget (its
    ``plan_terms`` list ``facts.candidates``, of which resolve has the planner choose one for
    ``apply``: ``ctx.derived``): the GPU memory it plans for, in GiB, or None for the run's GPU.
    Without it resolve chooses nothing for the component."""

    def memory_budget(self, options: Any) -> float | None: ...


class State(Component, Planned, Protocol):
    """kind ``state``: parameter / gradient / optimizer-state sharding (parallelize, optimizer).

    ``layout(options, dims) -> (dims, reason)`` (optional): the parallel degrees this backend runs,
    from the ones ``framework.resolve.layout.derive`` chose (a backend with no replicate/shard split folds
    one into the other). Resolve applies it right after deriving, before anything reads the layout,
    so layout.json, the printed dims, the planner and the trainer see the same degrees; it may move
    degrees between dims, never change the world size. ``reason`` is what layout.json's rules say
    for the dims it changed."""

    def layout(self, options: Any, dims: dict[str, int]) -> tuple[dict[str, int], str]: ...


class MoeComm(Component, Planned, Protocol):
    """kind ``moe_comm``: the expert-parallel dispatch/combine backend torchtitan runs; its ``plan_terms``
    add what the backend allocates besides the dispatch/combine buffers the planner counts from the
    model's shapes (e.g. a fixed communication buffer)."""

    torchtitan_backend: str


class Transport(Component, Planned, Protocol):
    """kind ``transport`` (``publish.transport``): how published weights reach the generator.
    ``IN_MEMORY``: False for HF folders only (framework/train/publish.py writes every version); True when
    ``sender(options, settings, trainer)`` (called on every rank once the trainer is built;
    ``settings``: framework.train.publish.PublishSettings) returns an object whose ``publish(trainer,
    version)`` (a collective) hands every version after the first to the engine, and ``close()``.
    Its ``plan_terms`` memory is what rank 0 holds for the hand-off (the planner adds it to the
    first stage)."""

    IN_MEMORY: ClassVar[bool]

    def sender(self, options: Any, settings: Any, trainer: Any) -> Any: ...


class MoeChunk(Component, Planned, Protocol):
    """kind ``moe_chunk``: edits the model spec's routed experts (overlap schedule)."""


class Adapter(Component, Planned, Protocol):
    """kind ``adapter``: converts the model spec before it is built (adapters on a frozen base) and
    its checkpoint; its ``plan_terms`` may replace the state backend's static terms by name
    (``facts.replace``), scale its buffers and traffic (``facts.buffer_scale``,
    ``facts.comm_scale``) and the optimizer step (``facts.trainable_fraction``).

    ``export_hf(run_dir, out_path, family, *, merged)`` (optional): `apiary export` of a run that
    trained adapters; returns (folder, what it holds): the adapters alone (PEFT's format) or, with
    ``merged``, the model with the adapters folded in.

    ``published_form(options, ctx)`` (optional): what weight publication (framework/train/publish.py) writes
    for a run with this adapter, a ``PublishedForm``; left out, or returning None, the model family's
    ``hf_writer`` (the whole model) is published."""

    def export_hf(self, run_dir: str, out_path: str, family: Any, *, merged: bool = False) -> tuple: ...

    def published_form(self, options: Any, ctx: Context) -> Any: ...


@dataclass(frozen=True)
class PublishedForm:
    """What one published version holds (framework/train/publish.py writes it as ``DIR/step-V``):
    ``convert`` maps the gathered state dict to (tensors, the config file's body); ``select`` picks
    the state-dict keys gathered (None: all); the tensors go to ``WEIGHTS.safetensors`` (sharded as
    ``WEIGHTS-0000i-of-0000n`` above the shard size when ``shardable``) and the body to ``config``;
    ``loader_files`` adds what a model loader reads beside the weights (tokenizer files,
    generation_config.json); ``describe`` names the form in the publication line."""

    convert: Callable[[dict], tuple[dict, dict]]
    select: Optional[Callable[[str], bool]] = None
    weights: str = "model"
    config: str = "config.json"
    shardable: bool = True
    loader_files: bool = True
    describe: str = "weights"


class Precision(Component, Planned, Protocol):
    """kind ``precision``: converts the model spec's linears and sets compile / hooks."""


class Data(Component, Planned, Protocol):
    """kind ``data``: sets ``tc.dataloader`` and ``tc.tokenizer``; ``summary`` is the run's first
    line (what it trains on); ``STEP_KEYS`` / ``BATCH_KEYS`` are what its batches carry beyond
    tokens and labels (the trainer forwards them to the loss)."""

    BATCH_KEYS: ClassVar[tuple[str, ...]]  # per token (context-parallel sharded like the tokens)
    STEP_KEYS: ClassVar[tuple[str, ...]]  # per sample (not sharded)

    def summary(self, options: Any, ctx: Context) -> str: ...

    def ignored_keys(self, options: Any, ctx: Context) -> Mapping[str, tuple[str, str]]:
        """Optional (None: the format reads every ``data.*`` key it is given): the ``data.*`` keys (and
        ``validation.*`` keys: a format with no held-out text) this format, with these options, does not
        read -> (what it reads instead, what to do). ``resolve`` refuses such a key given on the command
        line (a value the recipe sets stays accepted), before it asks for a setting another key needs."""
        ...


@runtime_checkable
class DataStepMetrics(Protocol):
    """A dataset with scalars of its own for each step's metrics.jsonl record (a static rollout file:
    the step's mean reward); a ``FollowedData`` has them too."""

    def step_metrics(self, step: int) -> dict[str, float]: ...  # "data/..." keys


@runtime_checkable
class FollowedData(Protocol):
    """A dataset that follows a growing folder (``data.follow``): the trainer asks, at each step's
    start, whether the next step's rows can be formed from what is there now (every rank alike; the
    trainer agrees on the answer over ranks, waits, and stops on a signal or a timeout), and after
    the step for what it consumed."""

    NOUN: str  # what it waits for, in the status line ("waiting for NOUN in DIR: 12 s")
    LEDGER: str  # the file in the run folder that lists, per step, the records it trained
    dir: Any  # the folder it follows (the DIR of the status line and of the stop messages)

    def ready(self) -> bool: ...  # the next step's rows can be formed now (ValueError: a malformed shard)

    def waiting_note(self) -> str: ...  # what the status line adds while waiting (drops, last shard)

    def held(self) -> str: ...  # what the folder holds of the step waited for, in words ("": nothing of it)

    def step_report(self, step: int) -> dict | None: ...  # the records step ``step`` trained, once

    def step_metrics(self, step: int) -> dict[str, float]: ...  # scalars for metrics.jsonl ("data/..." keys)


@dataclass
class LaunchEnv:
    """What the framework hands a launcher at launch (so launchers import nothing else of it)."""

    resolved: Any  # framework.resolve.resolver.Resolved: the run being launched
    supervise: Any  # supervise(cmd, env, nproc) -> exit code: run torchrun and forward stop signals
    # run_here() -> exit code: train ``resolved`` in this process (one rank; framework.train.run.train_here)
    run_here: Any = None
    # worker_env(argv=None) -> {name: value}: writes the resolved run into its folder and returns the
    # environment variables that hand it to the ranks a launcher starts as ``train argv`` (default: the
    # launch's argv); they load it instead of resolving again
    worker_env: Any = None
    warned: bool = False  # the launcher's preflight warnings were printed already (apiary launch)
    worker_module: str = "framework.launch.lifecycle"  # `python -m MODULE torchrun ...` starts torchrun quietly
    train_module: str = "framework.cli"  # `python -m MODULE train ARGS` is one rank


class Launcher(Component, Protocol):
    """kind ``launcher``: how ranks start (this machine, Slurm). ``RUNS_HERE``: the ranks run on
    this machine (its GPU is the one to check before launch)."""

    RUNS_HERE: ClassVar[bool]
    TEMPLATE: ClassVar[Any]  # optional: None (the script template `apiary cp-template` copies)

    def world_size(self, options: Any) -> int: ...

    def launch(self, options: Any, argv: list[str], env: LaunchEnv) -> int: ...

    # optional (None): checks of the launcher's own options before resolve (``check_options(options)``),
    # the launch's warnings (``preflight(options, resolved, *, dry_run) -> list[str]``) and, for a
    # launcher that submits a batch script (Slurm), the script (``render(options, resolved, argv, worker_env)
    # -> str``, ``worker_env`` as LaunchEnv's: a dry run's writes nothing; the job's rank 0 then takes the
    # run lock, not the launching process)
    def check_options(self, options: Any) -> None: ...

    def preflight(self, options: Any, resolved: Any, *, dry_run: bool = False) -> list[str]: ...

    def render(self, options: Any, resolved: Any, argv: list[str], worker_env: Any = None) -> str: ...
