"""`apiary export RUN --hf OUT [--merged]` of an adapter run.

Without ``--merged``: PEFT's LoRA format, as ``peft.PeftModel.from_pretrained(base, OUT)`` loads
it onto the HF model class of the base (``adapter_config.json`` + ``adapter_model.safetensors``):

- each adapted linear becomes the ``lora_A`` / ``lora_B`` of the HF module its rows land in. The
  family's state-dict adapter is run on marker tensors (each weight's shape, one id per row, a layer
  at a time: ``row_map``) to find, for every HF module, which torchtitan linear and row each of its
  rows comes from; B is carried through that row map, A as it is (llama3's HF conversion permutes
  wq's and wk's rows for its rotary layout: ``P W + P B A``, so lora_B's rows move with them).
  Where HF fuses several linears that apiary adapts separately (Qwen3.5's GatedDeltaNet
  ``in_proj_qkv``), the module's adapter is the exact block form: A stacked, B block diagonal, rank
  ``n x r`` and alpha ``n x alpha`` (the same alpha / rank), through PEFT's ``rank_pattern`` /
  ``alpha_pattern``;
- routed experts (transformers' fused ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``down_proj``
  [E, D, F]) become PEFT's parameter targets (``target_parameters``, one A/B pair per expert in
  PEFT's layout): ``gate_up_proj`` gets w1's and w3's adapters in block form (rank 2r, alpha 2
  alpha), ``down_proj`` w2's. PEFT's parameter adapters take no dropout, so ``lora_dropout`` is
  written 0 (dropout changes training only).

With ``--merged``: the base with every adapter folded in (``W + alpha/r B A``, fp32), written as the
family's HF folder (what ``apiary export`` writes for a full run).

The base comes from the checkpoint's pointer (``components.adapters.base``): an HF folder is the
PEFT base (``base_model_name_or_path``); a DCP base is written beside the adapter as ``OUT/base``
(an HF folder) and named there; a base initialised from a seed exists nowhere on disk and is refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import save_file

from components.adapters import modules, runtime
from components.adapters.base import BASE_FILE, _files, describe
from components.adapters.targets import is_adapter_param
from components.models import hf_export
from framework import contracts
from framework.errors import UserError

PEFT_PREFIX = "base_model.model."


def _where(run_dir) -> str:
    return f"apiary export {run_dir}"


EXPORTED_BASE = "apiary_base.json"  # beside a PEFT export: the HF base it was trained on, with checksums


def check_exported_base(adapter_dir, base_dir, where: str) -> None:
    """An exported adapter folder applies to the HF base it was trained on: the files its
    ``apiary_base.json`` fingerprints must be those of ``base_dir`` (UserError naming the first that
    differs). A folder without the file (another tool's adapter) is not checked (the fingerprint is
    the one a resume checks)."""
    f = Path(adapter_dir) / EXPORTED_BASE
    if not f.is_file():
        return
    saved = json.loads(f.read_text())["base"]["files"]
    have = _files(Path(base_dir), [n for n in saved if (Path(base_dir) / n).is_file()], None)
    for name, old in sorted(saved.items()):
        new = have.get(name)
        if new is None or new["hash"] != old["hash"] or new["size"] != old["size"]:
            raise UserError(where, f"{adapter_dir} holds adapters trained on another base: {Path(base_dir) / name} "
                            + ("is missing" if new is None else f"has checksum {new['hash']}, the adapters' base had "
                               f"{old['hash']}") + f" (recorded in {f.name}).",
                            f"Pass the base it was trained on ({json.loads(f.read_text())['base']['path']}).")


def _run(run_dir):
    run = Path(run_dir)
    cfg = OmegaConf.load(run / "config.yaml")
    step_dir = hf_export.latest_step(run)
    f = step_dir / BASE_FILE
    if not f.is_file():
        raise UserError(_where(run_dir), f"{step_dir} has no {BASE_FILE}: it is not an adapter checkpoint.",
                        "Export a full run without --merged.")
    return cfg, step_dir, json.loads(f.read_text())["base"]


def _family_config(family_mod, cfg):
    """The run's model config (its flavor, or the architecture of its model.hf_checkpoint)."""
    m = cfg.model
    return family_mod.model_config(m.flavor, n_layers=m.get("n_layers"), vocab_size=m.get("vocab_size"),
                                   load_balance_coeff=None,  # an adapter run's routing bias is the base's, frozen
                                   hf_checkpoint=m.get("hf_checkpoint"))


