"""Packed rows with per-document position_ids give each document exactly the loss and gradients it
has alone (unpacked, padded), under tp=2 with sequence parallel: no attention across documents."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch

import hf_tp
from hf_tp.data import PadToMultipleCollator
from hf_tp.data.packing import pack_documents
from hf_tp.labels import IGNORE_INDEX
from hf_tp.run.loss import loss_context, training_loss
from tests.helpers import RTOL, assert_close_dict, full_grads, run_threaded, tiny_config, tiny_model

LENGTHS = [6, 9, 5, 7, 4]  # 31 tokens: two rows of 13 (document 2 cut by the row boundary, 5 tokens dropped)
SEQ_LEN = 13


def packed_and_pieces(vocab: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """A packed batch (padded to a multiple of tp=2) and the document pieces it holds, in order."""
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    rows = pack_documents(datasets.Dataset.from_dict({"input_ids": docs}), SEQ_LEN, document_masking=True, label="test")
    pieces = []
    for row in rows:
        for k, (tok, pos) in enumerate(zip(row["input_ids"], row["position_ids"], strict=True)):
            if pos == 0:
                pieces.append([])
            pieces[-1].append(tok)
            assert pos == len(pieces[-1]) - 1 and k < SEQ_LEN
    return PadToMultipleCollator(pad_token_id=0, multiple_of=2)(list(rows)), pieces


# mistral: a sliding window (5) on top of the documents; eager: the mask as a tensor, not sdpa's path
@pytest.mark.parametrize(("family", "attn"), [("qwen2", "sdpa"), ("mistral", "sdpa"), ("qwen2", "eager")])
def test_packed_documents_match_unpacked_ones_at_tp2_with_sp(family: str, attn: str) -> None:
    config = tiny_config(family, tied=family == "qwen2")
    ref = tiny_model(config, attn=attn)
    packed, pieces = packed_and_pieces(config.vocab_size)
    assert "attention_mask" not in packed and packed["input_ids"].shape == (2, 14)
    unpacked = PadToMultipleCollator(pad_token_id=0)([{"input_ids": p} for p in pieces])
    total = int((unpacked["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert total == int((packed["labels"][:, 1:] != IGNORE_INDEX).sum()) == sum(len(p) - 1 for p in pieces)

    # The reference: plain HF, every piece alone in a padded row; its per-piece summed losses.
    want = ref(**unpacked, num_items_in_batch=total, use_cache=False).loss
    want.backward()
    want_grads = full_grads(ref)
    with torch.no_grad():
        logits = ref(**{k: v for k, v in unpacked.items() if k != "labels"}, use_cache=False).logits
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), unpacked["labels"][:, 1:], reduction="none"
        )
        want_per_piece = per_token.sum(1)
    # Packing without position_ids lets documents attend to each other: the losses differ (the test sees it).
    plain = {"input_ids": packed["input_ids"], "labels": packed["labels"]}
    assert not torch.allclose(ref(**plain, num_items_in_batch=total, use_cache=False).loss, want, rtol=1e-3)

    # Each piece's targets alone, in the packed batch: its summed loss.
    segment = (packed["position_ids"] == 0).long().cumsum(1) + 100 * torch.arange(2)[:, None]
    starts = sorted(set(segment.flatten().tolist()))
    real = [s for s in starts if (packed["labels"][segment == s] != IGNORE_INDEX).any()]
    assert len(real) == len(pieces)
    models = [copy.deepcopy(ref) for _ in range(2)]
    for m in models:
        m.zero_grad(set_to_none=True)

    def rank_fn(rank: int) -> None:
        model = hf_tp.parallelize(models[rank], hf_tp.build_mesh(tp=2, device_type="cpu"), sequence_parallel=True)
        with loss_context(True):
            got, _ = training_loss(model, packed, total, fused=True)
            got.backward()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
        assert_close_dict(full_grads(model), want_grads, "grad")
        with torch.no_grad(), loss_context(True):
            for i, s in enumerate(real):
                only = dict(packed, labels=packed["labels"].masked_fill(segment != s, IGNORE_INDEX))
                piece, _ = training_loss(model, only, 1, fused=True)
                torch.testing.assert_close(piece, want_per_piece[i], rtol=RTOL, atol=1e-6)

    run_threaded(2, rank_fn)
