"""The summary's note on its export suggestion: a run that trained a routing bias (``moe.load_balance_coeff``,
auxiliary-loss-free balancing) exports without it, since HF MoE configs have none, so the exported model
may route some tokens differently (``apiary export`` warns the same when it writes the folder)."""

from __future__ import annotations

from omegaconf import OmegaConf

from framework.resolve.context import model_facts

NOTE = "the MoE routing bias is not in the HF format: it may route differently; moe.load_balance_coeff=null for exact"


def routing_bias_note(cfg) -> str | None:
    """NOTE for a full-training run of a model with experts and a routing bias; None otherwise (a dense
    model, balancing off, an adapter run: its bias is the base's, frozen; a config that no longer resolves)."""
    if cfg is None or OmegaConf.select(cfg, "moe.load_balance_coeff") is None:
        return None
    if str(OmegaConf.select(cfg, "adapter.name", default="none") or "none") != "none":
        return None
    try:
        facts = model_facts(cfg)
    except Exception:  # noqa: BLE001 - a moved hf_checkpoint, an old config: the summary must still print
        return None
    return NOTE if facts is not None and facts.num_experts else None