def _spec(cfg) -> tuple[modules.LoRASpec, list]:
    a = cfg.adapter
    return (modules.LoRASpec(rank=int(a.rank), alpha=float(a.alpha), dropout=float(a.dropout), init=str(a.init),
                             dtype=str(a.dtype), seed=int(cfg.training.seed)), list(a.targets))


def _meta(config):
    with torch.device("meta"):
        return copy.deepcopy(config).build()


def load_adapters(family_mod, cfg, step_dir) -> dict:
    """The checkpoint's adapters by state-dict key (fp32, CPU)."""
    spec, targets = _spec(cfg)
    converted, _ = modules.convert(_family_config(family_mod, cfg), spec, targets)
    model = _meta(converted)
    sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items() if is_adapter_param(k)}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    return sd


def base_state_dict(family_mod, cfg, pointer: dict, run_dir) -> tuple[dict, object]:
    """(the base's torchtitan state dict in fp32, its model config)."""
    if pointer["kind"] == "hf":
        config = _family_config(family_mod, cfg)  # its hf_checkpoint is the pointer's folder
        model = _meta(config)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_states(buffer_device=torch.device("cpu"))
        return {k: v.float() for k, v in model.state_dict().items()}, config
    if pointer["kind"] == "dcp":
        config = _family_config(family_mod, cfg)
        model = _meta(config)
        params = {n for n, _ in model.named_parameters()}
        sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()
              if k in params or k.endswith((".wq.weight", ".wk.weight", ".wv.weight"))}
        dcp.load(sd, checkpoint_id=pointer["path"], no_dist=True)
        return sd, config
    raise UserError(_where(run_dir), f"the adapters were trained on {describe(pointer)}, a base that exists on no "
                    "disk, so nothing can rebuild it under them (no PEFT or merged folder, no scoring).",
                    "Train adapters on a base folder (model.hf_checkpoint=DIR) or a saved step (checkpoint.load_path=...).")


def write_hf(family_mod, cfg, config, state_dict: dict, out) -> Path:
    """A torchtitan state dict of the run's architecture -> the family's HF folder."""
    if contracts.member(family_mod, "model", "save_hf") is not None:  # qwen3_5: its own text-only writer
        m = cfg.model
        arch = family_mod.arch_of(m.flavor, n_layers=m.get("n_layers"), vocab_size=m.get("vocab_size"),
                                  hf_checkpoint=getattr(config, "hf_checkpoint", None))
        return Path(family_mod.save_hf(state_dict, arch, str(out), config))
    arch = family_mod.arch_from_config(config)
    return Path(hf_export.save(state_dict, config, family_mod.STATE_DICT_ADAPTER, family_mod.hf_config(arch), out))


# ---------------------------------------------------------------------------- the row map


