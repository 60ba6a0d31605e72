"""The fused lm_head + cross entropy (used by hf-tp train at tp=1) against plain HF / torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_tp.parallel.linear_ce import causal_lm_loss, fusable, linear_cross_entropy, training_loss
from tests.helpers import ATOL, RTOL, assert_close_dict, batch, tiny_config, tiny_model


@pytest.mark.parametrize("num_items", [None, 40])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_matches_cross_entropy_in_every_chunking(chunk: int, num_items: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, generator=g, requires_grad=True)
    weight = torch.randn(37, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 37, (13,), generator=g)
    targets[[0, 5, 12]] = -100
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_h @ ref_w.t(), targets, ignore_index=-100, reduction="sum") / (num_items or 10)
    (3.0 * ref).backward()
    got = linear_cross_entropy(hidden, weight, targets, num_items, chunk_tokens=chunk)
    (3.0 * got).backward()
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=0)
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=RTOL, atol=ATOL)


def test_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"expects hidden \(N, H\), weight \(V, H\), targets \(N,\)"):
        linear_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("llama", False), ("mistral", False)])
def test_causal_lm_loss_matches_hf_loss_and_every_gradient(family: str, tied: bool) -> None:
    config = tiny_config(family, tied=tied)
    ref = tiny_model(config)
    model = copy.deepcopy(ref)
    data = batch(config.vocab_size, b=3, s=11, pad="right")
    want = ref(**data, num_items_in_batch=50, use_cache=False).loss
    want.backward()
    assert fusable(model, plain_lm_head=True)
    got = training_loss(model, data, 50, fused=True)
    got.backward()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    assert_close_dict(
        {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()}, "grad"
    )
    assert "forward" not in vars(model)  # the model's own forward is back
    # The ordinary forward still works afterwards.
    torch.testing.assert_close(model(**data).logits, ref(**data).logits, rtol=RTOL, atol=ATOL)


def test_not_fused_when_the_adapter_does_not_allow_it() -> None:
    model = tiny_model(tiny_config("llama"))
    assert not fusable(model, plain_lm_head=False)


def test_default_divisor_is_the_target_count() -> None:
    config = tiny_config("qwen2")
    model = tiny_model(config)
    data = batch(config.vocab_size, b=2, s=9, pad="left")
    want = model(**data, use_cache=False).loss  # HF: mean over the shifted targets
    got = causal_lm_loss(model, data["input_ids"], data["attention_mask"], data["labels"])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
