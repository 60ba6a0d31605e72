"""The grids' tiny configs from each family's default (published-shape) config
(:func:`hf_tp.adapters.shrink.shrink_config`): every layer kind the default builds is built by the
shrunk config too (same ``layer_types`` entry and module classes, on meta), every per-layer list
keeps its values, every width shrinks with the hidden size, and the model is tiny. The grid's
shrunk families (tests.family_grid.SHRUNK) and a sample of the rest."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from hf_tp.adapters.shrink import _is_head_width, _is_width, layer_kinds, shrink_config
from hf_tp.compat import family_refusal
from tests.family_grid import SHRUNK, grid_config
from tests.unit.test_default_shapes import FAMILIES

SAMPLE = sorted({*SHRUNK, *FAMILIES[::12]})


def _builds(config) -> list[str] | None:
    try:
        return layer_kinds(config)
    except (ValueError, TypeError, AttributeError):  # a default config transformers cannot build as is
        return None


@pytest.mark.parametrize("model_type", SAMPLE)
def test_a_shrunk_default_keeps_every_feature(model_type: str) -> None:
    if family_refusal(model_type):
        return
    default = AutoConfig.for_model(model_type)
    kinds = _builds(default)
    if kinds is None:
        assert model_type not in SHRUNK
        return
    small = shrink_config(default)
    assert set(layer_kinds(small)) == set(kinds)
    full, cut = default.to_dict(), small.to_dict()
    for key, value in full.items():
        if (
            isinstance(value, list)
            and len(value) == default.num_hidden_layers
            and all(isinstance(v, str) for v in value)
        ):
            assert set(map(str, cut[key])) == set(map(str, value)), key  # every kind of layer, mixer, indexer
    ratio = cut["hidden_size"] / full["hidden_size"]
    for key, value in full.items():
        if _is_width(key) and not _is_head_width(key) and isinstance(value, int) and value > 16 * 4:
            assert cut[key] <= max(4 * value * ratio, 8), f"{key} {value} -> {cut[key]}: not shrunk with hidden_size"
    assert cut["hidden_size"] <= 128 and small.num_hidden_layers <= 6


def test_the_flagships_widths_shrink_together() -> None:
    # Their attention widths stayed at the default (4096 / 1536) when only hidden_size shrank
    for model_type, keys in {
        "deepseek_v4": ("q_lora_rank", "o_lora_rank", "head_dim", "index_head_dim", "moe_intermediate_size"),
        "hy_v4": ("q_lora_rank", "kv_lora_rank", "v_head_dim", "index_head_dim", "intermediate_size"),
        "kimi_linear": ("kv_lora_rank", "linear_head_dim", "v_head_dim", "intermediate_size"),
    }.items():
        if family_refusal(model_type):
            continue
        config = grid_config(model_type)
        assert all(getattr(config, k) <= 4 * config.hidden_size <= 4 * 64 for k in keys), {
            k: getattr(config, k) for k in keys
        }
    if family_refusal("hy_v4") or family_refusal("deepseek_v4"):
        return  # (releases older than these families)
    hy = grid_config("hy_v4")
    assert set(hy.indexer_types) == {"full", "shared"} and set(hy.mlp_layer_types) == {"dense", "sparse"}
    ds = grid_config("deepseek_v4")
    assert set(ds.layer_types) == {"heavily_compressed_attention", "compressed_sparse_attention"}
    assert set(ds.mlp_layer_types) == {"hash_moe", "moe"} and ds.o_groups > 1 and ds.index_n_heads > 1
    # the sequence extents fall inside the grid's 13-token rows, so compression and selection run
    assert max(ds.compress_rates.values()) <= 13 and ds.sliding_window < 13 and ds.index_topk < 13 // 2