def row_map(family_mod, config, base_sd: dict) -> dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """HF module -> [(torchtitan weight key, rows of that weight, rows of the HF module they land in)]
    for every 2-D linear weight, found by converting marker tensors to HF: a weight's marker has its
    shape, every element of row i holding i's id (one id per row), so an adapter that reshapes with the
    model's widths (llama3's q/k row permutation views wq/wk as [heads, head_dim/2, 2, dim]) moves whole
    rows as it moves the weight's. A marker is a broadcast view (no memory) until an adapter copies it;
    the groups convert one layer at a time (``hf_export.export_groups``: an adapter fuses or splits
    within a layer), so at most one layer's permuted weights are ever materialised (fp32 ids, exact)."""
    keys = [k for k, v in base_sd.items() if v.dim() == 2 and k.endswith(".weight") and not k.startswith("tok_embeddings")]
    out: dict[str, list] = {}
    adapter = family_mod.STATE_DICT_ADAPTER(config, None)
    for group in hf_export.export_groups(keys):
        offsets, start = {}, 0
        for k in group:
            offsets[k] = (start, base_sd[k].shape[0])
            start += base_sd[k].shape[0]
        dtype = torch.float32 if start <= 2 ** 24 else torch.float64  # every id exact
        markers = {k: torch.arange(s, s + n, dtype=dtype)[:, None].expand(n, base_sd[k].shape[1])
                   for k, (s, n) in offsets.items()}
        owner = torch.empty(start, dtype=torch.long)
        for i, k in enumerate(group):
            s, n = offsets[k]
            owner[s:s + n] = i
        for hk, t in adapter.to_hf(markers).items():
            if t.dim() != 2 or not hk.endswith(".weight") or t.shape[0] == 0:
                continue
            ids = t[:, 0]
            if not torch.equal(ids, t[:, -1]):  # rows are not whole markers' rows (not a row-wise move)
                continue
            ids = ids.round().long()
            module = hk[: -len(".weight")]
            for i in torch.unique(owner[ids]).tolist():
                k = group[i]
                hf_rows = torch.nonzero(owner[ids] == i, as_tuple=True)[0]
                src_rows = ids[hf_rows] - offsets[k][0]
                out.setdefault(module, []).append((k, src_rows, hf_rows))
    return out


def unplaced(adapters: dict, rmap: dict) -> list[str]:
    """The adapted linears (torchtitan weight keys) whose rows land in no HF module: the family's HF
    form has no such weight (e.g. a head tied to the embeddings, which its adapter drops), so no PEFT
    or merged folder would carry their adapters. Launch refuses the known case; this keeps an export
    or a publication from leaving an adapter out silently."""
    placed = {k for parts in rmap.values() for k, _, _ in parts}
    keys = {runtime.base_key(k)[0] for k in adapters if k.rsplit(".", 1)[1].startswith("lora_A")
            and not k.endswith(("_w1", "_w2", "_w3"))}
    return sorted(keys - placed)


def _refuse_unplaced(adapters: dict, rmap: dict, where: str) -> None:
    lost = unplaced(adapters, rmap)
    if lost:
        raise UserError(where, f"the adapters of {', '.join(lost)} have no place in the HF format of this model "
                        "(no HF weight takes those rows), so the HF folder would leave them out.",
                        "Train without those targets (adapter.targets).")


def _peft_tensors(adapters: dict, rmap: dict, base_sd: dict, r: int, hf_modules: dict) -> tuple[dict, dict]:
    """PEFT's lora_A / lora_B of every HF linear whose rows some adapter feeds; {module: sources}."""
    by_weight: dict[str, dict] = {}
    for k, a in adapters.items():
        leaf = k.rsplit(".", 1)[1]
        if not leaf.startswith("lora_A") or leaf.endswith(("_w1", "_w2", "_w3")):
            continue
        b = adapters[k.rsplit(".", 1)[0] + "." + leaf.replace("lora_A", "lora_B")]
        by_weight[runtime.base_key(k)[0]] = {"A": a, "B": b}
    tensors, sources = {}, {}
    for module, parts in rmap.items():
        fed = [(k, src, dst) for k, src, dst in parts if k in by_weight]
        if not fed:
            continue
        out_rows = hf_modules[module][0]
        in_dim = by_weight[fed[0][0]]["A"].shape[1]
        A = torch.cat([by_weight[k]["A"] for k, _, _ in fed])
        B = torch.zeros(out_rows, r * len(fed))
        for j, (k, src, dst) in enumerate(fed):
            B[dst, j * r:(j + 1) * r] = by_weight[k]["B"][src]
        assert A.shape[1] == in_dim
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.contiguous()
        sources[module] = len(fed)
    return tensors, sources


