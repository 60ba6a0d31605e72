"""The family grid: every dense family of the installed transformers holds parity with plain HF
at tp=2 (logits, loss, every gradient, AdamW weights, ``model.generate`` greedy tokens) or is
refused with a clear ``ValueError``; nothing crashes inside torch or diverges silently."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING, AutoConfig

import hf_tp
from hf_tp.adapters import registry
from hf_tp.adapters.census import plan_less_causal_lm_types, tensor_parallel_causal_lm_types
from hf_tp.adapters.generic import generic_adapter
from hf_tp.adapters.support import GENERIC, MOE, READ_REFUSED, REFUSED
from hf_tp.plan.plan_text import format_plan
from tests.family_grid import grid_config, needs_later_release, run_family

DENSE = sorted(mt for mt, moe in tensor_parallel_causal_lm_types().items() if not moe)
# families transformers gives no tp plan whose plan hf_tp reads from their modules
READ = sorted(set(GENERIC) & set(plan_less_causal_lm_types()))


@pytest.mark.parametrize("model_type", DENSE)
def test_family_tp2(model_type: str) -> None:
    if needs_later_release(model_type):  # refused naming the release (hf_tp.compat.FAMILY_RELEASES)
        return
    result = run_family(model_type)
    if model_type in REFUSED:
        assert result.status == "refused", f"{model_type} is listed as refused but holds parity: update support.py"
        assert REFUSED[model_type] in result.reason and "register_adapter" in result.reason, result.reason
    elif model_type in GENERIC or model_type in registry.registered_model_types():
        assert result.status == "parity", result.reason
    else:  # a family newer than support.py: the derivation decides, but only parity or a clear refusal
        assert result.status == "parity" or "hf_tp cannot derive" in result.reason, result.reason


@pytest.mark.parametrize(
    "model_type", [mt for mt in ("granite", "exaone4", "granite_swa", "lfm3") if mt in CONFIG_MAPPING]
)
def test_family_tp4_replicated_kv_heads(model_type: str) -> None:
    # 8 heads, 2 KV heads at tp=4: each KV head on 2 ranks (the generic plan's K/V projections).
    if needs_later_release(model_type):
        return
    assert run_family(model_type, tp=4, heads=8, kv=2).status == "parity"


@pytest.mark.parametrize(
    ("model_type", "features"),
    [
        ("olmo", dict(clip_qkv=0.5)),  # q/k/v clamped in place
        ("cohere", dict(use_qk_norm=True)),  # per-head norm weights [heads, head_dim]: refused, not wrong
        ("phi", dict(qk_layernorm=True)),  # q/k LayerNorms over head_dim outside the tp plan: refused
        ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0)),
    ],
)
def test_family_optional_features(model_type: str, features: dict) -> None:
    result = run_family(model_type, **features)
    assert result.status == "parity" or "hf_tp cannot derive" in result.reason, result.reason


def test_gathered_projections_split_unevenly_at_tp3() -> None:
    # Phi-3's packed gate_up_proj (200 wide) and down_proj (100 in) are gathered projections
    # (transformers' colwise_gather_output / rowwise_split_input): their shards may be uneven
    # (67/67/66), as the vocab's are, since the region between them runs whole. Refused before.
    sizes = dict(hidden_size=96, intermediate_size=100, head_dim=16)
    assert run_family("phi3", tp=3, heads=6, kv=3, **sizes).status == "parity"


def test_support_tables_are_consistent() -> None:
    assert not set(GENERIC) & set(REFUSED)
    assert not set(GENERIC) & set(registry.registered_model_types())
    assert set(hf_tp.supported_model_types()) == set(GENERIC) | set(MOE) | set(registry.registered_model_types())
    # this transformers' dense families hf_tp trains (39 at the floor, 5.17: its MoE families whose tp
    # plan names no experts count as MoE from their ep plan, hf_tp.adapters.census.is_mixture)
    assert len(set(DENSE) - set(REFUSED)) >= 39


def test_refusal_names_module_and_fix() -> None:
    with pytest.raises(ValueError, match=r"'hrm_text': two nested decoder stacks .*register_adapter"):
        hf_tp.get_adapter(grid_config("hrm_text"))
    # A family the tables do not know is refused by the derivation, naming the module.
    with pytest.raises(ValueError, match=r"'doge'.*input_residual.*register_adapter"):
        generic_adapter(grid_config("doge"))


def test_olmo2_width_norms_refuse_replicated_kv_heads() -> None:
    config = grid_config("olmo2", heads=8, kv=2)
    with pytest.raises(ValueError, match=r"tp \(4\) is over num_key_value_heads \(2\).*use tp <= 2"):
        hf_tp.get_adapter(config).validate(config, 4)


def test_plan_naming_the_input_embedding() -> None:
    # transformers >= 5.24 puts the input embedding in some plans (GPT-OSS, GPT-J): hf_tp's top plan
    # vocab-shards it anyway. A plan with nothing else leaves the layers whole: refused, not guessed.
    from hf_tp.adapters.generic import derive

    config = grid_config("helium")
    layers = dict(config.base_model_tp_plan)
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", **layers}
    assert derive(config).embedding == "model.embed_tokens"
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}
    with pytest.raises(ValueError, match=r"'helium': its tp plan shards only the embedding.*register_adapter"):
        derive(config)


@pytest.mark.skipif("codegen" not in CONFIG_MAPPING, reason="this transformers has no CodeGen")
def test_codegen_qkv_groups_bound_tp() -> None:
    # CodeGen's qkv_proj holds 4 head groups (mp_num, a constant of its code): tp=4 splits whole
    # groups, tp=8 would split one and is refused before any shape error.
    if needs_later_release("codegen"):
        return
    assert run_family("codegen", tp=4, heads=8, kv=8).status == "parity"
    result = run_family("codegen", tp=8, heads=16, kv=16)
    assert result.status == "refused" and "mp_num" in result.reason and "use tp in 1, 2, 4" in result.reason


@pytest.mark.parametrize("model_type", READ)
def test_family_read_from_modules_tp2(model_type: str) -> None:
    # No tp plan in transformers: q/k/v and the MLP's up projections column-parallel, the output and
    # down projections row-parallel, read off the modules and forwards; three AdamW steps.
    if needs_later_release(model_type):  # (below the release a family needs, refused naming it)
        return
    assert get_adapter_of(model_type).read_from_modules
    result = run_family(model_type, steps=3)
    assert result.status == "parity", result.reason


def get_adapter_of(model_type: str) -> hf_tp.Adapter:
    return hf_tp.get_adapter(grid_config(model_type))


@pytest.mark.parametrize(
    ("model_type", "sizes"),
    [
        # 8 heads, 2 KV heads at tp=4 (each KV head on 2 ranks: num_key_value_heads becomes 1); the MLP
        # as wide as the hidden size, so its down projection is told from gate and up by call order alone
        ("stablelm", dict(heads=8, kv=2, hidden_size=128, intermediate_size=128)),
        ("opt", dict(heads=8)),
    ],
)
def test_read_from_modules_tp4(model_type: str, sizes: dict) -> None:
    assert run_family(model_type, tp=4, **sizes).status == "parity"


def test_read_from_modules_tables() -> None:
    assert {"opt", "xglm", "biogpt", "gpt_neo", "stablelm", "persimmon"} <= set(READ)
    assert not set(READ_REFUSED) & set(GENERIC)


@pytest.mark.parametrize("model_type", sorted(READ_REFUSED))
def test_plan_less_family_refused_naming_what_is_missing(model_type: str) -> None:
    # fused q|k|v whose interleaving the module does not show, ALiBi built for every head, cross-attention
    config = AutoConfig.for_model(model_type, **TINY.get(model_type, TINY["*"]))
    with pytest.raises(ValueError, match="register_adapter") as caught:
        hf_tp.get_adapter(config)
    assert READ_REFUSED[model_type] in str(caught.value), caught.value


TINY = {
    "*": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=301),
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, vocab_size=301),
}


def test_per_head_norm_modules_refused() -> None:
    # StableLM's qk_layernorm: one LayerNorm per head in a ModuleList; a rank's local head i is not head i
    with pytest.raises(ValueError, match=r"'stablelm': self_attn.q_layernorm.norms holds one module per attention"):
        hf_tp.get_adapter(grid_config("stablelm", qk_layernorm=True))


def test_plan_says_it_was_read_from_the_modules() -> None:
    text = format_plan(hf_tp.plan_for(grid_config("opt"), tp=2, seq_len=64))
    assert "its projections read from its modules, transformers has no tp plan" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "colwise, all-gather the sequence in" in rows["fc1"]
    assert "output all-reduced" in rows["fc2"]  # OPT's layer adds it to its flattened tokens
    assert "all-reduce      tp  fc2: output" in text
