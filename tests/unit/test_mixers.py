"""Blocks whose mixer kind changes by layer (issue 41): Nemotron-H's ``mixer`` (Mamba-2, attention,
MLP or MoE by layer index) and MiniMax's ``self_attn`` (lightning linear attention or softmax
attention). Each layer's block gets its kind's plan (hf_tp/adapters/mixers.py, styles/choice.py).
Their tp2 and ep2 parity (with generate) is in tests/unit/test_moe_grid.py; here the readings,
tp4 with KV heads replicated in the attention layers only, and tp2 x ep2."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import PrepareModuleInput
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import hf_tp
from hf_tp.adapters.generic import derive
from hf_tp.compat import family_refusal
from hf_tp.core.forward_source import AS_CALLED, hidden_states_passing
from hf_tp.dropout.dropout_install import runs_whole
from hf_tp.moe.expert_styles import DenseOrMoE, MoERegion
from hf_tp.styles import ByKind, resolve
from tests.family_grid import grid_config, run_family, run_family_ep

FAMILIES = ("nemotron_h", "minimax")
pytestmark = pytest.mark.skipif(
    any(mt not in CONFIG_MAPPING or family_refusal(mt) for mt in FAMILIES),
    reason="needs transformers 5.24's Nemotron-H and MiniMax",
)


def _meta_model(model_type: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(grid_config(model_type))


def test_nemotron_h_mixer_read_per_kind() -> None:
    d = derive(grid_config("nemotron_h"))
    kinds = d.mixers["mixer"]
    assert set(kinds) == {"NemotronHMamba2Mixer", "NemotronHAttention", "NemotronHMLP"}
    assert kinds["NemotronHMamba2Mixer"].block.replicated and "in_proj.weight" in kinds["NemotronHMamba2Mixer"].params
    assert not kinds["NemotronHAttention"].block.replicated and not kinds["NemotronHMLP"].block.replicated
    assert "mixer" in d.regions  # the MoE kind: an expert-TP region
    assert {"mixer.q_proj", "mixer.up_proj"} <= set(d.colwise) and set(d.kv) == {"mixer.k_proj", "mixer.v_proj"}
    # the layer calls its mixer by keyword as attention, by position otherwise
    layer = _meta_model("nemotron_h").model.layers[0]
    assert hidden_states_passing(layer, "mixer") == AS_CALLED


def test_each_layer_gets_its_kinds_plan() -> None:
    for model_type, path in (("nemotron_h", "mixer"), ("minimax", "self_attn")):
        config = grid_config(model_type)
        entry = hf_tp.get_adapter(config).layer_plan(hf_tp.PlanOptions())[path]
        for layer in _meta_model(model_type).model.layers:
            module = layer.get_submodule(path)
            style = resolve(entry, module)
            kind = type(module).__name__
            if hasattr(module, "experts"):
                assert isinstance(style, MoERegion), kind
            elif "Mamba" in kind or "Lightning" in kind:  # runs whole: gathered, sliced back, parameters replicated
                assert runs_whole(style), kind
            else:  # split by heads or features: the gathered input stays a DTensor
                assert isinstance(style, PrepareModuleInput) and not style.use_local_output, kind
    assert isinstance(hf_tp.get_adapter(grid_config("nemotron_h")).layer_plan(hf_tp.PlanOptions())["mixer"], DenseOrMoE)


def test_a_kind_the_plan_did_not_see_is_named() -> None:
    with pytest.raises(ValueError, match=r"no style for a Linear here \(it knows A, B\)"):
        ByKind({"A": None, "B": None}).select(torch.nn.Linear(2, 2))


def test_nemotron_h_tp4_replicates_kv_heads_of_its_attention_layers_only() -> None:
    # 8 heads, 2 KV heads at tp=4: the attention layer's KV heads replicated on 2 ranks each; the
    # Mamba, MLP and MoE layers under the same name have no KV heads to replicate
    assert run_family("nemotron_h", tp=4, heads=8, kv=2).status == "parity"


def test_nemotron_h_tp2_ep2() -> None:
    # experts split over tp and placed whole over ep in its MoE layer, the other kinds as at tp2
    run_family_ep("nemotron_h", tp=2)


def test_minimax_under_bf16_mixed_precision_is_refused_before_anything_is_built() -> None:
    # its lightning attention mixes fp32 decay buffers with bf16 compute: a RuntimeError deep in
    # the forward otherwise (hf-tp train checks the same before launch)
    from hf_tp.estimate.estimate_run import estimate

    with pytest.raises(ValueError, match=r"bf16 mixed precision cannot train this minimax model: .*--dtype fp32"):
        estimate(grid_config("minimax"), tp=2, dp=1, seq_len=16, batch_size=1, dtype="bf16")


def test_lora_on_every_kind_of_minimax_attention() -> None:
    # LoRA on softmax attention (split with its heads) and on lightning attention (whole on every
    # rank, its factors replicated): the ByKind entry's kinds are LoRA-aware, each in its layers
    from tests.family_grid import grid_model
    from tests.lora_grid import attention_targets, lora, run_lora

    model = grid_model(grid_config("minimax", vocab_size=300))
    assert run_lora(lora(model, attention_targets(model)), tp=2)["lora"] == 14
