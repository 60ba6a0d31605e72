"""Wrappers whose language models take 3-D mrope positions (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE,
GLM-4V): the positions are built by the wrapper from the whole merged sequence, Qwen3-VL's
DeepStack features land on the sequence shards, and logits, loss, every trainable gradient and
an AdamW step equal plain transformers with images (tests/image_grid.py; the whole grid is
scripts/image_grid.py). Their language models have no causal LM of their own: alone, refused."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING

import hf_tp
from hf_tp.adapters.support import TEXT_TOWERS
from hf_tp.compat import family_refusal
from hf_tp.multimodal.passengers import in_tower
from tests.family_grid import grid_config
from tests.image_grid import ImageCase, image_config, run_image_cases
from tests.wrapper_grid import WrapperCase, run_cases


def _skip_unless(*model_types: str) -> None:
    for mt in model_types:
        if mt not in CONFIG_MAPPING:
            pytest.skip(f"this transformers has no {mt}")
        text = CONFIG_MAPPING[mt]().text_config.model_type
        if refusal := family_refusal(text):
            pytest.skip(refusal)


def test_text_tower_alone_is_refused_naming_its_wrapper() -> None:
    _skip_unless("qwen2_5_vl")
    assert "qwen2_5_vl_text" in TEXT_TOWERS and "qwen2_5_vl_text" not in hf_tp.supported_model_types()
    with pytest.raises(
        ValueError, match=r"'qwen2_5_vl_text' is the language model of a multimodal wrapper.*text_config"
    ):
        hf_tp.get_adapter(grid_config("qwen2_5_vl_text"))


def test_deepstack_mergers_train_with_the_projector() -> None:
    _skip_unless("qwen3_vl")
    config = image_config("qwen3_vl")
    adapter = hf_tp.get_adapter(config)
    assert adapter.language_model == "model.language_model"
    assert not in_tower(adapter, "model.visual.deepstack_merger_list.0.linear_fc1.weight")
    assert not in_tower(adapter, "model.visual.merger.linear_fc1.weight")
    assert in_tower(adapter, "model.visual.blocks.0.attn.qkv.weight")


def test_mrope_wrappers_on_text_at_tp2() -> None:
    # text-only rows: the wrapper's positions are the plain 0..S-1 on all three axes
    _skip_unless("qwen2_5_vl", "qwen3_vl")
    results = run_cases([WrapperCase("qwen2_5_vl"), WrapperCase("qwen3_vl")])
    assert [r.status for r in results] == ["parity"] * 2, [(r.model_type, r.reason) for r in results]


def test_mrope_wrappers_with_images_at_tp2_and_tp2_dp2() -> None:
    # Images of 6, 2, 4 and 4 tokens (4x6, 2x4, 4x4 patch grids) in rows of 2, 0, 1, 1 images:
    # 3-D positions from the whole rows, DeepStack features added after the first decoder layer,
    # greedy generate with images at tp2; the tower trained too at tp2 x dp2.
    _skip_unless("qwen2_5_vl", "qwen3_vl")
    cases = [ImageCase("qwen2_5_vl"), ImageCase("qwen3_vl"), ImageCase("qwen3_vl", dp=2, train_vision_tower=True)]
    diffs = run_image_cases(cases)
    assert all(max(d.values()) < 1e-5 for d in diffs.values()), diffs


def test_deepstack_merge_hf_tp_does_not_know_is_refused() -> None:
    # A merge that writes the features instead of adding them cannot become a sharded addition.
    from torch import nn

    from hf_tp.multimodal.deepstack import shard_deepstack

    class Writes(nn.Module):
        def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
            hidden_states = hidden_states.clone()
            hidden_states[visual_pos_masks, :] = visual_embeds
            return hidden_states

    with pytest.raises(ValueError, match=r"Writes's DeepStack merge on sequence shards.*sequence_parallel=False"):
        shard_deepstack(Writes())


def test_estimate_counts_deepstack_mergers_as_projector() -> None:
    # hf-tp estimate runs the parallelized wrapper on fake tensors: the DeepStack merge is checked
    # on real ones, and its mergers are trained projector weights.
    _skip_unless("qwen3_vl")
    from hf_tp.estimate import estimate
    from tests.wrapper_grid import wrapper_config

    config = wrapper_config("qwen3_vl")
    split = estimate(config, tp=2, dp=2, seq_len=64, batch_size=1, dtype="bf16")
    model = _meta_model(config)
    adapter = hf_tp.get_adapter(config)
    passengers = [(n, p.numel()) for n, p in model.named_parameters() if adapter.is_passenger(n)]
    assert split.projector_params == sum(k for n, k in passengers if not in_tower(adapter, n))
    assert any("deepstack_merger_list" in n for n, _ in passengers if not in_tower(adapter, n))


def _meta_model(config):
    import torch

    from hf_tp.core.model_source import model_from_config

    with torch.device("meta"):
        return model_from_config(config)


def test_packed_text_rows_keep_their_documents_apart() -> None:
    # hf_tp packs documents with position_ids that restart (no attention mask). Qwen2.5-VL expands
    # 2-D position_ids to its three rotary rows only, so its masks never see them; hf_tp hands them
    # over as transformers' 4-row packing form (text first), which plain HF is given here too.
    _skip_unless("qwen2_5_vl")
    import copy

    import torch

    from tests.helpers import run_threaded
    from tests.parity import assert_parity, train_steps
    from tests.wrapper_grid import wrapper_config, wrapper_model

    config = wrapper_config("qwen2_5_vl")
    ref = wrapper_model(config)
    candidates = [copy.deepcopy(ref) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 280, (2, 16), generator=g)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).expand(2, 16)
    data = {"input_ids": ids, "labels": ids, "position_ids": positions}
    four = {**data, "position_ids": positions[None].expand(4, 2, 16)}
    with torch.no_grad():
        apart, mixed = (ref(**d, use_cache=False).logits for d in (four, data))
    assert (apart - mixed).abs().max() > 1e-3  # the 2-D form lets the documents see each other
    # plain HF given the 4-row form at its entry (train_steps slices every input by rows)
    ref.register_forward_pre_hook(lambda _, args, kw: (args, {**kw, **four}), with_kwargs=True)
    want = train_steps(ref, data, steps=2)

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(candidates[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        got = train_steps(model, data, steps=2, ctx=hf_tp.loss_parallel)
        assert_parity(got, want)

    run_threaded(2, rank_fn)
