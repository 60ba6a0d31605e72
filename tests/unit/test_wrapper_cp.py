"""Context parallelism on multimodal wrappers: the sequence is split over cp at the language
model's entry, after the image features are merged into it, with positions (3-D mrope ones too)
and masks from global token indices. Logits of this rank's tokens, the whole rows' loss, every
trainable gradient and the AdamW steps equal plain transformers on the same wrapper, on text
(LLaVA at cp2, Qwen2.5-VL's packed rows at tp2 x cp2) and with images (Qwen3-VL at tp2 x cp2);
a wrapper that builds its language model's masks itself (Gemma 3) is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING

import hf_tp
from hf_tp.compat import family_refusal
from hf_tp.context.token_share import TokenShare
from tests.cp_grid import cp_batch
from tests.helpers import run_threaded
from tests.image_grid import ImageCase, run_image_cases
from tests.parity import Trace, assert_parity, train_steps
from tests.wrapper_grid import wrapper_config, wrapper_model

SEQ = 24  # cp_batch's rows


def _skip_unless(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    if refusal := family_refusal(CONFIG_MAPPING[model_type]().text_config.model_type):
        pytest.skip(refusal)


def _trainable(trace: Trace, names: set[str], logits: torch.Tensor | None = None) -> Trace:
    def keep(d: dict) -> dict:
        return {n: v for n, v in d.items() if n in names}

    chosen = trace.logits if logits is None else logits
    return Trace(chosen, keep(trace.grads), trace.losses, keep(trace.params), keep(trace.start))


def _four_rows(model: torch.nn.Module) -> None:
    """Hand the wrapper its 2-D position ids in the 4-row mrope form (text first), at its entry."""

    def hook(module, args: tuple, kwargs: dict):
        pos = kwargs["position_ids"]
        return args, {**kwargs, "position_ids": pos[None].expand(4, *pos.shape)}

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _text_parity(model_type: str, layouts: list[tuple[int, int, bool]], rows: str) -> None:
    """Each (tp, cp, four-row positions given) layout in a threaded world of its own, against one
    plain HF run. Packed rows of a 3-D mrope wrapper: plain HF is given transformers' 4-row form
    (its 2-D form lets the documents see each other; tests/unit/test_mrope_wrappers.py)."""
    ref = wrapper_model(wrapper_config(model_type))
    data = cp_batch(ref.config.text_config.vocab_size, rows, b=2)
    start = copy.deepcopy(ref)
    if rows == "packed":
        _four_rows(ref)
    want = train_steps(ref, data, steps=2)
    for tp, cp, four in layouts:
        candidates = [copy.deepcopy(start) for _ in range(tp * cp)]

        def rank_fn(rank: int, tp: int = tp, cp: int = cp, four: bool = four, candidates: list = candidates) -> None:
            model = candidates[rank]
            if four:
                _four_rows(model)
            mesh = hf_tp.build_mesh(tp=tp, cp=cp, device_type="cpu")
            hf_tp.parallelize(model, mesh)
            got = train_steps(model, data, steps=2, ctx=hf_tp.loss_parallel)
            mine = TokenShare(cp, mesh.get_local_rank("cp")).indices(SEQ)
            names = {n for n, p in model.named_parameters() if p.requires_grad}
            assert_parity(_trainable(got, names), _trainable(want, names, want.logits[:, mine]))

        run_threaded(tp * cp, rank_fn)


def test_text_wrapper_at_cp2() -> None:
    _text_parity("llava", [(1, 2, False)], rows="right")


def test_mrope_wrapper_packed_text_at_tp2_cp2() -> None:
    # packed documents crossing the chunk borders: 2-D position ids (hf_tp hands them to the
    # language model as 4 rows; the 4-row form given at the wrapper's entry: by hand, docs/multimodal.md)
    _skip_unless("qwen2_5_vl")
    _text_parity("qwen2_5_vl", [(2, 2, False)], rows="packed")


def test_images_at_tp2_cp2() -> None:
    # the image features merged into the whole rows, then split, with Qwen3-VL's (3, B, S) positions
    # and its DeepStack features added to this rank's tokens (LLaVA, Qwen2.5-VL ...: docs/multimodal.md)
    _skip_unless("qwen3_vl")
    diffs = run_image_cases([ImageCase("qwen3_vl", cp=2)])
    assert all(max(d.values()) < 1e-5 for d in diffs.values()), diffs


def test_wrapper_building_its_own_masks_is_refused() -> None:
    _skip_unless("gemma3")
    model = wrapper_model(wrapper_config("gemma3"))
    candidates = [copy.deepcopy(model) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, cp=2, device_type="cpu")
        with pytest.raises(ValueError, match=r"cannot split this multimodal gemma3 checkpoint: its Gemma3Model"):
            hf_tp.parallelize(candidates[rank], mesh)

    run_threaded(2, rank_fn)
