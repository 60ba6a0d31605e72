"""The mixture-of-experts grid: every MoE family of the installed transformers holds parity with
plain HF at tp=2 (logits, LM + aux loss, every gradient including the routers', AdamW weights,
``model.generate`` greedy tokens) or is refused with a clear ``ValueError``; and every supported
one holds it with expert parallelism at ep=2.

Each tiny model has 4 experts, 2 per token, and an aux-loss weight of 0.5, so a router gradient
that counted the aux loss once per tp rank fails the gradient check (checked by mutation)."""

from __future__ import annotations

import re

import pytest
from transformers import CONFIG_MAPPING

import hf_tp
from hf_tp.adapters.census import tensor_parallel_causal_lm_types
from hf_tp.adapters.support import MOE, REFUSED
from tests.family_grid import grid_config, needs_later_release, run_family, run_family_ep

# transformers' MoE families with a tp plan, and those hf_tp writes one for (GPT-OSS)
# (support.py may name families an older transformers lacks: those are not run)
INSTALLED_MOE = sorted(mt for mt in MOE if mt in CONFIG_MAPPING)
MIXTURES = sorted({mt for mt, moe in tensor_parallel_causal_lm_types().items() if moe} | set(INSTALLED_MOE))
# Experts that take every token, scaled by the router (Llama 4): nothing for EP's all-to-all to route
EVERY_EXPERT_ON_EVERY_TOKEN = ("llama4_text",)
ISSUE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granitemoe", "phimoe")


@pytest.mark.parametrize("model_type", MIXTURES)
def test_moe_family_tp2(model_type: str) -> None:
    if needs_later_release(model_type):  # refused naming the release (hf_tp.compat.FAMILY_RELEASES)
        return
    if model_type in REFUSED:
        with pytest.raises(ValueError, match="register_adapter"):
            hf_tp.get_adapter(grid_config(model_type))
        return
    result = run_family(model_type)
    if model_type in MOE:
        assert result.status == "parity", result.reason
    else:  # a family newer than support.py: parity or a clear refusal
        assert result.status == "parity" or "hf_tp cannot derive" in result.reason, result.reason


@pytest.mark.parametrize("model_type", INSTALLED_MOE)
def test_moe_family_ep2(model_type: str) -> None:
    # Every supported family's experts placed on 2 dp ranks, tokens moved by all-to-all.
    if needs_later_release(model_type):
        return
    if model_type in EVERY_EXPERT_ON_EVERY_TOKEN:  # no routed tokens to move: ep refused, naming why
        with pytest.raises(AssertionError, match=r"ValueError: ep=2 cannot place the experts .* every expert on every"):
            run_family_ep(model_type)
        return
    run_family_ep(model_type)


def test_fp32_router_in_a_float64_model_under_tp_ep_and_fsdp() -> None:
    # Ernie 4.5's router is built in fp32 inside this float64 model: FSDP2 cannot put both dtypes
    # in one unit, so the router stays whole on every dp rank (hf_tp.parallel.fsdp) while the
    # MoE region reads its weights; tp2 x dp2 with ep 2.
    run_family_ep("ernie4_5_moe", tp=2, exact=False)


def test_gpt_oss_tp2_ep2() -> None:
    # GPT-OSS's experts' biases under both splits: gate_up_proj_bias sharded with its columns over
    # tp and whole experts over ep, down_proj_bias added once per expert (1/tp on each tp rank).
    run_family_ep("gpt_oss", tp=2)


def test_moe_tables() -> None:
    assert not set(MOE) & set(REFUSED)
    assert set(MOE) <= set(hf_tp.supported_model_types())
    assert set(ISSUE_FAMILIES) <= set(MOE)
    assert len(MOE) >= 35


def test_moe_tp4() -> None:
    # tp=4: the 32-wide expert intermediate split 4 ways (8 rows of gate and of up per rank).
    assert run_family("qwen3_moe", tp=4, heads=8, kv=4).status == "parity"


@pytest.mark.parametrize("model_type", ["olmoe", "granitemoe"])
def test_whole_attention_needs_no_kv_split_at_tp4(model_type: str) -> None:
    # 2 KV heads at tp=4: OLMoE's attention is gathered (transformers' plan), Granite-MoE's has no
    # plan and runs whole; neither splits KV heads, so tp need not fit them (it was refused).
    if needs_later_release(model_type):
        return
    assert run_family(model_type, tp=4, heads=8, kv=2, hidden_size=128).status == "parity"


def test_linear_attention_heads_need_not_divide_tp() -> None:
    # Qwen3-Next's gated delta-net projections are gathered (colwise_gather_output) and the layer
    # runs whole: 6 value / 3 key heads split 4 ways unevenly, tp=4 (it was refused).
    sizes = dict(hidden_size=96, linear_num_value_heads=6, linear_num_key_heads=3)
    assert run_family("qwen3_next", tp=4, heads=8, kv=4, **sizes).status == "parity"


@pytest.mark.parametrize(
    ("model_type", "sizes", "path"),
    [
        ("qwen3_moe", dict(moe_intermediate_size=33), "model.layers.*.mlp.experts.gate_up_proj"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=33), "model.layers.*.mlp.shared_expert.gate_proj"),
    ],
)
def test_expert_widths_not_divisible_by_tp_name_the_parameter(model_type: str, sizes: dict, path: str) -> None:
    from hf_tp.run.validate import validate_model_config

    if needs_later_release(model_type):
        return
    config = grid_config(model_type, **sizes)
    with pytest.raises(ValueError, match=f"tp must divide the 33 features that {re.escape(path)} splits"):
        validate_model_config(config, tp=2, seq_len=16)


@pytest.mark.skipif("beam" not in CONFIG_MAPPING, reason="this transformers has no Beam (added in 5.21)")
def test_tp2_ep2_held_out_sizes() -> None:
    # Sizes the grid does not use: 6 heads (3 per tp rank, 1 KV head each), 96 hidden, 48-wide
    # experts. Beam computes its softmax, expert activations and router in fp32 inside this float64
    # model, so a few near-zero gradients carry fp32 round-off (the Adam check allows for that).
    run_family_ep("beam", tp=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, moe_intermediate_size=48)
