"""LoRA adds no collective: a decoder layer with LoRA on every projection still makes exactly
Megatron-SP's collectives, and a training step's replicated LoRA factors join the one fused
all-reduce of the Partial gradients (fake process group, one process)."""

from __future__ import annotations

import pytest
import torch

import hf_tp
from hf_tp.core.record import record_of
from tests.helpers import CollectiveCounter, batch, tiny_config, tiny_model
from tests.unit.test_comm import TP, _assert_first_layer_is_the_sp_minimum, _names, fake_world  # noqa: F401

pytest.importorskip("peft")


def _lora_llama(kv: int = 2):
    from tests.lora_grid import lora

    config = tiny_config("llama", kv_heads=kv, attention_bias=False, mlp_bias=False)
    return config, lora(tiny_model(config))


@pytest.mark.parametrize("kv", [2, 1])  # kv=1 < tp: k/v and their LoRA factors whole on both ranks
def test_a_lora_decoder_layer_is_the_megatron_sp_minimum(kv: int, fake_world) -> None:  # noqa: F811
    _, peft_model = _lora_llama(kv)
    hf_tp.parallelize(peft_model, hf_tp.build_mesh(tp=TP, device_type="cpu"))
    _assert_first_layer_is_the_sp_minimum(peft_model.base_model.model)


def test_a_lora_training_step_has_one_fused_all_reduce_and_a_quiet_optimizer(fake_world) -> None:  # noqa: F811
    config, peft_model = _lora_llama()
    hf_tp.parallelize(peft_model, hf_tp.build_mesh(tp=TP, device_type="cpu"))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    data = batch(config.vocab_size, b=2, s=12, pad=None)
    fwd, bwd, step = CollectiveCounter(), CollectiveCounter(), CollectiveCounter()
    with hf_tp.loss_parallel():
        with fwd:
            loss = peft_model(**data, use_cache=False).loss
        with bwd:
            loss.backward()
    with step:
        opt.step()
    layers = config.num_hidden_layers
    seq = {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1}
    assert _names(fwd) == {**seq, "all_reduce": 3}  # as without LoRA (loss parallel's 3 all-reduces)
    # Backward: the frozen embedding needs no gradient, so neither its reduce-scatter's backward nor
    # layer 0's input all-gather's backward runs; the LoRA factors' Partial grads join the fused one.
    assert _names(bwd) == {"all_gather_into_tensor": 2 * layers, "reduce_scatter_tensor": 2 * layers, "allreduce_": 1}
    assert _names(step) == {}
    reducer = record_of(peft_model).partial_grads
    assert reducer.flushes == 1
