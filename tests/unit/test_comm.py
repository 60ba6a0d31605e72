"""Communication accounting of the TP+SP plan, counted on a fake process group (one process).

The fake group makes collectives no-ops, so only counts and sizes are meaningful here (numerics are
checked by the parity tests).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import hf_tp
from hf_tp.parallel.linear_ce import fusable
from hf_tp.run.loss import training_loss
from tests.helpers import CollectiveCounter, batch, tiny_config, tiny_model

TP, B, S, H = 2, 2, 12, 64
COLLECTIVES = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_", "allreduce_"}


class Collectives(TorchDispatchMode):
    """Records every collective on local tensors: (name, elements of the full b*s*h-sized side)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace in ("_c10d_functional", "c10d"):
            t = args[0][0] if isinstance(args[0], list | tuple) else args[0]
            numel = t.numel() * (TP if name == "all_gather_into_tensor" else 1)
            self.calls.append((name, numel))
        return func(*args, **(kwargs or {}))

    def counts(self) -> Counter:
        return Counter(n for n, _ in self.calls if n in COLLECTIVES)


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield
    dist.destroy_process_group()


def _assert_first_layer_is_the_sp_minimum(model) -> None:
    """Layer 0 forward and backward on sequence shards: one all-gather and one reduce-scatter of
    the full b*s*h activations per block (attention, MLP or MoE), nothing else."""
    mesh = model.model.layers[0].self_attn.q_proj.weight.device_mesh
    x = DTensor.from_local(
        torch.randn(B, S // TP, H, requires_grad=True), mesh, [Shard(1)], shape=(B, S, H), stride=(S * H, H, 1)
    )
    pos = torch.arange(S)[None].expand(B, S)
    emb = model.model.rotary_emb(x.to_local(), pos)
    fwd, bwd = Collectives(), Collectives()
    with fwd:
        out = model.model.layers[0](x, position_embeddings=emb, position_ids=pos, attention_mask=None)
    with bwd:
        out.to_local().sum().backward()
    for mode in (fwd, bwd):
        assert mode.counts() == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, mode.calls
        assert all(numel == B * S * H for name, numel in mode.calls if name in COLLECTIVES)


@pytest.mark.parametrize("kv", [2, 1])  # kv=1 < tp: the KV head replicated on both ranks
def test_one_decoder_layer_is_the_megatron_sp_minimum(kv: int, fake_world) -> None:
    model = hf_tp.parallelize(
        tiny_model(tiny_config("llama", kv_heads=kv, attention_bias=False, mlp_bias=False)),
        hf_tp.build_mesh(tp=TP, device_type="cpu"),
    )
    _assert_first_layer_is_the_sp_minimum(model)


def test_a_training_step_reduces_norm_grads_in_one_collective(fake_world) -> None:
    config = tiny_config("llama")
    ref = tiny_model(config)
    data = batch(config.vocab_size, b=B, s=S, pad=None)
    layers = config.num_hidden_layers
    counts = {}
    for fuse in (False, True):
        model = hf_tp.parallelize(
            copy.deepcopy(ref), hf_tp.build_mesh(tp=TP, device_type="cpu"), fuse_partial_grads=fuse
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fwd, bwd, step = CollectiveCounter(), CollectiveCounter(), CollectiveCounter()
        with hf_tp.loss_parallel():
            with fwd:
                loss = model(**data, use_cache=False).loss
            with bwd:
                loss.backward()
        with step:
            opt.step()
        counts[fuse] = (_names(bwd), _names(step))
        # Forward: 2 all-gathers + 2 reduce-scatters per layer, the embedding's reduce-scatter,
        # lm_head's all-gather, and loss parallel's 3 all-reduces (max, sum-exp, target logit).
        want = {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1, "all_reduce": 3}
        assert _names(fwd) == want
    tp_bwd = {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1}
    norms = 2 * layers + 1
    assert counts[False] == (tp_bwd, {"all_reduce": 3 * norms})  # each Partial norm grad, 3 times in AdamW
    assert counts[True] == ({**tp_bwd, "allreduce_": 1}, {})  # one fused all-reduce in backward, none after


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_scaled_embeddings_are_reduce_scattered_not_all_reduced(family: str, fake_world) -> None:
    # Gemma multiplies its embedding lookup by sqrt(hidden); done on the vocab-sharded partial sum,
    # that product makes DTensor all-reduce the whole b x s x h output. The adapter scales after
    # the reduce-scatter, so the forward's sequence collectives are the Megatron SP minimum.
    config = tiny_config(family)
    model = hf_tp.parallelize(tiny_model(config), hf_tp.build_mesh(tp=TP, device_type="cpu"))
    data = batch(config.vocab_size, b=B, s=S, pad=None)
    fwd = Collectives()  # (CommDebugMode's module tracker fails on Gemma 3's forward)
    with hf_tp.loss_parallel(), fwd:
        model(**data, use_cache=False)
    layers = config.num_hidden_layers
    assert fwd.counts() == {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_under_fsdp2_the_partial_grads_are_one_all_reduce_per_backward(family: str) -> None:
    # FSDP2 all-reduces each Partial grad over tp in its post-backward (one per norm weight, and
    # per q/k norm weight for Qwen3); fused, one all-reduce over the whole world remains.
    config = tiny_config(family)
    ref = tiny_model(config)
    data = batch(config.vocab_size, b=B, s=S, pad=None)
    layers = config.num_hidden_layers
    partial = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2 * TP)
    try:
        counts = {}
        for fuse in (False, True):
            mesh = hf_tp.build_mesh(tp=TP, dp=2, device_type="cpu")
            model = hf_tp.parallelize(copy.deepcopy(ref), mesh, fuse_partial_grads=fuse)
            bwd = Collectives()
            with hf_tp.loss_parallel():
                loss = model(**data, use_cache=False).loss
                with bwd:
                    loss.backward()
            counts[fuse] = Counter(n for n, _ in bwd.calls if n in ("all_reduce", "allreduce_"))
        assert counts[False] == {"all_reduce": partial}
        assert counts[True] == {"allreduce_": 1}
    finally:
        dist.destroy_process_group()


def test_a_moe_layer_is_the_megatron_sp_minimum_too(fake_world) -> None:
    # Qwen3-MoE: attention plus a MoE block run as one region (router, 4 experts split over tp):
    # one all-gather and one reduce-scatter per block, forward and backward, like a dense MLP.
    from transformers import AutoModelForCausalLM

    from tests.family_grid import grid_config

    torch.manual_seed(0)
    config = grid_config("qwen3_moe", hidden_size=H, num_attention_heads=4, num_key_value_heads=2)
    model = hf_tp.parallelize(
        AutoModelForCausalLM.from_config(config, dtype=torch.float32), hf_tp.build_mesh(tp=TP, device_type="cpu")
    )
    _assert_first_layer_is_the_sp_minimum(model)


def _names(mode: CollectiveCounter) -> dict[str, int]:
    return mode.get_comm_counts()


def test_fused_loss_replaces_loss_parallel_all_reduces_with_one_small_all_gather(fake_world) -> None:
    config = tiny_config("llama")
    model = hf_tp.parallelize(tiny_model(config), hf_tp.build_mesh(tp=TP, device_type="cpu"))
    data = batch(config.vocab_size, b=B, s=S, pad=None)
    assert fusable(model)
    fwd, bwd = Collectives(), Collectives()
    with fwd:
        loss, _ = training_loss(model, data, B * (S - 1), fused=True)
    with bwd:
        loss.backward()
    layers = config.num_hidden_layers
    # As the unfused step (the lm_head's all-gather of b*s*h included) but loss parallel's three
    # all-reduces become one all-gather of 2 fp32 numbers per token (one chunk at this size).
    assert fwd.counts() == {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1}
    small = [(name, n) for name, n in fwd.calls if name == "_allgather_base_"]  # c10d's, outside DTensor
    assert small == [("_allgather_base_", TP * 2 * B * S)], fwd.calls  # gathered: tp x (lse, target) x tokens
    # Backward: the same, plus the one all-reduce of the norm weights' Partial gradients.
    want_bwd = {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1, "allreduce_": 1}
    assert bwd.counts() == want_bwd
