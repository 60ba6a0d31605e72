"""Multimodal wrappers on text: a sample of the wrapper grid (tests/wrapper_grid.py; the whole grid
is scripts/wrapper_grid.py) holds parity with plain transformers on the same wrapper at tp=2 and
tp2 x dp2, in one threaded world per size (--ep and --cp on wrappers: test_wrapper_ep.py,
test_wrapper_cp.py)."""

from __future__ import annotations

import pytest

import hf_tp
from hf_tp.adapters.census import multimodal_wrapper_types
from hf_tp.parallel.api import check_compile
from tests.helpers import run_threaded
from tests.image_grid import ImageCase, run_image_cases
from tests.wrapper_grid import WrapperCase, run_cases, wrapper_config, wrapper_model, wrapper_types

# One wrapper per kind of language model: Llama (LLaVA), Gemma 3 (its own adapter, scaled
# embedding), Mistral (Mistral 3: Pixtral tower), Qwen3.5 (hybrid linear attention), Llama under
# SmolVLM (a text_model, not a language_model), Gemma 4 (its forward mixes the vocab-sharded
# embedding's pad row into the whole sequence, and embeds per layer outside its language model).
TP2 = ("llava", "gemma3", "mistral3", "qwen3_5", "smolvlm", "gemma4")
TP2_DP2 = ("llava", "gemma3", "gemma4")


def test_wrapper_sample_at_tp2_and_tp2_dp2() -> None:
    cases = [WrapperCase(mt) for mt in TP2] + [WrapperCase(mt, dp=2) for mt in TP2_DP2]
    results = run_cases(cases)
    assert [r.status for r in results] == ["parity"] * len(cases), [(r.model_type, r.reason) for r in results]


def test_census_finds_the_wrappers() -> None:
    found = multimodal_wrapper_types()
    assert {"gemma3": "gemma3_text", "llava": "llama", "qwen3_5": "qwen3_5_text"}.items() <= found.items()
    assert len(wrapper_types()) >= 40  # wrappers whose language model hf_tp trains (52 in transformers 5.24)


def test_wrapper_with_its_own_loss_is_refused() -> None:
    # Qwen2-Audio's forward takes a cross entropy of its own over the attention mask's tokens.
    if "qwen2_audio" not in multimodal_wrapper_types():
        pytest.skip("this transformers has no Qwen2-Audio")
    with pytest.raises(ValueError, match=r"multimodal qwen2_audio checkpoint: .*computes its own cross entropy"):
        hf_tp.get_adapter(wrapper_config("qwen2_audio"))


def test_images_at_tp2_and_tp2_dp2() -> None:
    # Image features merge into the full sequence before the language model's entry splits it:
    # logits, loss, every trainable gradient (projector, language model; the vision tower too
    # when asked), an AdamW step, and greedy generate with images at tp2; activation checkpointing
    # (each decoder layer seen to run again in backward).
    cases = [
        ImageCase("llava"),
        ImageCase("mistral3"),
        ImageCase("smolvlm"),
        ImageCase("gemma3", dp=2),
        ImageCase("llava", dp=2, train_vision_tower=True, ac=True),  # the tower's layers recomputed too
    ]
    diffs = run_image_cases(cases)
    assert all(max(d.values()) < 1e-5 for d in diffs.values()), diffs


def test_compile_on_a_wrapper_compiles_its_language_model_layers() -> None:
    # Each of the language model's decoder layers, none of the tower's. The compiled step's parity
    # (inductor on CPU: a minute) is scripts/image_grid.py --compile llava.
    config = wrapper_config("llava")
    models = [wrapper_model(config) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"), compile=True)
        compiled = {n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
        layers = hf_tp.get_adapter(config).layers_path
        assert compiled == {f"{layers}.{i}" for i in range(config.text_config.num_hidden_layers)}, compiled

    run_threaded(2, rank_fn)


def test_compile_with_activation_checkpointing_under_tp_is_refused() -> None:
    with pytest.raises(ValueError, match=r"compile with activation checkpointing fails under tensor parallelism"):
        check_compile(True, True, tp=2)
    check_compile(True, True, tp=1)  # a plain model: compiles and recomputes
