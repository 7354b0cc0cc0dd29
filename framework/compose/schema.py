"""The typed recipe: dataclasses used as OmegaConf structured configs.

Every key a recipe or a command line may set is declared here, once: the component groups
(``loss``, ``state``, ...) declare theirs in their ``Options`` dataclasses (bound through
registry.yaml); the sections several kinds share (``model``, ``data``, ``moe``) are declared here
only, and their components' ``Options`` hold the value checks (``contracts.make_options`` builds
them over these dataclasses). ``None`` in ``parallel`` means "derive it from the layout table in
recipes/_defaults.yaml".

A ``str`` key with a fixed set of values is declared with ``one_of``: OmegaConf 2.3's structured
configs take no ``Literal`` type (the components' ``Options`` use ``Literal``, which
``contracts.schema_of`` turns into its base type for OmegaConf), so the key stays ``str`` and its
choices ride in the field's metadata, where ``choices()`` finds them for framework/resolve/values.py.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

DEFAULT_RECIPE = "debug_moe"  # the recipe `train` and `apiary` compose without recipe=


def one_of(*names: str, default: str | None = None) -> Any:
    """A ``str`` field whose values are ``names`` (its default: ``default``, else the first): the
    field's choices (``choices()``), checked by framework/resolve/values.py before anything starts."""
    default = names[0] if default is None else default
    assert default in names, (default, names)
    return field(default=default, metadata={"choices": names})


def choices(cls: type | None = None, prefix: str = "") -> dict[str, tuple]:
    """Dotted key -> its values, for every ``one_of`` field of ``cls`` (default: the whole recipe)."""
    out: dict[str, tuple] = {}
    cls = RecipeConfig if cls is None else cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints.get(f.name)):
            out.update(choices(hints[f.name], f"{prefix}{f.name}."))
        elif "choices" in f.metadata:
            out[f"{prefix}{f.name}"] = f.metadata["choices"]
    return out


@dataclass
class ModelConfig:
    family: str = MISSING  # registry.yaml kind `model`
    flavor: str = MISSING  # the family's named size (registry.yaml kind `model`; set by the recipe)
    n_layers: Optional[int] = None  # truncate/extend the layer stack
    vocab_size: Optional[int] = None  # override the flavor's vocabulary
    attn_backend: str = "flex"  # flex | flex_flash (Hopper or Blackwell GPUs) | varlen (CUDA)
    # inductor max-autotune + coordinate descent for flex attention: off by default (on one H200 at 32K it
    # added 136 s to a cold step 1 and changed steady tok/s by under 2%; docs/benchmarks.md)
    flex_autotune: bool = False
    hf_checkpoint: Optional[str] = None  # HF model folder (config.json + safetensors) to start from; null: init (training.seed)


@dataclass
class ParallelConfig:
    gpus: Optional[int] = None  # GPU count the recipe is laid out for (--cfg job, plan); a launch uses its own
    dp_replicate: int = 1  # replicated copies of the model (HSDP's outer dim); 1: none
    dp_shard: Optional[int] = None  # FSDP degree: ranks each parameter is sharded over
    cp: Optional[int] = None  # context-parallel degree: ranks one sequence is split over (docs/skills/context_parallel.md)
    ep: Optional[int] = None  # expert-parallel degree: ranks the experts are spread over
    pp: Optional[int] = None  # pipeline-parallel degree: stages the layer stack is cut into
    tp: Optional[int] = None  # tensor-parallel degree: ranks each matmul is split over
    # torchtitan's context-parallel load balancers, checked whatever parallel.cp (a value a later CP run
    # would refuse is never kept)
    cp_load_balancer: str = one_of("headtail", "ptrr", "none")  # headtail (balanced causal attention) | ptrr | none (contiguous)
    pp_schedule: str = "1F1B"  # torch.distributed.pipelining schedule name (framework/resolve/values.py PP_SCHEDULES)
    pp_microbatch_size: int = 1  # parallel.pp > 1: sequences per pipeline microbatch (divides training.local_batch)


