"""Hyper-connections (issue 41): a residual of several streams per token, mixed by small modules
inside and after the decoder layers (DeepSeek-V4, HY-V4, Qwen4-Exp). The tp2 parity (generate
included) and ep2 parity of each family are in tests/unit/test_moe_grid.py; here the reading,
tp4, and FSDP2 around the mixers."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING

import hf_tp
from hf_tp.adapters.generic import derive
from hf_tp.compat import family_refusal
from hf_tp.styles import HyperConnectionLayer, HyperConnectionOnShards
from tests.family_grid import grid_config, run_family, run_family_ep

FAMILIES = ("deepseek_v4", "hy_v4", "qwen4_exp_text")
pytestmark = pytest.mark.skipif(
    not set(FAMILIES) <= set(CONFIG_MAPPING) or any(family_refusal(mt) for mt in FAMILIES),
    reason="needs transformers 5.24's hyper-connection families",
)


@pytest.mark.parametrize(
    ("model_type", "layer", "top"),
    [
        ("deepseek_v4", ("attn_hc", "ffn_hc"), ("model.hc_head",)),
        ("hy_v4", ("attn_hc", "ffn_hc"), ("model.hc_head",)),
        ("qwen4_exp_text", ("attn_hyper_connection", "mlp_hyper_connection"), ("model.hyper_connection_mixer",)),
    ],
)
def test_mixers_read_off_the_model(model_type: str, layer: tuple, top: tuple) -> None:
    d = derive(grid_config(model_type))
    assert d.layer_mixers == layer and d.top_mixers == top
    # transformers' split of Qwen4-Exp's mixer projection (rowwise_split_input) is not used: they run whole
    assert not [p for p in d.rowwise + d.colwise if p.split(".", 1)[0] in layer]
    plan = hf_tp.get_adapter(grid_config(model_type)).layer_plan(hf_tp.PlanOptions())
    assert all(isinstance(plan[p], HyperConnectionOnShards) for p in layer)
    assert list(plan)[-1] == "" and isinstance(plan[""], HyperConnectionLayer)  # applied last: its hooks run last


def test_a_plain_residual_has_no_mixers() -> None:
    # A block left whole that reads twice the hidden size is not a mixer (no final mix beside the layers)
    d = derive(grid_config("deepseek_v3", intermediate_size=128))
    assert d.layer_mixers == () and d.top_mixers == ()
    assert "" not in hf_tp.get_adapter(grid_config("deepseek_v3")).layer_plan(hf_tp.PlanOptions())


@pytest.mark.parametrize("aux", [True, False])
@pytest.mark.parametrize("model_type", ["deepseek_v4", "hy_v4"])
def test_every_gradient_equals_plain_hf_in_float64(model_type: str, aux: bool) -> None:
    # Their default configs shrunk whole (compressed and indexed attention, hash-routed layers, HY-V4's shared
    # indexer, the mixers' widths), with the aux loss on and off. They compute their mixers, routers and
    # norms in fp32 by construction: the grid runs those in float64 too (tests.helpers.float64_everywhere).
    # There every gradient, the hyper-connection scales (hc_head.hc_scale, attn_hc.fn) included, is plain
    # HF's to float64 round-off, where fp32 islands left 1e-5 of hc_head.hc_scale's (1.9e-4 in fp32).
    result = run_family(model_type, aux=aux)
    assert result.status == "parity" and result.grad_error < 1e-10, result


def test_deepseek_v4_tp4() -> None:
    # 8 heads at tp=4; a one-token decode step leaves three ranks without tokens (generate checks it)
    assert run_family("deepseek_v4", tp=4, heads=8, kv=8).status == "parity"


def test_hyper_connections_under_tp2_dp2() -> None:
    # FSDP2 over dp=2 around the layer's hooks; the fp32 mixers of this float64 model (and the fp32
    # final mix in the root unit) stay whole on every dp rank, their gradients averaged over dp
    run_family_ep("hy_v4", ep=1, tp=2, dp=2, exact=False)


def test_verify_draws_a_valid_hash_routing_table() -> None:
    # DeepSeek-V4's tid2eid (token -> its experts) is zeros until a checkpoint loads it: every token
    # twice to expert 0, the gate's gradient round-off (hf-tp verify failed on it); drawn as a trained
    # table is, distinct experts per token, while the other buffers stay as the init makes them
    from hf_tp.verify.random_model import random_model

    config = grid_config("deepseek_v4")
    model = random_model(config, seed=0)
    tables = {n: b for n, b in model.named_buffers() if n.endswith("tid2eid")}
    assert tables
    for table in tables.values():
        assert table.min() >= 0 and table.max() < config.n_routed_experts
        assert all(len(set(row.tolist())) == table.shape[1] for row in table)
