"""Expert parallelism on multimodal wrappers whose language model is a mixture of experts
(Kimi-K2.5's DeepSeek-V3, Qwen3-VL-MoE): experts split over the ep ranks (borrowed from dp),
the vision tower and projector replicated over ep and tp and sharded over dp as without ep.
Logits, loss, every trainable gradient and the AdamW steps equal plain transformers on the
same wrapper, on text (tp1 x ep2, tp2 x ep2) and with images (tp2 x ep2)."""

from __future__ import annotations

import copy

import pytest
from transformers import CONFIG_MAPPING

import hf_tp
from hf_tp.compat import family_refusal
from tests.helpers import run_threaded
from tests.image_grid import ImageCase, run_image_cases
from tests.wrapper_grid import WrapperCase, run_cases, wrapper_config, wrapper_model


def _skip_unless(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    if refusal := family_refusal(CONFIG_MAPPING[model_type]().text_config.model_type):
        pytest.skip(refusal)


def test_moe_wrapper_on_text_at_ep2_and_tp2_ep2() -> None:
    _skip_unless("kimi_k25")
    cases = [WrapperCase("kimi_k25", tp=tp, dp=2, ep=2, steps=2) for tp in (1, 2)]
    results = run_cases(cases)
    assert [r.status for r in results] == ["parity"] * 2, [(r.model_type, r.reason) for r in results]


def test_moe_wrapper_with_images_at_tp2_ep2() -> None:
    _skip_unless("qwen3_vl_moe")
    diffs = run_image_cases([ImageCase("qwen3_vl_moe", dp=2, ep=2)])
    assert all(max(d.values()) < 1e-5 for d in diffs.values()), diffs


def test_ep_on_a_dense_wrapper_is_refused() -> None:
    model = wrapper_model(wrapper_config("llava"))
    candidates = [copy.deepcopy(model) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, dp=2, device_type="cpu")
        with pytest.raises(ValueError, match=r"ep=2 needs a mixture-of-experts model; llava has no experts"):
            hf_tp.parallelize(candidates[rank], mesh, ep=2)

    run_threaded(2, rank_fn)