def _expert_tensors(adapters: dict, r: int) -> tuple[dict, list]:
    """PEFT's parameter adapters of transformers' fused experts, one A/B pair per expert in PEFT's layout
    (A rows e*rank + j, B columns j*E + e); gate_up_proj (w1 then w3 rows) at rank 2r, down_proj at r."""
    tensors, layers = {}, []
    for k in sorted(adapters):
        if not k.endswith(".lora_A_w1"):
            continue
        prefix = k[: -len(".lora_A_w1")]  # layers.N.moe.routed_experts.inner_experts
        layer = int(prefix.split(".")[1])
        A1, B1, A3, B3, A2, B2 = (adapters[f"{prefix}.lora_{x}"] for x in ("A_w1", "B_w1", "A_w3", "B_w3", "A_w2", "B_w2"))
        E, Fh, D = B1.shape[0], B1.shape[1], A1.shape[2]
        A_gu = torch.cat([A1, A3], dim=1).reshape(E * 2 * r, D)  # [E, 2r, D] -> rows e*2r + j
        B_gu = torch.zeros(2 * Fh, 2 * r, E)  # [out, rank, E] -> columns j*E + e
        B_gu[:Fh, :r] = B1.permute(1, 2, 0)
        B_gu[Fh:, r:] = B3.permute(1, 2, 0)
        A_d = A2.reshape(E * r, A2.shape[2])
        B_d = B2.permute(1, 2, 0).reshape(B2.shape[1], r * E)
        mod = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts"
        # PEFT nests the two parameter wrappers: gate_up_proj's is the inner one (base_layer)
        tensors[f"{mod}.base_layer.lora_A.weight"] = A_gu.contiguous()
        tensors[f"{mod}.base_layer.lora_B.weight"] = B_gu.reshape(2 * Fh, 2 * r * E).contiguous()
        tensors[f"{mod}.lora_A.weight"] = A_d.contiguous()
        tensors[f"{mod}.lora_B.weight"] = B_d.contiguous()
        layers.append(layer)
    return tensors, layers


