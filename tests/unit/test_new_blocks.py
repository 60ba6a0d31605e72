"""Blocks of transformers 5.24's new families that the generic plan reads (issue 41): a decoder
away from ``base_model_prefix`` (Llama 4), a norm that is a block in other layers (AXK2), value
heads wider than query heads with KV heads changing by layer (MiMo-V2-Flash), per-layer embeddings
(Gemma 4), a causal LM mapped under another task (Mistral 4). The tp2 parity of each family is in
the grids (tests/unit/test_family_grid.py, test_moe_grid.py); here the readings and tp4."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import hf_tp
from hf_tp.adapters.generic import derive
from hf_tp.compat import family_refusal
from tests.family_grid import grid_config, run_family, run_family_ep

pytestmark = pytest.mark.skipif(
    not {"llama4_text", "axk2", "mimo_v2_flash", "gemma4_text", "mistral4"} <= set(CONFIG_MAPPING),
    reason="needs transformers 5.24's families",
)


def test_llama4_decoder_found_from_the_model() -> None:
    d = derive(grid_config("llama4_text"))
    assert d.layers_path == "model.layers"  # its base_model_prefix, language_model, names no module
    assert not d.plain_lm_head  # its get_decoder() is the whole model: the fused loss cannot call it


def test_axk2_norm_that_is_a_block_elsewhere_runs_as_the_block() -> None:
    d = derive(grid_config("axk2"))
    assert "post_attention_layernorm" not in d.layer_norms
    assert "weight" in d.region_params["post_attention_layernorm"]  # the dense layer's plain norm
    assert d.blocks["post_attention_layernorm"].replicated


LATER = {
    mt: pytest.mark.skipif(bool(family_refusal(mt)), reason=str(family_refusal(mt)))
    for mt in ("mimo_v2_flash", "mistral4", "llama4_text")
}


@LATER["mimo_v2_flash"]
def test_mimo_value_heads_and_kv_heads_by_layer() -> None:
    d = derive(grid_config("mimo_v2_flash"))
    assert set(d.kv) == {"self_attn.k_proj", "self_attn.v_proj"} and d.kv_vary
    config = grid_config("mimo_v2_flash", heads=8, kv=2)
    with pytest.raises(ValueError, match=r"tp \(4\) is over num_key_value_heads \(2\).*use tp <= 2"):
        hf_tp.get_adapter(config).validate(config, 4)


def test_gemma4_per_layer_embeddings_placed() -> None:
    d = derive(grid_config("gemma4_text"))
    assert d.top_embeddings == ("model.embed_tokens_per_layer",)
    assert d.top_linears == ("model.per_layer_model_projection",)
    assert "model.per_layer_projection_norm" in d.top_norms
    assert set(d.layer_linears) == {"per_layer_input_gate", "per_layer_projection"}


GEMMA4_MOE = dict(enable_moe_block=True, top_k_experts=2)  # 4 experts at grid sizes, 2 per token


def test_gemma4_moe_experts_the_layer_calls_itself() -> None:
    # its decoder layer calls router and experts itself on the flattened tokens: the experts are a
    # region of their own, the router and the layer's norms run per token on the rank's tokens
    d = derive(grid_config("gemma4_text", **GEMMA4_MOE))
    assert set(d.regions) == {"experts"} and d.regions["experts"].experts == ""
    assert {"router", "pre_feedforward_layernorm_2"} <= set(d.layer_linears) and not d.layer_norms
    adapter = hf_tp.get_adapter(grid_config("gemma4_text", **GEMMA4_MOE))
    assert adapter.moe and adapter.flattens_tokens and adapter.experts == ("experts",)


def test_gemma4_moe_tp2() -> None:
    # parity with generate: its one-token decode steps gather the token before the layer flattens it
    assert run_family("gemma4_text", **GEMMA4_MOE).status == "parity"


def test_gemma4_moe_ep2() -> None:
    run_family_ep("gemma4_text", **GEMMA4_MOE)


@LATER["mistral4"]
def test_mistral4_builds_as_a_causal_lm() -> None:
    assert type(_meta_model("mistral4")).__name__ == "Mistral4ForCausalLM"


@pytest.mark.parametrize(
    ("model_type", "kv"),
    [
        ("gemma4_text", 2),
        pytest.param("llama4_text", 2, marks=LATER["llama4_text"]),
        pytest.param("mimo_v2_flash", 4, marks=LATER["mimo_v2_flash"]),
    ],
)
def test_new_blocks_tp4(model_type: str, kv: int) -> None:
    # 8 heads at tp=4; 2 KV heads replicated on 2 ranks each where the layers allow it
    assert run_family(model_type, tp=4, heads=8, kv=kv).status == "parity"


def test_gemma4_per_layer_embeddings_under_tp2_dp2() -> None:
    # FSDP2 over dp=2 around the per-token styles: the per-layer embedding's vocab shards and the
    # replicated per-token projections (their Partial gradients reduced over tp, averaged over dp)
    run_family_ep("gemma4_text", ep=1, tp=2, dp=2)


@LATER["llama4_text"]
def test_llama4_estimate_counts_every_expert_on_every_token() -> None:
    from hf_tp.estimate.estimate_run import estimate

    moe = estimate(grid_config("llama4_text"), tp=2, dp=1, seq_len=16, batch_size=1).to_dict()["moe"]
    assert moe["top_k"] == 4  # each of the 4 experts runs every token


def test_gemma4_estimate_builds_outside_fake_tensors() -> None:
    # the derivation builds the meta model outside the estimate's FakeTensorMode (Gemma 4's layer
    # scalars are real tensors); the per-layer embedding is then simulated vocab-sharded
    from hf_tp.estimate.estimate_run import estimate

    est = estimate(grid_config("gemma4_text"), tp=2, dp=1, seq_len=16, batch_size=1)
    assert est.num_params == sum(p.numel() for p in _meta_model("gemma4_text").parameters())


def _meta_model(model_type: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(grid_config(model_type))


@pytest.mark.skipif(
    "qwen4_exp_text" not in CONFIG_MAPPING or bool(family_refusal("qwen4_exp_text")),
    reason="needs the transformers release that serves qwen4_exp_text (hf_tp.compat.FAMILY_RELEASES)",
)
def test_qwen4_estimate_takes_the_indexers_nonzero_at_its_bound() -> None:
    # its sparse-attention indexer lists each query's visible keys with nonzero, whose size fake
    # tensors cannot know: the estimate takes every key as visible (the largest tensors it can make)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_tp.estimate.estimate_run import estimate
    from hf_tp.estimate.simulate import DataDependentBounds

    with FakeTensorMode(), DataDependentBounds():
        assert torch.nonzero(torch.zeros(3, 5)).shape == (15, 2)
    est = estimate(grid_config("qwen4_exp_text"), tp=2, dp=1, seq_len=16, batch_size=1)
    assert est.num_params == sum(p.numel() for p in _meta_model("qwen4_exp_text").parameters())
