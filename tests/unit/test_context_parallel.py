"""Context parallelism's pieces (parity runs: tests/e2e/test_context_parallel.py): the chunk
layout, the mask against transformers' own, packed documents, and every refusal."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    padding_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import hf_tp
from hf_tp.context.context_install import masks_documents, packed_documents
from hf_tp.context.token_share import ContextState, TokenShare
from hf_tp.estimate.spec import EstimateSpec, validate
from hf_tp.run.config import TrainConfig
from tests.family_grid import grid_config
from tests.helpers import run_threaded, tiny_config, tiny_model


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_covers_the_row_once_with_equal_causal_work(cp: int) -> None:
    seq = 2 * cp * 5
    parts = [TokenShare(cp, r).indices(seq) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    assert torch.equal(TokenShare(cp, 0).gathered(seq), torch.cat(parts))
    work = {int(p.sum()) for p in parts}  # keys a causal query attends to: its index + 1, summed
    assert len(work) == 1, f"unbalanced causal work over cp ranks: {work}"
    row = torch.arange(seq)[None] * 10
    assert torch.equal(TokenShare(cp, cp - 1).take(row), row[:, parts[-1]])


def _state(cp: int, rank: int, tp: int = 1) -> ContextState:
    mesh = SimpleNamespace(size=lambda: cp, get_local_rank=lambda: rank)
    return ContextState(mesh=mesh, base="sdpa", multiple=2 * cp * tp)


@pytest.mark.parametrize("case", ["causal", "padding", "window", "packed", "packed+window"])
def test_mask_is_transformers_mask_in_global_indices(case: str) -> None:
    seq, cp, window = 16, 2, (3 if "window" in case else None)
    padding = torch.ones(2, seq, dtype=torch.bool)
    if case == "padding":
        padding[1, 11:] = False  # right padding
        padding[0, :3] = False  # left padding
    docs = None
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    if "packed" in case:
        pos = torch.stack(
            [torch.cat([torch.arange(5), torch.arange(11)]), torch.cat([torch.arange(9), torch.arange(7)])]
        )
        docs = find_packed_sequence_indices(pos)
        assert torch.equal(docs, packed_documents(pos))
        fn = and_masks(fn, packed_sequence_mask_function(docs))
    want = sdpa_mask(
        batch_size=2,
        q_length=seq,
        kv_length=seq,
        mask_function=and_masks(fn, padding_mask_function(padding)),
        allow_is_causal_skip=False,
    )
    for rank in range(cp):
        state = _state(cp, rank)
        state.start(seq, padding.long() if case == "padding" else None, docs, "cpu")
        got = state.mask(2, window, "cpu")
        assert torch.equal(got, want[:, :, state.q_index][:, :, :, state.k_index]), f"rank {rank}"


def test_unpacked_rows_have_no_documents() -> None:
    assert packed_documents(torch.arange(12)[None].expand(2, -1)) is None


def test_sequence_length_must_divide_into_the_chunks() -> None:
    with pytest.raises(
        ValueError, match=r"into 8 equal pieces \(2 x cp x tp\), so the sequence length must be a multiple of 8, got 20"
    ):
        _state(2, 0, tp=2).start(20, None, None, "cpu")


def test_families_that_do_not_mask_packed_documents_are_read_from_source() -> None:
    for family, masks in (("llama", True), ("qwen2", True), ("gpt_oss", False)):
        model = AutoModelForCausalLM.from_config(grid_config(family, num_hidden_layers=1))
        assert masks_documents(model.get_decoder()) is masks, family


def test_config_counts_cp_in_the_world_and_lends_it_to_ep() -> None:
    TrainConfig(tp=1, dp=1, cp=2, ep=2).validate()  # ep borrows from dp x cp
    with pytest.raises(ValueError, match=r"--ep must divide --dp x --cp \(4\): .* from dp x cp, got 8"):
        TrainConfig(tp=1, dp=2, cp=2, ep=8).validate()
    with pytest.raises(ValueError, match="--cp must be a positive integer"):
        TrainConfig(tp=1, dp=1, cp=0).validate()
    cfg = TrainConfig(tp=2, dp=3, cp=2)
    assert cfg.world_size == 12 and cfg.row_multiple == 8 and TrainConfig(tp=2, dp=1).row_multiple == 2


def _refused(model_fn, match: str, **kwargs) -> None:
    """parallelize on a cp=2 mesh (2 threaded ranks) raises ``match`` on every rank."""
    models = [model_fn(), model_fn()]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, cp=2, device_type="cpu")
        with pytest.raises(ValueError, match=match):
            hf_tp.parallelize(models[rank], mesh, **kwargs)

    run_threaded(2, rank_fn)


def test_refusals_name_the_problem() -> None:
    grid = lambda family: lambda: AutoModelForCausalLM.from_config(grid_config(family, num_hidden_layers=2))  # noqa: E731
    _refused(grid("lfm2"), r"lfm2 mixes tokens outside attention \(Lfm2ShortConv")
    _refused(grid("falcon_h1"), "falcon_h1 mixes tokens outside attention")
    config = tiny_config("llama")
    _refused(lambda: tiny_model(config, attn="eager"), "ep=2 needs a mixture-of-experts model", ep=2)
    moe = lambda: AutoModelForCausalLM.from_config(grid_config("qwen3_moe", num_hidden_layers=2))  # noqa: E731
    _refused(moe, r"ep must divide dp x cp \(2\): expert parallelism borrows its ranks from dp x cp, got ep=4", ep=4)

    def flash():
        model = tiny_model(config)
        model.config._attn_implementation = "flash_attention_2"
        return model

    _refused(flash, "uses attn_implementation='flash_attention_2'; load it with attn_implementation='sdpa'")


def test_forward_errors_and_generate_refused() -> None:
    config = tiny_config("llama")
    models = [tiny_model(copy.deepcopy(config)) for _ in range(2)]  # (one config each: cp changes it)

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=1, cp=2, device_type="cpu"))
        ids = torch.randint(3, config.vocab_size, (1, 10))
        with pytest.raises(
            ValueError,
            match=r"into 4 equal pieces \(2 x cp x tp\), so the sequence length must be a multiple of 4, got 10",
        ):
            model(ids)
        with pytest.raises(ValueError, match="does not decode with context parallelism"):
            model.generate(ids[:, :8], max_new_tokens=1)

    run_threaded(2, rank_fn)


def test_build_mesh_names_the_world() -> None:
    def rank_fn(rank: int) -> None:
        with pytest.raises(ValueError, match=r"world size \(2\) must equal tp\*cp\*dp \(1\*2\*2=4\)"):
            hf_tp.build_mesh(tp=1, cp=2, dp=2, device_type="cpu")

    run_threaded(2, rank_fn)


@pytest.mark.large_estimate
def test_estimate_cp_counts_the_kv_gathers() -> None:
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "estimate", "--model", "llama-3.2-1b", "--tp", "2", "--cp", "2"]
    out = subprocess.run([*cmd, "--seq-len", "1024", "--json"], capture_output=True, text=True, check=True).stdout
    est = json.loads(out)
    gathers = [c for c in est["comms"] if c["dim"] == "cp" and c["collective"] == "all_gather"]
    assert est["world_size"] == 4 and est["cp"] == 2
    assert gathers and gathers[0]["count"] == 2 * 16  # K and V, each of the 16 layers
    with pytest.raises(ValueError, match=r"seq_len \(124\) must be a multiple of 2\*cp\*tp \(8\)"):
        validate(tiny_config("llama"), EstimateSpec(2, 1, 124, 1, "bf16", cp=2))


@pytest.mark.large_estimate
def test_estimate_cp_with_ep_borrows_from_dp_x_cp() -> None:
    from hf_tp.estimate.estimate_run import estimate
    from tests.unit.test_estimate_moe import tiny_moe

    # cp 2 x dp 2: ep 4 spans dp x cp (no dp_out), ep 2 leaves dp_out 2 (experts sharded by FSDP2 there)
    at4, at2 = (estimate(tiny_moe(), 1, 2, 64, 1, ep=ep, cp=2) for ep in (4, 2))
    assert at4.sent_bytes("ep") > 0 and at4.sent_bytes("cp") > 0 and at4.sent_bytes("dp_out") == 0
    assert at2.sent_bytes("dp_out") > 0
    with pytest.raises(ValueError, match=r"ep must divide dp x cp \(4\): .* from dp x cp, got ep=8"):
        validate(tiny_moe(), EstimateSpec(1, 2, 64, 1, "bf16", ep=8, cp=2))


def test_one_additive_mask_serves_every_layer() -> None:
    # SDPA given a bool mask keeps an additive copy per layer for backward (quadratic in the row:
    # 4 GiB a layer for a 64k row at cp 2); hf_tp hands every layer one additive mask per forward.
    from hf_tp.estimate.estimate_run import estimate

    config = tiny_config("llama", num_hidden_layers=4, max_position_embeddings=2048)
    whole, split = (estimate(copy.deepcopy(config), 1, 1, 2048, 1, cp=cp, dtype="fp32") for cp in (1, 2))
    mask = 1024 * 2048 * 4  # local queries x all keys, fp32
    assert split.peak.activations < whole.peak.activations + 1.5 * mask, (split.peak, whole.peak)


def test_moe_aux_loss_on_padded_rows_is_plain_hf() -> None:
    # HF's forward computes its own aux loss from the attention_mask it is given; under cp that mask
    # is the whole rows' and the router logits this rank's tokens (a shape error before): the mask
    # now reaches the decoder through cp's state, and hf_tp's aux loss over the whole rows is HF's.
    from hf_tp.core.mesh import split_mesh
    from hf_tp.run.loss import training_loss
    from hf_tp.verify.compare import full_grads
    from tests.family_grid import grid_model
    from tests.helpers import assert_close_dict, batch

    config = grid_config("qwen3_moe", num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.5)
    ref = grid_model(config)
    data = batch(config.vocab_size, b=2, s=16, pad="right")
    models = [copy.deepcopy(ref) for _ in range(2)]
    want = ref(**data, use_cache=False).loss
    want.backward()
    want_grads, targets = full_grads(ref), int((data["labels"][:, 1:] != -100).sum())

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, cp=2, device_type="cpu")
        model = hf_tp.parallelize(models[rank], mesh)
        loss, aux = training_loss(model, data, targets, False, split_mesh(mesh)[0].get_group())
        loss.backward()
        assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item()) and aux > 0
        assert_close_dict(full_grads(model), want_grads, "grad")

    run_threaded(2, rank_fn)
