"""A multimodal wrapper's forward at tp=2 issues the collectives of its language model alone on
text batches; a batch with images adds one all-gather (the embedding made whole for the merge)."""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import hf_tp
from tests.helpers import run_threaded
from tests.image_grid import collate, image_config, image_rows
from tests.wrapper_grid import wrapper_model


class _Collectives(TorchDispatchMode):
    """Counts the collective ops dispatched in this thread (torch's CommDebugMode tracks modules
    process-wide, which threaded ranks confuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d"):
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _counts(model, batch: dict) -> dict[str, int]:
    with _Collectives() as comms, torch.no_grad():
        model(**batch, use_cache=False)
    return {k: n for k, n in comms.counts.items() if k not in ("wait_tensor", "_wrap_tensor_autograd")}


def test_text_batches_pay_the_language_model_collectives_only() -> None:
    config = image_config("llava")
    wrapper = wrapper_model(config)
    text = AutoModelForCausalLM.from_config(config.text_config, dtype=torch.float64)
    rows = image_rows("llava", config)
    images = {k: v for k, v in collate("llava", rows[2:]).items() if k != "labels"}  # 1 image each
    plain = {k: images[k] for k in ("input_ids", "attention_mask")}
    plain["input_ids"] = plain["input_ids"].masked_fill(plain["input_ids"] == config.image_token_index, 5)
    models = [(copy.deepcopy(wrapper), copy.deepcopy(text)) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
        mine, lm = (hf_tp.parallelize(m, mesh) for m in models[rank])
        want = _counts(lm, plain)
        assert _counts(mine, plain) == want
        with_images = _counts(mine, images)
        gathers = [k for k in want if "all_gather" in k]
        assert gathers, want
        more = {k: with_images.get(k, 0) - want.get(k, 0) for k in with_images.keys() | want.keys()}
        assert sorted(v for v in more.values() if v) == [1] and more[gathers[0]] == 1, (want, with_images)

    run_threaded(2, rank_fn)