def _suffix(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 else module


def peft_config(cfg, sources: dict, experts: bool, base_path: str | None, all_modules: list[str]) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for these adapters."""
    a = cfg.adapter
    r, alpha = int(a.rank), float(a.alpha)
    suffixes = sorted({_suffix(m) for m in sources})
    # a suffix must name adapted modules only (else list the modules themselves)
    clash = [m for m in all_modules if m not in sources and _suffix(m) in suffixes]
    targets = sorted(sources) if clash else suffixes
    rank_pattern, alpha_pattern = {}, {}
    for s in suffixes:
        n = {sources[m] for m in sources if _suffix(m) == s}
        if n != {1}:
            (k,) = n
            rank_pattern[s], alpha_pattern[s] = r * k, alpha * k
    if experts:
        rank_pattern["gate_up_proj"], alpha_pattern["gate_up_proj"] = 2 * r, 2 * alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0 if experts else float(a.dropout),
        "target_modules": targets, "target_parameters": (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
                                                         if experts else None),
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": "gaussian" if str(a.init) == "gaussian" else True, "use_rslora": False,
        "modules_to_save": None, "inference_mode": True,
    }


def published_form(cfg, family_mod) -> contracts.PublishedForm:
    """What weight publication writes for a LoRA run (``publish.interval > 0``): each version is the
    adapters alone in PEFT's format, the files `apiary export RUN --hf OUT` writes
    (``adapter_config.json`` + ``adapter_model.safetensors``) for the base folder
    ``model.hf_checkpoint``, which transformers + peft and vLLM's LoRA loading apply to that base.
    Only the adapters are gathered (a few MB, where the whole model is GBs); the row map is found at
    the first version, from the base's shapes (meta tensors). Tensors keep the gathered dtype
    (``publish.dtype`` casts them)."""
    base_path = str(Path(cfg.model.hf_checkpoint).absolute())
    r = int(cfg.adapter.rank)
    found: dict = {}

    def convert(sd: dict) -> tuple[dict, dict]:
        if not found:
            config = _family_config(family_mod, cfg)
            rmap = row_map(family_mod, config, _meta(config).state_dict())
            found.update(rmap=rmap, modules={m: (sum(len(dst) for _, _, dst in parts),) for m, parts in rmap.items()})
        dtype = next(iter(sd.values())).dtype if sd else torch.float32
        adapters = {k: v.float() for k, v in sd.items()}
        _refuse_unplaced(adapters, found["rmap"], "publish")
        tensors, sources = _peft_tensors(adapters, found["rmap"], {}, r, found["modules"])
        expert_tensors, layers = _expert_tensors(adapters, r)
        tensors.update(expert_tensors)
        body = peft_config(cfg, sources, bool(layers), base_path, sorted(found["rmap"]))
        return {k: v.to(dtype).contiguous() for k, v in tensors.items()}, body

    return contracts.PublishedForm(convert=convert, select=is_adapter_param, weights="adapter_model",
                                   config="adapter_config.json", shardable=False, loader_files=False,
                                   describe="adapters")


def export_hf(run_dir, out_path, family_mod, merged: bool = False) -> tuple[Path, str]:
    """(the folder written, a note for the console): PEFT's adapter folder, or with ``merged`` the
    merged HF folder (module docstring)."""
    cfg, step_dir, pointer = _run(run_dir)
    base_sd, config = base_state_dict(family_mod, cfg, pointer, run_dir)  # a base on no disk: refused first
    adapters = load_adapters(family_mod, cfg, step_dir)
    out = Path(out_path)
    r, alpha = int(cfg.adapter.rank), float(cfg.adapter.alpha)
    rmap = row_map(family_mod, config, base_sd)
    _refuse_unplaced(adapters, rmap, _where(run_dir))
    if merged:
        with torch.no_grad():
            merged_sd = runtime.merge_into({k: v.float() for k, v in {**base_sd, **adapters}.items()}, alpha / r)
        folder = write_hf(family_mod, cfg, config, merged_sd, out)
        hf_export.warn_routing_bias(_meta(config), step_dir) if pointer["kind"] == "dcp" else None
        return folder, f"merged: the base of {describe(pointer)} + alpha/r x B A of {step_dir.name}"
    base_path = pointer["path"] if pointer["kind"] == "hf" else None
    note = ""
    if base_path is None:  # a DCP base: written beside the adapter as an HF folder, and named there
        base_path = str(write_hf(family_mod, cfg, config, base_sd, out / "base").resolve())
        note = f"; its base (from {pointer['path']}) as an HF folder in {out / 'base'}"
    hf_modules = {m: (sum(len(dst) for _, _, dst in parts),) for m, parts in rmap.items()}
    tensors, sources = _peft_tensors(adapters, rmap, base_sd, r, hf_modules)
    expert_tensors, layers = _expert_tensors(adapters, r)
    tensors.update(expert_tensors)
    if not tensors:
        raise UserError(_where(run_dir), "no adapter maps onto an HF module.", "Check adapter.targets.")
    body = peft_config(cfg, sources, bool(layers), base_path, sorted(rmap))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(body, indent=2))
    if pointer["kind"] == "hf":  # the base's fingerprint: `apiary logprobs BASE --adapter OUT` checks it
        (out / EXPORTED_BASE).write_text(json.dumps({"base": pointer}, indent=2))
    if layers and float(cfg.adapter.dropout) > 0:
        note += f"; lora_dropout written 0 (PEFT's expert adapters take none; training used {cfg.adapter.dropout})"
    return out, (f"PEFT LoRA adapter (rank {r}, alpha {alpha:g}) for {base_path}: {len(sources)} modules"
                 + (f" + routed experts of {len(layers)} layers" if layers else "") + note)
