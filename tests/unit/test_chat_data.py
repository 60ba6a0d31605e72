"""Chat and prompt/completion data: exact assistant-only label masks, column detection, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from hf_tp.cli.main import main
from hf_tp.data import PadToMultipleCollator, detect_format, tokenize_dataset
from hf_tp.data.formats import DataFormat, encode_batch
from hf_tp.data.formats.chat import encode_conversation
from hf_tp.data.formats.completion import encode_pair
from hf_tp.data.sampler import GlobalBatchOrder
from hf_tp.data.steps import StepBatchSource
from hf_tp.labels import IGNORE_INDEX
from tests.chat_data import CHATML, CHATML_GENERATION, chat_tokenizer, conversations
from tests.helpers import offline_datasets, tiny_config, tiny_model

TOOL_CHAT = conversations()[1]  # system, user, assistant, user, assistant (a tool call), tool, assistant
assert [m["role"] for m in TOOL_CHAT].count("tool") == 1


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_datasets(tmp_path, monkeypatch)


def expected_labels(tok, messages) -> tuple[list[int], list[int]]:
    """The oracle, from the ChatML layout: each turn is <|im_start|> ROLE WORDS... <|im_end|> (the
    newline is no token of the word-level tokenizer); targets are an assistant turn's words and its
    <|im_end|>, the token that ends the turn."""
    ids, labels = [], []
    for m in messages:
        turn = tok.convert_tokens_to_ids(["<|im_start|>", m["role"], *m["content"].split(), "<|im_end|>"])
        ids += turn
        labels += [IGNORE_INDEX, IGNORE_INDEX, *turn[2:]] if m["role"] == "assistant" else [IGNORE_INDEX] * len(turn)
    return ids, labels


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["prefix-renderings", "generation-blocks"])
def test_assistant_only_labels_are_exactly_the_assistant_turns(template: str) -> None:
    tok = chat_tokenizer(template)
    for messages in conversations()[:6]:
        ids, labels = encode_conversation(tok, messages, assistant_only=True, where="test")
        assert (ids, labels) == expected_labels(tok, messages)
        text = tok.apply_chat_template(messages, tokenize=False)
        assert tok.decode(ids) == tok.decode(tok(text, add_special_tokens=False)["input_ids"])
    ids, labels = encode_conversation(tok, TOOL_CHAT, assistant_only=False, where="test")
    assert labels == ids


def test_chat_dataset_is_detected_packed_and_masked(tmp_path: Path) -> None:
    tok = chat_tokenizer()
    ds = datasets.Dataset.from_list([{"messages": c} for c in conversations()[:8]])
    assert detect_format(ds.column_names).kind == "chat"
    rows = tokenize_dataset(ds, tok, seq_len=16, pack=False)
    for row, conv in zip(rows, conversations()[:8], strict=True):
        ids, labels = expected_labels(tok, conv)
        assert row["input_ids"] == ids[:16] and row["labels"] == labels[:16]
    packed = tokenize_dataset(ds, tok, seq_len=16)
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    stream_ids = [t for c in conversations()[:8] for t in expected_labels(tok, c)[0]]
    assert [t for r in packed["input_ids"] for t in r] == stream_ids[: 16 * len(packed)]


def test_prompt_completion_labels_only_the_completion() -> None:
    tok = chat_tokenizer()
    ids, labels = encode_pair(tok, "where should i go ?", " go to paris .", completion_only=True, where="t")
    eos = tok.eos_token_id
    assert ids == tok.convert_tokens_to_ids("where should i go ? go to paris .".split()) + [eos]
    assert labels == [IGNORE_INDEX] * 5 + ids[5:]
    _, all_labels = encode_pair(tok, "where ?", " paris", completion_only=False, where="t")
    assert IGNORE_INDEX not in all_labels
    # Conversational pairs: the prompt's turns are context, the completion's assistant turns the targets.
    ids, labels = encode_pair(tok, TOOL_CHAT[:4], TOOL_CHAT[4:], completion_only=True, where="t")
    want_ids, want_labels = expected_labels(tok, TOOL_CHAT)
    first_completion = len(expected_labels(tok, TOOL_CHAT[:4])[0])
    assert ids == want_ids and labels == [IGNORE_INDEX] * first_completion + want_labels[first_completion:]


def test_detection_and_overrides() -> None:
    assert detect_format(["text", "messages"]).column == "text"
    assert detect_format(["id", "messages"]).kind == "chat"
    assert detect_format(["prompt", "completion"]).kind == "completion"
    assert detect_format(["text", "conv"], messages_column="conv").describe() == "chat (column 'conv')"
    with pytest.raises(ValueError, match=r"its columns are: a, b; pass --text-column .* or --messages-column"):
        detect_format(["a", "b"], label="'x'")
    with pytest.raises(ValueError, match="messages column 'conv' not in dataset 'x'; its columns are: a"):
        detect_format(["a"], messages_column="conv", label="'x'")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "hi"}], r"row 1 of dataset .*: the conversation has no assistant turn"),
        (["hi", "there"], r"message 0 is not a \{'role': str, 'content': str\} mapping"),
        ([{"from": "human", "value": "hi"}], "message 0 is not a"),
        ([{"role": "user", "content": 3}], r"message 0 \(user\) has content 3; it must be a string"),
        ([], "a conversation must be a non-empty list"),
    ],
)
def test_bad_conversations_are_one_line_errors(messages, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        encode_batch(DataFormat("chat", "messages"), {"messages": [messages]}, [0], chat_tokenizer(), "'x'")
    assert "\n" not in str(err.value)


def test_template_errors() -> None:
    tok = chat_tokenizer()
    tok.chat_template = None
    ds = datasets.Dataset.from_dict({"messages": [TOOL_CHAT]})
    with pytest.raises(ValueError, match="the tokenizer of --model has no chat template"):
        tokenize_dataset(ds, tok, seq_len=8)
    # A template whose earlier turns change once later ones follow: the assistant text cannot be located.
    tok.chat_template = "{{ messages|length }}" + CHATML
    with pytest.raises(ValueError, match=r"renders the turns before assistant message 2 differently"):
        encode_conversation(tok, TOOL_CHAT, assistant_only=True, where="t")


def test_a_batch_without_targets_is_an_error() -> None:
    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX] * 3}] * 2
    source = StepBatchSource(rows, GlobalBatchOrder(2, 2), PadToMultipleCollator(0), 0, 1, 2, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"every label of step 1's global batch is masked"):
        source(0)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chatmodel")
    tok = chat_tokenizer()
    tiny_model(tiny_config("llama", vocab_size=len(tok))).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_rejects_bad_chat_data_before_launch(chat_model: Path, tmp_path: Path, capsys) -> None:
    def run(rows: list[dict], *flags: str) -> str:
        data = write_jsonl(tmp_path / "d.jsonl", rows)
        argv = ["train", "--model", str(chat_model), "--dataset", str(data), "--seq-len", "16", "--tp", "2"]
        assert main([*argv, "--output-dir", str(tmp_path / "out"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-tp train: error: ") and "\n" not in err, err
        return err

    assert "message 0 is not a {'role': str, 'content': str} mapping" in run([{"messages": [["user", "hi"]]}])
    no_assistant = [{"messages": [{"role": "user", "content": "hi"}]}]
    assert "the conversation has no assistant turn" in run(no_assistant)
    assert "its columns are: body" in run([{"body": "a"}])
    assert "messages column 'chat' not in dataset" in run([{"text": "a"}], "--messages-column", "chat")
    assert "--dataset-config x names a configuration of a Hub dataset" in run([{"text": "a"}], "--dataset-config", "x")
    (chat_model / "chat_template.jinja").rename(tmp_path / "template")
    try:
        assert "has no chat template" in run([{"messages": TOOL_CHAT}])
    finally:
        (tmp_path / "template").rename(chat_model / "chat_template.jinja")
