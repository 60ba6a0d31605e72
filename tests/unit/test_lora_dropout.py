"""LoRA dropout under tp (issue 26, item 3): the mask of a tensor replicated over tp (the input of
a column-parallel projection's LoRA branch) is the same on every tp rank and differs over dp; the
mask of a sharded tensor (a row-parallel projection's input features) differs between tp ranks;
the keep rate is 1 - p within 3 sigma; p = 0 and eval mode are the identity; the activation-checkpointing
recompute redraws the forward's masks."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import hf_tp
from hf_tp.dropout.tp_dropout import ShardAwareDropout
from tests.helpers import run_threaded, tiny_config, tiny_model

pytest.importorskip("peft")

P = 0.3


def _masks(
    tp: int, dp: int, peft_model: torch.nn.Module | None = None, names: tuple[str, ...] = ("q_proj", "o_proj")
) -> dict[int, dict[str, torch.Tensor]]:
    """Per global rank, the local keep masks of layer 0's LoRA dropouts on ``names`` (by default
    a tiny Llama's q_proj (column) and o_proj (row)) in one training forward (every rank gets the
    same batch)."""
    from tests.lora_grid import lora

    if peft_model is None:
        peft_model = lora(tiny_model(tiny_config("llama", attention_bias=False, mlp_bias=False)), dropout=P)
    copies = [copy.deepcopy(peft_model) for _ in range(tp * dp)]
    vocab = peft_model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    out: dict[int, dict[str, torch.Tensor]] = {}

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(copies[rank], hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu"))
        attn = model.base_model.model.model.layers[0].self_attn
        seen: dict[str, torch.Tensor] = {}
        for name in names:
            drop = getattr(attn, name).lora_dropout["default"]
            assert isinstance(drop, ShardAwareDropout) and drop.p == P

            def keep(mod, args, output, name=name):
                x, y = (t.to_local() if hasattr(t, "to_local") else t for t in (args[0], output))
                assert bool((x != 0).all())
                seen[name] = y != 0
                torch.testing.assert_close(y[seen[name]], x[seen[name]] / (1 - P))

            drop.register_forward_hook(keep)
        with hf_tp.loss_parallel():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        out[rank] = seen

    run_threaded(tp * dp, rank_fn)
    return out


def test_masks_equal_where_replicated_distinct_where_sharded_and_over_dp() -> None:
    m = _masks(tp=2, dp=2)  # global ranks (dp, tp): 0, 1 | 2, 3
    assert torch.equal(m[0]["q_proj"], m[1]["q_proj"]) and torch.equal(m[2]["q_proj"], m[3]["q_proj"])
    assert not torch.equal(m[0]["q_proj"], m[2]["q_proj"])  # another dp rank: its own mask
    assert not torch.equal(m[0]["o_proj"], m[1]["o_proj"])  # the two halves of the features: own masks
    for rank in m:
        for name, keep in m[rank].items():
            n = keep.numel()
            sigma = math.sqrt(n * P * (1 - P))
            assert abs(int(keep.sum()) - n * (1 - P)) <= 3 * sigma, (rank, name, int(keep.sum()), n)


def test_masks_in_a_whole_run_region_are_shared_over_tp() -> None:
    # DeepSeek-V3's MLA attention runs whole on every tp rank (plain tensors): every LoRA dropout
    # in it draws its tp group's mask; dp ranks their own.
    from tests.family_grid import grid_config, grid_model
    from tests.lora_grid import attention_targets, lora

    model = grid_model(grid_config("deepseek_v3", vocab_size=300))
    m = _masks(2, 2, lora(model, attention_targets(model), dropout=P), names=("q_a_proj", "o_proj"))
    for name in ("q_a_proj", "o_proj"):
        assert torch.equal(m[0][name], m[1][name]) and torch.equal(m[2][name], m[3][name]), name
        assert not torch.equal(m[0][name], m[2][name]), name


def test_zero_p_and_eval_are_the_identity() -> None:
    x = torch.randn(4, 8)
    assert ShardAwareDropout(0.0, index=0)(x) is x
    drop = ShardAwareDropout(0.5, index=0).eval()
    assert drop(x) is x
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
        ShardAwareDropout(1.0, index=0)


def test_streams_differ_by_module_and_repeat_by_seed() -> None:
    x = torch.ones(64, 64)
    a, b, a2 = (ShardAwareDropout(0.5, index=i, base_seed=7).train() for i in (0, 1, 0))
    assert not torch.equal(a(x), b(x))
    assert torch.equal(ShardAwareDropout(0.5, index=0, base_seed=7)(x), a2(x))


def test_lora_dropout_under_activation_checkpointing_redraws_the_forward_masks() -> None:
    # The recompute (in the backward) replays each LoRA dropout's keys: loss and every LoRA
    # gradient equal the run without checkpointing, bit for bit.
    from tests.helpers import full_grads
    from tests.lora_grid import lora

    peft_model = lora(tiny_model(tiny_config("llama")), dropout=P)
    ids = torch.arange(3, 19)[None]
    got: dict[tuple[bool, int], tuple] = {}

    def run(ac: bool) -> None:
        copies = [copy.deepcopy(peft_model) for _ in range(2)]

        def rank_fn(rank: int) -> None:
            mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
            model = hf_tp.parallelize(copies[rank], mesh, activation_checkpointing=ac)
            with hf_tp.loss_parallel():
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
            got[ac, rank] = (loss.full_tensor().detach(), full_grads(model))

        run_threaded(2, rank_fn)

    run(False)
    run(True)
    assert torch.equal(got[True, 0][0], got[False, 0][0])
    assert got[True, 0][1] and all(torch.equal(g, got[False, 0][1][n]) for n, g in got[True, 0][1].items())
