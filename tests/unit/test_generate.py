"""hf_tp.generate and hf_tp.evaluate against plain single-process HF: greedy generate and held-out loss at tp=2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hf_tp
from hf_tp.parallel.generate import generate, generation_mode
from hf_tp.parallel.held_out import evaluate
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

NEW_TOKENS = 8


def _prompts(vocab: int) -> list[dict]:
    """One prompt of odd length (7, not divisible by tp), then two left-padded ones (9 and 4)
    decoded with a repetition penalty (a logits processor that gathers/scatters the logits; it
    also keeps a tiny random model from repeating one token, so every step tests something)."""
    g = torch.Generator().manual_seed(5)
    single = torch.randint(3, vocab, (1, 7), generator=g)
    pair = torch.randint(3, vocab, (2, 9), generator=g)
    mask = torch.ones_like(pair)
    mask[1, :5] = 0
    return [
        {"input_ids": single, "attention_mask": torch.ones_like(single)},
        {"input_ids": pair.masked_fill(mask == 0, 0), "attention_mask": mask, "repetition_penalty": 1.3},
    ]


def _generate(model, prompt: dict, fn=None):
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True)
    if fn is None:
        return model.generate(**prompt, **kwargs)
    return fn(model, **prompt, **kwargs)


def _train_step(model, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with hf_tp.loss_parallel():
        loss = model(**data, use_cache=False).loss
        loss.backward()
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return loss.detach(), full_grads(model)


def _hook_counts(model) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


# Mistral: the generated length (7 + 8) passes its sliding window (5), so the cache is cropped.
@pytest.mark.parametrize(
    ("family", "tied", "kv"),
    # Not Gemma 2: its float64 parity (parity_dtype) needs eager attention, where HF itself gives
    # NaN logits on the left-padded prompt. kv=1: the KV head (and its cache) replicated on both ranks.
    [
        ("qwen2", True, 2),
        ("llama", False, 2),
        ("mistral", False, 2),
        ("qwen3", False, 2),
        ("gemma3_text", True, 2),
        ("qwen3", True, 1),
    ],
)
def test_greedy_generate_matches_plain_hf_then_training_continues(family: str, tied: bool, kv: int) -> None:
    config = tiny_config(family, tied=tied, kv_heads=kv)
    ref = tiny_model(config, dtype=parity_dtype(family))
    prompts = _prompts(config.vocab_size)
    data = batch(config.vocab_size, s=11)
    models = [copy.deepcopy(ref) for _ in range(2)]
    want = [_generate(ref, p) for p in prompts]
    want_loss, want_grads = _train_step(ref, data)
    assert len(want[0].logits) == NEW_TOKENS  # no EOS cut the run short: every step is compared

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        model.train()
        with torch.no_grad():
            model(prompts[0]["input_ids"], use_cache=False)  # the first forward drops parallelize's one-shot pre-hooks
        hooks = _hook_counts(model)
        for prompt, expected in zip(prompts, want, strict=True):
            got = _generate(model, prompt, generate)
            assert torch.equal(got.sequences, expected.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=RTOL, atol=1e-5)
        assert all(m.training for m in model.modules()) and _hook_counts(model) == hooks
        loss, grads = _train_step(model, data)
        torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=0)
        assert_close_dict(grads, want_grads, "grad after generate")

    run_threaded(2, rank_fn)


def test_generation_mode_makes_model_generate_work() -> None:
    config = tiny_config("llama")
    ref = tiny_model(config)
    prompt = _prompts(config.vocab_size)[1]
    want = ref.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    models = [copy.deepcopy(ref) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        with generation_mode(model):
            assert not model.training
            got = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got, want) and model.training

    run_threaded(2, rank_fn)


def test_different_prompts_on_tp_ranks_raise_on_every_rank() -> None:
    config = tiny_config("qwen2", tied=True)
    models = [tiny_model(config) for _ in range(2)]
    ids = torch.randint(3, config.vocab_size, (2, 5))

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        with pytest.raises(ValueError, match="the 2 tp ranks got different input_ids/attention_mask"):
            generate(model, ids[rank : rank + 1], max_new_tokens=2)

    run_threaded(2, rank_fn)


def _reference_loss(model, batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """Sum of every target token's cross entropy over the count, from plain HF logits."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            targets = b["labels"][:, 1:]
            total += F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += int((targets != -100).sum())
    return total / count, count


@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("llama", False)])
def test_evaluate_matches_plain_hf(family: str, tied: bool) -> None:
    config = tiny_config(family, tied=tied)
    ref = tiny_model(config)
    # Two batches of different lengths and padding: a mean of batch means would differ.
    batches = [batch(config.vocab_size, b=2, s=13, seed=1), batch(config.vocab_size, b=3, s=6, pad="left", seed=2)]
    want, count = _reference_loss(ref, batches)
    for fused in (True, False):
        plain = evaluate(ref, batches, fused=fused)
        assert plain.tokens == count and plain.loss == pytest.approx(want, rel=RTOL)
    models = [copy.deepcopy(ref) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        model.train()
        for lp, fused in ((True, True), (True, False), (False, False)):
            got = evaluate(model, batches, loss_parallel=lp, fused=fused)
            assert got.tokens == count
            assert got.loss == pytest.approx(want, rel=RTOL, abs=ATOL)
            assert got.perplexity == pytest.approx(torch.tensor(want).exp().item(), rel=1e-4)
        assert all(m.training for m in model.modules())

    run_threaded(2, rank_fn)


def test_model_generate_without_input_ids_names_hf_tp_generate() -> None:
    # model.generate on a parallelized model is hf_tp.generate; it needs token ids.
    config = tiny_config("qwen2")
    models = [tiny_model(config) for _ in range(2)]

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"))
        with pytest.raises(ValueError, match=r"needs input_ids.*hf_tp\.generate"):
            model.generate(max_new_tokens=2)

    run_threaded(2, rank_fn)


def test_evaluate_of_a_moe_is_the_cross_entropy_on_every_mesh() -> None:
    # Qwen3-MoE with output_router_logits (HF adds its aux loss to `labels=` losses): at tp2 x dp2
    # each dp rank evaluates its own batch, and the result is the cross entropy of both batches,
    # without any rank's aux loss.
    from tests.family_grid import grid_config, grid_model

    config = grid_config("qwen3_moe", output_router_logits=True, vocab_size=300)
    ref = grid_model(config)
    batches = [batch(config.vocab_size, b=2, s=12, seed=1), batch(config.vocab_size, b=2, s=12, pad="left", seed=2)]
    want, count = _reference_loss(ref, batches)
    assert evaluate(ref, batches).loss == pytest.approx(want, rel=RTOL)  # HF upcasts logits to fp32, not fp64
    models = [copy.deepcopy(ref) for _ in range(4)]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, dp=2, device_type="cpu")
        model = hf_tp.parallelize(models[rank], mesh)
        got = evaluate(model, [batches[mesh.get_local_rank("dp")]])
        assert got.tokens == count and got.loss == pytest.approx(want, rel=RTOL)

    run_threaded(4, rank_fn)
