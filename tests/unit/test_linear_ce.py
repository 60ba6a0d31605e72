"""The fused lm_head + cross entropy (used by hf-tp train) against plain HF / torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hf_tp
from hf_tp.parallel.linear_ce import causal_lm_loss, fusable, linear_cross_entropy
from hf_tp.run.loss import training_loss
from tests.helpers import (
    ATOL,
    RTOL,
    assert_close_dict,
    batch,
    full_grads,
    parity_dtype,
    run_threaded,
    tiny_config,
    tiny_model,
)


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
    with pytest.raises(ValueError, match=r"expects hidden \(\.\.\., H\), weight \(V, H\), targets \(\.\.\.\)"):
        linear_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("llama", False), ("mistral", False)])
def test_causal_lm_loss_matches_hf_loss_and_every_gradient(family: str, tied: bool) -> None:
    config = tiny_config(family, tied=tied)
    ref = tiny_model(config)
    model = copy.deepcopy(ref)
    data = batch(config.vocab_size, b=3, s=11, pad="right")
    want = ref(**data, num_items_in_batch=50, use_cache=False).loss
    want.backward()
    assert fusable(model)
    got, _ = training_loss(model, data, 50, fused=True)
    got.backward()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    assert_close_dict(
        {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()}, "grad"
    )
    assert "forward" not in vars(model)  # the model's own forward is back
    # The ordinary forward still works afterwards.
    torch.testing.assert_close(model(**data).logits, ref(**data).logits, rtol=RTOL, atol=ATOL)


def test_not_fused_when_the_adapter_does_not_allow_it() -> None:
    import dataclasses

    model = tiny_model(tiny_config("llama"))
    adapter = hf_tp.get_adapter("llama")
    hf_tp.register_adapter(dataclasses.replace(adapter, plain_lm_head=False), overwrite=True)
    try:
        assert not fusable(model)
    finally:
        hf_tp.register_adapter(adapter, overwrite=True)
    assert fusable(model)


def test_public_causal_lm_loss_refuses_what_it_cannot_fuse() -> None:
    config = tiny_config("llama")
    model = tiny_model(config)
    data = batch(config.vocab_size, b=2, s=7)
    torch.testing.assert_close(
        hf_tp.causal_lm_loss(model, data["input_ids"], data["attention_mask"], data["labels"]),
        model(**data).loss,
        rtol=RTOL,
        atol=0,
    )
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(config.vocab_size))
    with pytest.raises(
        ValueError, match=r"cannot fuse this llama model's lm_head .* use model\(\.\.\., labels=labels\)\.loss"
    ):
        hf_tp.causal_lm_loss(model, data["input_ids"], data["attention_mask"], data["labels"])


def test_default_divisor_is_the_target_count() -> None:
    config = tiny_config("qwen2")
    model = tiny_model(config)
    data = batch(config.vocab_size, b=2, s=9, pad="left")
    want = model(**data, use_cache=False).loss  # HF: mean over the shifted targets
    got = causal_lm_loss(model, data["input_ids"], data["attention_mask"], data["labels"])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)


# --- tp > 1: the lm_head weight sharded over the vocab, one all-gather of 2 numbers per token ---


@pytest.mark.parametrize("tp", [2, 4])  # vocab 37 over 4: shards of 10, 10, 10, 7
@pytest.mark.parametrize("layout", ["sequence-sharded", "replicated"])
def test_vocab_sharded_weight_matches_cross_entropy(tp: int, layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g)
    weight = torch.randn(37, 16, generator=g)
    targets = torch.randint(0, 37, (2, 7), generator=g)
    targets[0, [0, 5]] = -100
    targets[1, 6] = 36  # the last, short shard's last row
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = F.cross_entropy((h_ref @ w_ref.t()).flatten(0, 1), targets.flatten(), reduction="sum") / 9
    (2.0 * want).backward()

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=tp, device_type="cpu")["tp"]
        w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        placement = Shard(1) if layout == "sequence-sharded" else Replicate()
        h = distribute_tensor(hidden, mesh, [placement]).requires_grad_()
        got = linear_cross_entropy(h if layout == "sequence-sharded" else h.to_local(), w, targets, 9, chunk_tokens=3)
        (2.0 * got).backward()
        assert not isinstance(got, DTensor)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
        torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(h.grad.full_tensor(), h_ref.grad, rtol=RTOL, atol=ATOL)

    run_threaded(tp, rank_fn)


@pytest.mark.parametrize(
    ("family", "tied", "tp", "sp"),
    [
        ("qwen2", True, 2, True),
        ("llama", False, 2, True),
        ("mistral", False, 4, True),
        ("qwen2", True, 2, False),
        ("gemma3_text", True, 2, True),
    ],
)
def test_tp_fused_loss_matches_hf_loss_and_every_gradient(family: str, tied: bool, tp: int, sp: bool) -> None:
    heads = 8 if tp == 4 else 4
    config = tiny_config(family, tied=tied, heads=heads, kv_heads=tp)
    ref = tiny_model(config, dtype=parity_dtype(family))
    data = batch(config.vocab_size, b=3, s=11, pad="right")  # 11 tokens: uneven sequence shards
    models = [copy.deepcopy(ref) for _ in range(tp)]
    want = ref(**data, num_items_in_batch=50, use_cache=False).loss
    want.backward()
    want_grads = full_grads(ref)

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=tp, device_type="cpu"), sequence_parallel=sp)
        assert fusable(model)
        got, _ = training_loss(model, data, 50, fused=True)
        got.backward()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
        assert_close_dict(full_grads(model), want_grads, "grad")

    run_threaded(tp, rank_fn)


def test_not_fused_when_the_logits_are_soft_capped() -> None:
    config = tiny_config("gemma2", tied=True)  # final_logit_softcapping: tanh on the logits
    assert config.final_logit_softcapping is not None and not fusable(tiny_model(config))
    config.final_logit_softcapping = None
    assert fusable(tiny_model(config))


def test_not_fused_when_the_head_is_sharded_another_way() -> None:
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    models = [tiny_model(tiny_config("llama")) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, device_type="cpu")["tp"]
        model = parallelize_module(models[rank], mesh, {"lm_head": RowwiseParallel()})
        assert not fusable(model)  # sharded over the hidden dim, not the vocab

    run_threaded(2, rank_fn, timeout=60)


def test_compiled_chunk_math_equals_eager() -> None:
    # GPUs run the torch.compile'd versions of the chunk arithmetic; check each traces whole (no
    # graph break) and its traced graph agrees with eager. Compiled here with aot_eager, not
    # inductor: a CPU runs inductor's C++ kernels, not the Triton ones GPUs run, and compiling them
    # from a cold cache (every CI run) took a minute of CI's two cores. parallelize(compile=True)
    # runs inductor end to end (tests/e2e/test_parallelize_torchrun.py).
    from hf_tp.parallel import linear_ce as m

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g)
    targets = torch.tensor([3, -100, 9, 0, 4, 7])
    row_scale = (targets != -100).float() / 5
    local = torch.tensor([3, 0, 0, 0, 4, 7])
    owned = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    lse = torch.logsumexp(logits, -1) + 0.5
    for eager, compiled, args in [
        (m._chunk_step, m._chunk_step_compiled, (logits, targets, row_scale, True)),
        (m._shard_stats, m._shard_stats_compiled, (logits, local, owned)),
        (m._shard_grad, m._shard_grad_compiled, (logits, local, owned, lse, row_scale)),
    ]:
        assert compiled.fn is eager  # what the GPU path compiles (with inductor) at its first call
        traced = torch.compile(eager, backend="aot_eager", fullgraph=True)
        # Both overwrite fp32 logits (their own temporary in use): give each a fresh copy.
        torch.testing.assert_close(traced(*_fresh(args)), eager(*_fresh(args)), rtol=RTOL, atol=ATOL)


def test_weight_grad_accumulates_in_fp32_from_bf16_chunks() -> None:
    # bf16 chunks into the fp32 weight gradient (GPUs do it in the GEMM; CPUs take the fallback).
    from hf_tp.parallel.linear_ce import _accumulate_weight_grad

    gen = torch.Generator().manual_seed(0)
    grad_w = torch.randn(7, 5, generator=gen)
    g, h = (torch.randn(9, n, generator=gen).bfloat16() for n in (7, 5))
    want = grad_w + g.float().t() @ h.float()
    _accumulate_weight_grad(grad_w, g, h)
    torch.testing.assert_close(grad_w, want, rtol=1e-2, atol=1e-2)  # the bf16 product's rounding


def _fresh(args: tuple) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
