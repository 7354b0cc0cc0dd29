"""Recorded autotuning winners: Triton benchmarks only the configs that won on this GPU architecture.

Triton's autotuner compiles and times every config a kernel lists, once per new shape key, on every
cold machine. fla's linear-attention kernels list many configs each; on one H200 a cold 32K
Qwen3.5 step spent 166.6 s of its 183 s there (docs/benchmarks.md, "Time to first step"). A
table recorded on one GPU of an architecture (``autotune_tables/sm90.json`` for Hopper) holds, per
kernel and tuning key, the configs within ``within`` of the fastest (at most ``max``). With
``training.autotune_configs=recorded`` (the default) a kernel whose key is in the table is tuned
over those configs only: one config means no benchmarking at all, Triton's own rule. A kernel
whose key is not in the table (other shapes) is tuned over the union of its recorded winners when
that union holds at least two configs (so a config that does not fit the new shape loses the
benchmark instead of failing), and over all its configs otherwise; so is every kernel the table
does not name, and every config a newer kernel no longer lists is ignored.
``training.autotune_configs=all`` tunes every config (what a table is recorded from).

Record a table: run the recipe once with ``training.autotune_configs=all
training.kernel_cache=KC`` (``apiary warmup`` does), then ``apiary autotune-table KC --out FILE``;
it reads Triton's autotuning results in the cache (TRITON_CACHE_AUTOTUNING keeps them,
``training.cache_autotuning``). docs/skills/autotune_table.md says how the shipped table was made.
"""

from __future__ import annotations

import json
import logging
from datetime import date
from pathlib import Path

from framework import compat
from framework.train import kernel_cache

TABLES = Path(__file__).parent / "autotune_tables"
WITHIN = 0.02  # keep configs within 2% of the fastest median time ...
MAX_KEEP = 2  # ... at most this many
_log = logging.getLogger(__name__)


class Counts:
    """What the table did in this process (first step's line and metrics: autotune_pruned)."""

    def __init__(self):
        self.exact = self.union = 0  # lookups answered by the table: the key's own winners, or the union

    def count(self, how: str) -> None:
        if how == "exact":
            self.exact += 1
        elif how == "union":
            self.union += 1


COUNTS = Counts()
_ACTIVE: dict | None = None  # {kernel: {key json: [config str, ...]}} in use (None: prune nothing)


def arch() -> str | None:
    """'sm90' for the current CUDA device (Hopper), None without one."""
    try:
        import torch  # reason: kept off `import framework.train.autotune_table` for the toolkit's export
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def load(name: str | None, tables: Path = TABLES) -> dict:
    """The shipped table for architecture ``name`` ({} when none is shipped or it does not parse)."""
    if not name:
        return {}
    path = tables / f"{name}.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {str(k): {str(kk): list(vv) for kk, vv in v.items()} for k, v in data["kernels"].items()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        _log.warning("apiary: autotuning table %s is unreadable (%s); every config is tuned", path, e)
        return {}


def tuning_key(tuner, kwargs: dict) -> str:
    """Triton's tuning key for this call (Autotuner.run's rule), as the JSON the cache stores."""
    args = {**(tuner.nargs or {}), **kwargs}
    args = {k: v for k, v in args.items() if k in tuner.arg_names}
    key = [args[k] for k in tuner.keys if k in args]
    key += [str(v.dtype) for v in args.values() if hasattr(v, "dtype")]
    return json.dumps(key)


def choose(recorded: dict[str, list[str]] | None, configs: list, key: str) -> tuple[list, str]:
    """The configs to tune and why: 'exact' (this key's winners), 'union' (the kernel's winners over
    other keys, at least two), 'all' (nothing usable recorded)."""
    if not recorded:
        return configs, "all"
    by_name = {str(c): c for c in configs}
    if key in recorded:
        kept = [by_name[s] for s in recorded[key] if s in by_name]
        if kept:
            return kept, "exact"
    names = list(dict.fromkeys(s for winners in recorded.values() for s in winners if s in by_name))
    if len(names) >= 2:
        return [by_name[s] for s in names], "union"
    return configs, "all"


def _pruned(original):
    def prune_configs(self, kwargs):
        configs = original(self, kwargs)
        if _ACTIVE is None:
            return configs
        name = getattr(kernel_cache.jit_function(self), "__name__", "")
        kept, how = choose(_ACTIVE.get(name), configs, tuning_key(self, kwargs))
        COUNTS.count(how)
        return kept

    return prune_configs


def install(mode: str, table: dict | None = None) -> int:
    """Use ``table`` (default: the shipped one for this GPU) when ``mode`` is 'recorded'; prune
    nothing when 'all'. Returns the number of kernels the table names (0: nothing pruned)."""
    global _ACTIVE
    if mode not in ("recorded", "all"):
        raise ValueError(f"training.autotune_configs={mode}: must be recorded or all")
    if mode == "all":
        _ACTIVE = None
        return 0
    table = load(arch()) if table is None else table
    if not table:
        _ACTIVE = None
        return 0
    if not compat.prune_autotune_configs(_pruned):
        return 0
    _ACTIVE = table
    return len(table)


def export(cache_dir: Path, within: float = WITHIN, max_keep: int = MAX_KEEP) -> dict:
    """A table from Triton's autotuning results under ``cache_dir`` (a ``training.kernel_cache``
    or a Triton cache directory): per kernel and key, the configs within ``within`` of the fastest
    median, at most ``max_keep``. Where one kernel and key were tuned over different config lists,
    the longest list counts (a full tuning rather than a pruned one)."""
    best: dict[tuple[str, str], list] = {}
    for path in sorted(Path(cache_dir).rglob("*.autotune.json")):
        try:
            data = json.loads(path.read_text())
            key = json.dumps(data["key"])
            timings = [(_config_name(cfg), float(t[0] if isinstance(t, list) else t))
                       for cfg, t in data["configs_timings"]]
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            _log.warning("apiary: skipping unreadable autotuning result %s (%s)", path, e)
            continue
        name = path.name[: -len(".autotune.json")]
        if len(timings) > len(best.get((name, key), ())):
            best[(name, key)] = timings
    kernels: dict[str, dict[str, list[str]]] = {}
    for (name, key), timings in sorted(best.items()):
        finite = sorted((t, c) for c, t in timings if t == t and t != float("inf"))
        if not finite:
            continue
        fastest = finite[0][0]
        kernels.setdefault(name, {})[key] = [c for t, c in finite if t <= fastest * (1 + within)][:max_keep]
    return kernels


def _config_name(d: dict) -> str:
    """str(triton.Config) of a config as the cache stores it (its __dict__; Triton's own reader
    rebuilds it the same way)."""
    from triton import Config  # reason: optional dependency: triton

    return str(Config(**d))


def write(kernels: dict, out: Path, source: str, within: float = WITHIN, max_keep: int = MAX_KEEP) -> dict:
    """Write a table file (what ``load`` reads) with where it came from."""
    try:
        import triton  # reason: optional dependency: triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    doc = {"arch": arch(), "device": _device_name(), "triton": triton_version, "recorded": date.today().isoformat(),
           "source": source, "within": within, "max_keep": max_keep, "kernels": kernels}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return doc


def _device_name() -> str | None:
    try:
        import torch  # reason: as in arch()

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        return None
