"""--streaming: rows packed on the fly equal the rows of the whole-dataset packing, and a stored
position gives exactly the rows an uninterrupted read gives (across epochs too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_tp.data import PadToMultipleCollator, detect_format, load_text_dataset, tokenize_dataset
from hf_tp.data.datasets import load_stream
from hf_tp.data.streaming import PackedStream, StreamingBatchSource
from tests.chat_data import chat_tokenizer, conversations
from tests.helpers import offline_datasets


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_datasets(tmp_path, monkeypatch)


@pytest.fixture
def chats(tmp_path: Path) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(12)))
    return str(path)


def stream_of(source: str, seq_len: int, masking: bool = True) -> PackedStream:
    raw = load_stream(source)
    return PackedStream(raw, detect_format(list(raw.features)), chat_tokenizer(), seq_len, masking)


@pytest.mark.parametrize("masking", [True, False])
def test_streamed_rows_are_the_packed_rows(chats: str, masking: bool) -> None:
    want = tokenize_dataset(load_text_dataset(chats), chat_tokenizer(), seq_len=17, document_masking=masking)
    stream = stream_of(chats, 17, masking)
    got = [stream.next_row() for _ in range(len(want))]
    assert got == list(want)


def test_a_stored_position_resumes_exactly_across_epochs(chats: str) -> None:
    stream = stream_of(chats, 23)
    rows_per_epoch = len(tokenize_dataset(load_text_dataset(chats), chat_tokenizer(), seq_len=23))
    for _ in range(rows_per_epoch - 2):
        stream.next_row()
    state = json.loads(json.dumps(stream.state_dict()))  # as a checkpoint stores it
    want = [stream.next_row() for _ in range(rows_per_epoch)]  # into the second epoch
    assert stream.epoch == 1
    resumed = stream_of(chats, 23)
    resumed.load_state_dict(state)
    assert [resumed.next_row() for _ in range(rows_per_epoch)] == want


def test_batch_source_keeps_the_position_before_each_step(chats: str) -> None:
    def source() -> StreamingBatchSource:
        return StreamingBatchSource(stream_of(chats, 16), 4, PadToMultipleCollator(0), 1, 2, 1, 2, torch.device("cpu"))

    first = source()
    for step in range(3):  # step 2 read ahead, as the loop prefetches it
        first(step)
    state = first.state_for(2)
    want = first(3)
    second = source()
    second.resume_at(2, json.loads(json.dumps(state)))
    second(2)
    got = second(3)
    assert got.num_targets == want.num_targets and got.tokens == want.tokens
    for a, b in zip(got.micro_batches, want.micro_batches, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(RuntimeError, match="a stream is read in order: step 4 is next, not 6"):
        second(6)