@dataclass
class TrainingConfig:
    steps: int = 20  # optimizer steps the run trains to
    seq_len: int = 256  # tokens per training sequence
    local_batch: int = 2  # sequences per rank per micro-step
    global_batch: Optional[int] = None  # sequences per optimizer step; None = local x data-parallel
    dtype: str = "bfloat16"  # compute (mixed-precision param) dtype: bfloat16 | float32
    max_norm: float = 1.0  # clip the gradients' global norm to this (inf: no clipping)
    seed: int = 42  # seeds the weights' initialisation and the random streams
    deterministic: bool = False  # torch's deterministic algorithms (torchtitan's debug.deterministic): slower
    cache_autotuning: bool = True  # keep Triton's autotuning results on disk across launches
    kernel_cache: Optional[str] = None  # Triton + inductor caches under this path (None: their defaults)
    autotune_configs: str = one_of(
        "recorded", "all")  # recorded: Triton tunes this GPU's recorded winners (framework/train/autotune_table.py) | all
    on_nonfinite: str = "stop"  # NaN/Inf loss or grad norm: stop (exit 76, nothing applied) | skip the update
    max_skips: int = 5  # on_nonfinite=skip: stop (as `stop`) when more steps than this in a row are non-finite


@dataclass
class DataConfig:
    format: str = "text"  # registry.yaml kind `data` (components/data/formats.py documents each option)
    name: str = "packaged"  # packaged | local | an HF hub dataset name
    path: Optional[str] = None  # local jsonl / parquet / txt file or folder (rollouts: jsonl / parquet)
    tokenizer: str = "byte"  # byte | path to a HF tokenizer folder
    num_workers: int = 0  # loader processes per rank: 0 (in the training process) or 1
    sharding: str = "blocks"  # blocks: same global batches for any DP size | documents: split docs by rank
    follow: bool = False  # rollouts: train on shards as a generator writes them into data.path (docs/rl.md)
    wait_timeout: float = 3600.0  # follow: seconds with no rollouts ready before checkpoint + exit 77


@dataclass
class MoEConfig:
    comm: str = "alltoall"  # registry.yaml kind `moe_comm`
    chunk: str = "none"  # registry.yaml kind `moe_chunk`
    load_balance_coeff: Optional[float] = 1e-3  # step of the routing bias that balances the experts' load; null: off
    routing_replay: bool = False  # route every MoE layer to the rollouts' routed_experts (docs/skills/routing_replay.md)
    # score the expert outputs without fp32 copies, same values (docs/skills/lean_combine.md); null: where it runs
    lean_combine: Optional[bool] = None


@dataclass
class RLConfig:
    """RL-loop settings that are not an objective's hyperparameter (docs/rl.md)."""

    max_lag: Optional[int] = None  # drop records whose policy_version is more than this many versions old
    tis_cap: Optional[float] = None  # truncated importance sampling: weight tokens by min(pi_train/pi_gen, C)
    mismatch_threshold: float = 0.1  # |logp_train - logp_gen| above this counts in policy/mismatch_frac


@dataclass
class PublishConfig:
    """Weights handed to a generator as HF folders (docs/skills/publish.md)."""

    interval: int = 0  # publish every N steps (and the initial weights at step 0); 0: off
    dir: Optional[str] = None  # default OUTPUT_DIR/weights
    keep: int = 3  # versions kept (the newest; `latest` always points at a complete one)
    background: str = "auto"  # auto | true | false: write the folder in a background thread
    dtype: Optional[str] = None  # bfloat16 | float16 | float32: the weights' dtype in the folder; null: as trained
    transport: str = MISSING  # registry.yaml kind `transport`: hf_folder (recipes/_defaults.yaml) | vllm_ipc | vllm_nccl
    engine: str = "127.0.0.1:0"  # in-memory transports: HOST:PORT rank 0 listens on for the engine (0: a free port)
    bucket_mb: int = 1024  # in-memory transports: MiB per transfer bucket
    engine_timeout: float = 600.0  # in-memory transports: seconds to wait for the engine to connect
    # in-memory transports: a version due while the last transfer is still landing waits for it (wait), or is
    # deferred (skip): the newest weights go once the engine is free, and at the latest before the trainer waits
    # for rollouts or ends
    when_busy: str = one_of("wait", "skip")


