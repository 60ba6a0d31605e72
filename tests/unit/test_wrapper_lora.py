"""LoRA on a multimodal wrapper's language model (peft on the wrapper, hf-tp train's default
targets) at tp=2 on image + text rows: loss and every LoRA gradient equal plain peft's; LoRA in the
vision tower or projector is refused naming the module."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_tp
from hf_tp.run.config import TrainConfig
from hf_tp.run.model import with_lora
from tests.helpers import full, full_grads, run_threaded
from tests.image_grid import collate, image_config, image_rows
from tests.wrapper_grid import wrapper_model


def test_lora_on_the_language_model_of_a_wrapper_equals_plain_peft() -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    config = image_config("llava")
    base = wrapper_model(config)
    ref = with_lora(copy.deepcopy(base), TrainConfig(lora_r=4, lora_target_modules="all-linear"))
    lora = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert lora and all(".language_model." in n for n in lora), lora  # not the tower, not the projector
    torch.manual_seed(1)
    with torch.no_grad():  # peft starts B at zero: random B so that every LoRA gradient is nonzero
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = collate("llava", image_rows("llava", config))
    candidates = [copy.deepcopy(ref) for _ in range(2)]
    out = ref(**batch, use_cache=False)
    out.loss.backward()
    want_loss, want = out.loss.item(), full_grads(ref)
    towered = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "linear_1"]))
    refused = [copy.deepcopy(towered) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
        model = hf_tp.parallelize(candidates[rank], mesh)
        with hf_tp.loss_parallel():
            got = model(**batch, use_cache=False)
            got.loss.backward()
        assert abs(full(got.loss).item() - want_loss) <= 1e-6 * abs(want_loss)
        grads = full_grads(model)
        assert grads.keys() == want.keys(), sorted(grads.keys() ^ want.keys())
        for name, w in want.items():
            torch.testing.assert_close(grads[name], w, rtol=0, atol=1e-6 * w.abs().max().item(), msg=name)
        with pytest.raises(ValueError, match=r"LoRA on model\.vision_tower\..*q_proj: it lies in the llava wrapper's"):
            hf_tp.parallelize(refused[rank], mesh)

    run_threaded(2, rank_fn)
