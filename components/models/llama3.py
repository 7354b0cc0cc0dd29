"""Llama 3 family (dense) on torchtitan's Llama 3 model."""

from __future__ import annotations

from torchtitan.models import llama3 as tt_llama3
from torchtitan.protocols.model_spec import ModelSpec

from components.models import common

FLAVORS = tt_llama3.llama3_configs


def model_config(flavor: str, *, attn_backend: str = "flex", moe_comm_backend: str = "standard",
                 n_layers: int | None = None, vocab_size: int | None = None,
                 load_balance_coeff: float | None = 1e-3):
    config = FLAVORS[flavor](attn_backend=attn_backend)
    config = common.resize_layers(config, n_layers)
    config = common.set_vocab(config, vocab_size)
    config = common.set_load_balance(config, load_balance_coeff)
    return common.use_device_attention(config)


def model_spec(flavor: str, **kwargs) -> ModelSpec:
    spec = tt_llama3.model_registry("debugmodel")
    spec.flavor = flavor
    spec.model = model_config(flavor, **kwargs)
    return common.wrap_parallelize(spec)


def facts(flavor: str, **kwargs) -> common.ModelFacts:
    return common.facts_from_config("llama3", flavor, model_config(flavor, **kwargs))
