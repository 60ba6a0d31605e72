"""Malformed data rows (issue 27, item 5): every bad file stops before launch with a line naming the
row, or with --skip-bad-rows its bad rows are dropped and reported; never an error from deep inside.

The fuzz test writes seeded random mutations of valid text, chat and prompt/completion rows and runs
them through what the launcher checks (every row) and what a rank does (tokenize)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets
import pytest

from hf_tp.cli.main import main
from hf_tp.data import load_text_dataset, tokenize_dataset
from hf_tp.data.datasets import check_text_dataset
from hf_tp.data.formats import detect_format
from hf_tp.data.formats.rows import ROW_COLUMN
from hf_tp.data.streaming import PackedStream
from tests.chat_data import CHATML, chat_tokenizer, conversations
from tests.helpers import offline_datasets

# ChatML that refuses roles it does not know, as many real templates do (raise_exception).
STRICT_CHATML = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}" + CHATML
)
NAMES_A_ROW = re.compile(r"\brow \d+ of dataset '")
JUNK = [None, 5, 2.5, True, "", " ", [], {}, ["x"], {"a": 1}, [None], [{"role": "user"}]]


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_datasets(tmp_path, monkeypatch)


def valid_row(kind: str, rng: random.Random) -> dict:
    conv = rng.choice(conversations(8))
    if kind == "text":
        return {"text": " ".join(m["content"] for m in conv)}
    if kind == "chat":
        return {"messages": conv}
    return {"prompt": conv[1]["content"], "completion": " " + conv[2]["content"]}


def mutate(row: dict, rng: random.Random) -> dict:
    """One random corruption: a junk value, a missing key, an empty message, a role the template rejects."""
    row = json.loads(json.dumps(row))
    key = rng.choice(sorted(row))
    how = rng.randrange(4)
    if how == 0:
        row[key] = rng.choice(JUNK)
    elif how == 1:
        del row[key]
    elif how == 2 and isinstance(row[key], list):
        msg = rng.choice(row[key])
        msg[rng.choice(["role", "content"])] = rng.choice([None, 3, "robot", ""])
    else:
        row[key] = "robot" if isinstance(row[key], str) else [{"role": "robot", "content": "hi"}]
    return row


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_like_hf_tp(path: Path, skip: bool, notes: list[str], seq_len: int = 8) -> datasets.Dataset:
    """What ``hf-tp train`` does with a local file: the launcher's check of every row, then a rank's
    load and tokenization (the chat template refuses unknown roles)."""
    check_text_dataset(str(path), every_row=True, skip_bad_rows=skip)
    ds = load_text_dataset(str(path))
    fmt = detect_format(ds.column_names)
    return tokenize_dataset(
        ds, chat_tokenizer(STRICT_CHATML), seq_len=seq_len, fmt=fmt, skip_bad_rows=skip, report=notes.append
    )


@pytest.mark.parametrize("seed", range(12))
def test_fuzzed_files_pass_or_name_a_row(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    kind = ["text", "chat", "completion"][seed % 3]
    rows = [valid_row(kind, rng) for _ in range(10)]
    bad = sorted(rng.sample(range(2, 10), rng.randint(1, 3)))
    for i in bad:
        rows[i] = mutate(rows[i], rng)
    path = write_rows(tmp_path / f"{kind}-{seed}.jsonl", rows)
    try:
        run_like_hf_tp(path, False, [])
        stopped_at = None
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message and NAMES_A_ROW.match(message), message
        stopped_at = int(message.split()[1])
        assert stopped_at in bad, (message, bad)
    notes: list[str] = []
    out = run_like_hf_tp(path, True, notes)
    assert len(out) > 0
    if stopped_at is None:
        assert notes == []  # what passes without the flag loses no row with it
        return
    assert len(notes) == 1 and re.search(r"dropped \d+ bad rows? of dataset '", notes[0]), notes
    dropped = [int(n) for n in re.search(r"': rows? ([\d, ]+) \(", notes[0]).group(1).split(", ")]
    assert stopped_at in dropped and set(dropped) <= set(bad), (dropped, bad)


def test_cli_names_the_bad_row_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_rows(tmp_path / "mixed.jsonl", [{"text": "a b"}, {"text": None}, {"text": 5}])
    assert main(["train", "--dataset", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-tp train: error: row 1 of dataset") and "\n" not in err, err
    assert "column 'text' holds null" in err and "--skip-bad-rows" in err


def test_prompt_completion_with_a_number_is_named_as_such(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": 3}])
    with pytest.raises(ValueError, match=r"^row 0 of dataset '.*pc\.jsonl': the completion is int 3, not a string"):
        check_text_dataset(str(path))


def test_text_column_with_null_and_a_number_names_the_rows(tmp_path: Path) -> None:
    path = write_rows(
        tmp_path / "mixed.jsonl", [{"text": "you are a helpful travel agent ."}, {"text": None}, {"text": 5}]
    )
    with pytest.raises(
        ValueError, match=r"^row 1 of dataset '.*mixed\.jsonl': column 'text' holds null .*; 1 more bad row \(2\)"
    ):
        check_text_dataset(str(path), every_row=True)
    notes: list[str] = []
    out = run_like_hf_tp(path, True, notes)
    assert notes == [
        f"hf-tp: --skip-bad-rows dropped 2 bad rows of dataset '{path}': rows 1, 2 (column 'text' holds null (the "
        "key is missing or null), not a string; column 'text' holds int 5, not a string)"
    ]
    assert out["input_ids"] == [chat_tokenizer()("you are a helpful travel agent .")["input_ids"] + [3]]  # + eos


def test_a_role_the_template_rejects_is_named_or_skipped(tmp_path: Path) -> None:
    chats = [{"messages": c} for c in conversations(4)]
    chats[2]["messages"][1]["role"] = "robot"
    path = write_rows(tmp_path / "chat.jsonl", chats)
    with pytest.raises(ValueError, match=r"^row 2 of dataset .*: the chat template rejects .*unknown role robot"):
        run_like_hf_tp(path, False, [])
    notes: list[str] = []
    skipped = run_like_hf_tp(path, True, notes)
    assert len(notes) == 1 and "dropped 1 bad row of dataset" in notes[0] and ": row 2 (" in notes[0]
    kept = [c for i, c in enumerate(chats) if i != 2]
    full = tokenize_dataset(datasets.Dataset.from_list(kept), chat_tokenizer(STRICT_CHATML), seq_len=8)
    assert skipped["input_ids"] == full["input_ids"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b'{"text": "bad \xff here"}', r"is not valid UTF-8 .*"),
        (b"[1, 2]", r"is a JSON list \(\[1, 2\]\), not an object of columns"),
        (b'{"text": "cut', r"is not valid JSON"),
    ],
    ids=["utf8", "list", "truncated"],
)
def test_an_unreadable_line_is_named_even_with_skip(tmp_path: Path, line: bytes, says: str) -> None:
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"text": "good"}\n' + line + b'\n{"text": "fine"}\n')
    for skip in (False, True):
        with pytest.raises(ValueError, match=rf"line 2 of .*u\.jsonl {says}.*cannot be skipped"):
            check_text_dataset(str(path), every_row=skip, skip_bad_rows=skip)


def test_a_1_mb_document_is_packed_into_many_rows(tmp_path: Path) -> None:
    words = " ".join(m["content"] for m in conversations(1)[0]) + " "
    doc = words * (1_000_000 // len(words))  # 10 MB: the same, ten times slower (docs/data.md)
    path = write_rows(tmp_path / "big.jsonl", [{"text": doc}])
    rows = run_like_hf_tp(path, False, [], seq_len=1024)
    assert len(rows) == (len(doc.split()) + 1) // 1024 > 200


def test_streaming_names_or_skips_a_bad_row(tmp_path: Path) -> None:
    rows = [valid_row("completion", random.Random(i)) for i in range(6)]
    rows[3] = {"prompt": "a", "completion": None}
    stream = datasets.load_dataset("json", data_files=str(write_rows(tmp_path / "s.jsonl", rows)), streaming=True)
    stream = stream["train"]
    stream.info.dataset_name = "s.jsonl"
    fmt = detect_format(["prompt", "completion"])
    with pytest.raises(ValueError, match=r"^row 3 of dataset 's\.jsonl': the completion is null"):
        packed = PackedStream(stream, fmt, chat_tokenizer(), 8, True)
        for _ in range(20):
            packed.next_row()
    notes: list[str] = []
    packed = PackedStream(stream, fmt, chat_tokenizer(), 8, True, skip_bad_rows=True, report=notes.append)
    for _ in range(20):
        packed.next_row()
    assert notes == [
        "hf-tp: --skip-bad-rows dropped row 3 of dataset 's.jsonl': the completion is null, not a string"
        " like the prompt"
    ]


def test_a_split_names_rows_by_their_number_in_the_file() -> None:
    # what hf_tp.train.data does before --eval-split: rows keep their file numbers through the shuffle
    rows = [{"text": "you are a helpful travel agent ."} for _ in range(20)]
    rows[13] = {"text": None}
    ds = datasets.Dataset.from_list(rows)
    ds = ds.add_column(ROW_COLUMN, list(range(len(ds)))).train_test_split(test_size=0.5, seed=0)
    part = next(p for p in ds.values() if 13 in p[ROW_COLUMN])
    assert part[ROW_COLUMN].index(13) != 13
    with pytest.raises(ValueError, match=r"^row 13 of dataset .*: column 'text' holds null"):
        tokenize_dataset(part, chat_tokenizer(), seq_len=8)


def test_skip_refuses_to_drop_every_row() -> None:
    ds = datasets.Dataset.from_list([{"prompt": "a", "completion": ""}, {"prompt": "b", "completion": " "}])
    with pytest.raises(ValueError, match=r"would drop every row of dataset .*; the first: row 0 .*completion is empty"):
        tokenize_dataset(ds, chat_tokenizer(), seq_len=8, skip_bad_rows=True)
