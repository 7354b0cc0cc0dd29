"""The 4D->2D table applied to unset dims, and every constraint as a user error."""

import pytest
from omegaconf import OmegaConf

from components.models.common import ModelFacts
from framework.compose.recipes import load
from framework.errors import UserError
from framework.resolve.layout import derive

TABLE = load("debug_moe").layout


def facts(n_params=35e9, experts=256, layers=40):
    return ModelFacts(family="m", flavor="f", n_layers=layers, dim=2048, vocab_size=1000, n_params=int(n_params),
                      n_active_params=1, n_expert_params=1, num_experts=experts, top_k=8, moe_hidden_dim=512,
                      ffn_hidden_dim=0, n_heads=16, n_kv_heads=2, head_dim=256, n_attention_layers=10)


def par(**kw):
    base = dict(gpus=None, dp_replicate=1, dp_shard=None, cp=None, ep=None, pp=None, tp=None)
    base.update(kw)
    return OmegaConf.create(base)


def train(seq):
    return OmegaConf.create({"seq_len": seq, "local_batch": 1, "global_batch": None})


def test_table_defaults_for_the_seed_case():
    lay = derive(par(), train(131072), TABLE, facts(), 32)
    assert (lay.ep, lay.cp, lay.pp, lay.tp, lay.dp_shard) == (8, 4, 1, 1, 8)
    assert "34" not in lay.rules["cp"] and "32768 tokens per GPU" in lay.rules["cp"]


def test_ep_32_above_100b_and_capped_on_small_worlds():
    assert derive(par(), train(131072), TABLE, facts(n_params=397e9, experts=512), 64).ep == 32
    small = derive(par(), train(256), TABLE, facts(n_params=1e6, experts=8), 2)
    assert small.ep == 2 and "only 2 ranks" in small.rules["ep"]
    assert derive(par(), train(256), TABLE, facts(experts=0), 4).ep == 1
    one = derive(par(), train(256), TABLE, facts(n_params=1e6, experts=8), 1)
    assert one.ep == 1 and "only 1 rank in" in one.rules["ep"], one.rules  # singular (was "only 1 ranks")


def test_cp_rounds_up_to_a_divisor():
    lay = derive(par(), train(131072), TABLE, facts(), 24)  # room 24: want 4 -> 4
    assert lay.cp == 4 and lay.dp_shard == 6
    lay = derive(par(), train(98304), TABLE, facts(), 32)  # want 3 -> 4 (3 does not divide 32)
    assert lay.cp == 4


@pytest.mark.parametrize("kw,world,seq,needle", [
    (dict(ep=32), 24, 131072, "EP 32 must divide dp_shard x cp x tp"),
    (dict(ep=3), 24, 131072, "does not divide the model's 256 experts"),
    (dict(cp=3), 24, 131072, "not divisible by 2 x cp = 6"),
    (dict(dp_shard=3, cp=4), 32, 131072, "not the world size 32"),
    (dict(pp=3), 24, 131072, "PP 3 does not divide the model's 40 layers"),
    (dict(), 2, 131072, "CP must be at least 4"),
])
def test_impossible_dims_are_user_errors(kw, world, seq, needle):
    with pytest.raises(UserError) as e:
        derive(par(**kw), train(seq), TABLE, facts(), world)
    assert needle in str(e.value)
    assert e.value.exit_code == 2