@dataclass
class OptimizerConfig:
    name: str = one_of("Adam", "AdamW", default="AdamW")  # torchtitan's optimizers that take the betas, eps and weight_decay here
    lr: float = 3e-4  # peak learning rate (after warm-up)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's denominator term
    weight_decay: float = 0.1  # weight decay (AdamW: decoupled; Adam: L2 in the gradient); 0: none


@dataclass
class ValidationConfig:
    interval: int = 0  # validate every N steps (and at the first and last step); 0: no validation
    steps: int = 1  # batches per validation pass (training.local_batch x seq_len tokens per rank each)
    path: Optional[str] = None  # held-out text (a file or folder, as data.path); or
    fraction: float = 0.0  # hold out the last fraction of the training text's documents (0 < f <= 0.5)


@dataclass
class LRConfig:
    warmup_steps: int = 2  # steps of linear warm-up to optimizer.lr; 0: none
    decay_ratio: Optional[float] = None  # None: decay over all steps after warm-up
    decay_type: str = one_of("linear", "sqrt", "cosine")  # the decay's shape from optimizer.lr to its floor
    min_lr_factor: float = 0.0  # the decay's floor, as a fraction of optimizer.lr
    total_steps: Optional[int] = None  # the schedule's length; null: training.steps (later steps keep its final rate)


@dataclass
class CheckpointConfig:
    enable: bool = True  # save checkpoints under OUTPUT_DIR/checkpoint (false: none)
    interval: int = 10  # save every N steps
    resume: bool = False  # continue from the latest checkpoint of output_dir (or the recipe's latest run)
    keep_latest_k: int = 3  # complete step-N folders kept (0: all); the oldest go as each new one completes
    load_step: Optional[int] = None  # resume from this complete step instead of the latest (checkpoint.resume)
    load_path: Optional[str] = None  # initial weights: a DCP step folder (e.g. a seed checkpoint)
    verify: bool = True  # false: load a step (resume or load_path) that has no manifest.json, unverified
    create_seed: bool = False  # one process: initialise, save step-0 weights, exit (shared start for A/Bs)
    model_only_last: bool = False  # the last save: weights only (for export); a resume goes on from the full step before


@dataclass
class LoggingConfig:
    log_freq: int = 1  # steps between metrics records
    tensorboard: bool = True  # write TensorBoard event files in the run folder
    wandb: bool = False  # log metrics to Weights & Biases too
    wandb_project: str = "apiary"  # logging.wandb: the W&B project
    color: bool = True  # colors in the console output


@dataclass
class PreflightConfig:
    memory: str = one_of(
        "refuse", "warn", "off")  # refuse | warn | off: the planner's per-GPU memory estimate against the GPU, before launch
    gpu: Optional[str] = None  # GPU kind to check against (H100 | H200) where none is visible; `gpu=H200` for short


@dataclass
class LayoutRule:
    max_params: float = MISSING  # models with at most this many total parameters ...
    ep: int = MISSING  # ... use this expert-parallel degree


@dataclass
class LayoutTable:
    """The 4D->2D table (seed 000) as data: applied to every unset parallel dim."""

    ep_by_params: list[LayoutRule] = field(default_factory=list)  # rules {max_params, ep}: EP by total parameters
    target_local_seq: int = 32768  # CP = global sequence / this, rounded up to a valid divisor
    pp: int = 1  # 2 is optional: peak performance, lower peak memory
    tp: int = 1  # only with a clear model or hardware reason


@dataclass
class RecipeConfig:
    recipe: str = DEFAULT_RECIPE  # the recipe composed (recipe=NAME or recipe=PATH.yaml)
    description: str = ""  # one line on the recipe (`apiary list` shows it)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: Any = MISSING  # component options; group `loss`
    state: Any = MISSING  # group `state`
    recompute: Any = MISSING  # group `recompute`
    launcher: Any = MISSING  # group `launcher`
    precision: Any = MISSING  # group `precision`: bf16 | fp8 (docs/skills/fp8.md)
    adapter: Any = MISSING  # group `adapter`: none | lora (docs/skills/lora.md)
    moe: MoEConfig = field(default_factory=MoEConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    layout: LayoutTable = field(default_factory=LayoutTable)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    output_dir: Optional[str] = None  # default runs/<recipe>/<timestamp>
    registry: Optional[str] = None  # a user registry file adding components from your own modules (framework/compose/registry.py)
