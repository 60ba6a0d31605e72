"""Malformed data rows (issue 27, item 5): every bad file stops before launch with a line naming the
row, or with --skip-bad-rows its bad rows are dropped and reported; never an error from deep inside.
A row of a local JSON-lines, text or CSV file is named by its line ("line 3 of FILE", what
``sed -n 3p FILE`` prints), other rows by their number counted from 1 ("row 1 of dataset 'x'").

The fuzz test writes seeded random mutations of valid text, chat and prompt/completion rows and runs
them through what the launcher checks (every row) and what a rank does (tokenize)."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
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
NAMES_A_LINE = re.compile(r"^line \d+ of \S+\.jsonl: ")
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
        assert "\n" not in message and NAMES_A_LINE.match(message), message
        stopped_at = int(message.split()[1]) - 1  # (no blank lines: row i is on line i + 1)
        assert stopped_at in bad, (message, bad)
    notes: list[str] = []
    out = run_like_hf_tp(path, True, notes)
    assert len(out) > 0
    if stopped_at is None:
        assert notes == []  # what passes without the flag loses no row with it
        return
    assert len(notes) == 1 and re.search(r"dropped \d+ bad rows? of dataset '", notes[0]), notes
    dropped = [int(n) - 1 for n in re.search(r"': lines? ([\d, ]+) of ", notes[0]).group(1).split(", ")]
    assert stopped_at in dropped and set(dropped) <= set(bad), (dropped, bad)


def test_cli_names_the_bad_row_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_rows(tmp_path / "mixed.jsonl", [{"text": "a b"}, {"text": None}, {"text": 5}])
    assert main(["train", "--dataset", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-tp train: error: line 2 of {path}: ") and "\n" not in err, err
    assert "column 'text' holds null" in err and "--skip-bad-rows" in err


def test_prompt_completion_with_a_number_is_named_as_such(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": 3}])
    with pytest.raises(ValueError, match=r"^line 1 of \S*pc\.jsonl: the completion is int 3, not a string"):
        check_text_dataset(str(path))


def test_text_column_with_null_and_a_number_names_the_rows(tmp_path: Path) -> None:
    path = write_rows(
        tmp_path / "mixed.jsonl", [{"text": "you are a helpful travel agent ."}, {"text": None}, {"text": 5}]
    )
    with pytest.raises(
        ValueError, match=r"^line 2 of \S*mixed\.jsonl: column 'text' holds null .*; 1 more bad row \(line 3\); fix it"
    ):
        check_text_dataset(str(path), every_row=True)
    notes: list[str] = []
    out = run_like_hf_tp(path, True, notes)
    assert notes == [
        f"hf-tp: --skip-bad-rows dropped 2 bad rows of dataset '{path}': lines 2, 3 of {path} (column 'text' holds "
        "null (the key is missing or null), not a string; column 'text' holds int 5, not a string)"
    ]
    assert out["input_ids"] == [chat_tokenizer()("you are a helpful travel agent .")["input_ids"] + [3]]  # + eos


def test_a_role_the_template_rejects_is_named_or_skipped(tmp_path: Path) -> None:
    chats = [{"messages": c} for c in conversations(4)]
    chats[2]["messages"][1]["role"] = "robot"
    path = write_rows(tmp_path / "chat.jsonl", chats)
    with pytest.raises(ValueError, match=r"^line 3 of \S*chat\.jsonl: the chat template rejects .*unknown role robot"):
        run_like_hf_tp(path, False, [])
    notes: list[str] = []
    skipped = run_like_hf_tp(path, True, notes)
    assert len(notes) == 1 and "dropped 1 bad row of dataset" in notes[0] and f": line 3 of {path} (" in notes[0]
    kept = [c for i, c in enumerate(chats) if i != 2]
    full = tokenize_dataset(datasets.Dataset.from_list(kept), chat_tokenizer(STRICT_CHATML), seq_len=8)
    assert skipped["input_ids"] == full["input_ids"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b'{"text": "bad \xff here"}', r"is not UTF-8 .*"),
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
    with pytest.raises(ValueError, match=r"^row 4 of dataset 's\.jsonl': the completion is null"):
        packed = PackedStream(stream, fmt, chat_tokenizer(), 8, True)
        for _ in range(20):
            packed.next_row()
    notes: list[str] = []
    packed = PackedStream(stream, fmt, chat_tokenizer(), 8, True, skip_bad_rows=True, report=notes.append)
    for _ in range(20):
        packed.next_row()
    assert notes == [
        "hf-tp: --skip-bad-rows dropped row 4 of dataset 's.jsonl': the completion is null, not a string"
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
    with pytest.raises(ValueError, match=r"^row 14 of dataset \(in memory\): column 'text' holds null"):
        tokenize_dataset(part, chat_tokenizer(), seq_len=8)


def test_skip_refuses_to_drop_every_row() -> None:
    ds = datasets.Dataset.from_list([{"prompt": "a", "completion": ""}, {"prompt": "b", "completion": " "}])
    with pytest.raises(ValueError, match=r"would drop every row of dataset .*; the first: row 1 .*completion is empty"):
        tokenize_dataset(ds, chat_tokenizer(), seq_len=8, skip_bad_rows=True)


# --- "nothing lost": files that are not UTF-8, 1-based lines, blank files ---------------------------

CONVERT = re.compile(r"convert it with (iconv -f \S+ -t utf-8 \S+ > (\S+)), then use \S+ instead")


@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_a_latin1_file_is_told_how_to_convert_it_without_loss(tmp_path: Path, suffix: str) -> None:
    lines = ["good", "fine", "café crème", "end"]
    rows = [json.dumps({"text": t}, ensure_ascii=False) if suffix == "jsonl" else t for t in lines]
    path = tmp_path / f"latin.{suffix}"
    path.write_bytes("\n".join(rows).encode("latin-1") + b"\n")
    for every_row, skip in ((True, False), (False, False), (True, True)):
        with pytest.raises(ValueError) as err:
            check_text_dataset(str(path), every_row=every_row, skip_bad_rows=skip)
        message = str(err.value)
        assert "\n" not in message and f"line 3 of {path} is not UTF-8 (byte 0xe9, 'é' in Latin-1)" in message
        assert "it looks like Latin-1 / Windows-1252" in message and "iconv -f latin1 -t utf-8" in message
        assert f"> {tmp_path / f'latin_utf8.{suffix}'}, then use" in message and "-c" not in message.split()
    if shutil.which("iconv") is None:
        return
    command, converted = CONVERT.search(message).groups()
    subprocess.run(command, shell=True, check=True)
    check_text_dataset(converted, every_row=True)
    assert load_text_dataset(converted)["text"][2] == "café crème"  # nothing lost


def test_windows_1252_quotes_are_converted_as_windows_1252(tmp_path: Path) -> None:
    path = tmp_path / "quotes.txt"
    path.write_bytes("plain\n“quoted” text\n".encode("cp1252"))
    with pytest.raises(
        ValueError, match=r"line 2 of .* \(byte 0x93, '“' in Windows-1252\); .*iconv -f cp1252 -t utf-8"
    ):
        check_text_dataset(str(path), every_row=True)


def test_a_file_mixing_utf8_and_latin1_is_not_converted_whole(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes('{"text": "naïve"}\n'.encode() + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"line 2 of .* is not UTF-8 .*mixes encodings.*grep -naxv") as err:
        check_text_dataset(str(path), every_row=True)
    assert "iconv" not in str(err.value)


def test_a_file_in_a_directory_is_replaced_by_its_conversion(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.jsonl").write_bytes('\n{"text": "b"}\n{"text": "é"}\n'.encode("latin-1"))
    bad, out = re.escape(str(tmp_path / "b.jsonl")), re.escape(str(tmp_path / "b_utf8.jsonl"))
    with pytest.raises(ValueError, match=rf"line 3 of {bad} .*iconv -f latin1 .*, then replace {bad} with {out} "):
        check_text_dataset(str(tmp_path), every_row=True)


def test_a_bad_json_line_is_named_by_its_line(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "cut\n{"text": "d"}\n')
    for every_row in (True, False):
        with pytest.raises(
            ValueError, match=rf"\(line 3 of {re.escape(str(path))} is not valid JSON .*cannot be skipped"
        ):
            check_text_dataset(str(path), every_row=every_row)


def json_reader_skips_blank_lines() -> bool:
    """Whether the installed datasets' json reader takes blank lines in a file whose column mixes
    a string and null (datasets 5 does; 4.8, the floor, fails with "Expected object or value", which
    hf_tp then names as a blank line: tests/unit/test_bad_rows.py's blankmix case)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "probe.jsonl"
        path.write_text('\n{"text": "a"}\n\n{"text": null}\n')
        try:
            datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(Path(d) / "cache"))
        except Exception:  # noqa: BLE001 - any failure of the reader: it cannot take them
            return False
    return True


BLANK_LINES_READ = pytest.mark.skipif(
    not json_reader_skips_blank_lines(), reason="this datasets release's json reader fails on these blank lines"
)


@pytest.mark.parametrize(
    ("name", "content", "line", "printed"),
    [
        ("type.jsonl", '{"text": "a"}\n{"text": 5}\n', 2, '{"text": 5}'),
        pytest.param(
            "blank-lines.jsonl", '\n{"text": "a"}\n\n   \n{"text": null}\n', 5, '{"text": null}', marks=BLANK_LINES_READ
        ),
        ("header.csv", 'text,id\n"two\nlines",1\n\n,2\n', 5, ",2"),
        ("crlf.csv", "text,id\r\na,1\r\n,2\r\n", 3, ",2\r"),
    ],
)
def test_a_bad_row_is_named_by_the_line_sed_prints(
    tmp_path: Path, name: str, content: str, line: int, printed: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content.encode())
    with pytest.raises(ValueError, match=rf"^line {line} of {re.escape(str(path))}: column 'text' holds "):
        check_text_dataset(str(path), every_row=True)
    assert content.split("\n")[line - 1] == printed  # what sed -n {line}p prints


@BLANK_LINES_READ
def test_a_slice_names_the_line_in_the_file(tmp_path: Path) -> None:
    rows = [{"text": "you are a helpful travel agent ."} for _ in range(10)]
    rows[7] = {"text": None}
    path = tmp_path / "slice.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # a blank first line: row i on line i + 2
    ds = load_text_dataset(str(path), split="train[5:]")
    with pytest.raises(ValueError, match=rf"^line 9 of {re.escape(str(path))}: column 'text' holds null"):
        tokenize_dataset(ds, chat_tokenizer(), seq_len=8)
    with pytest.raises(ValueError, match=rf"^line 9 of {re.escape(str(path))}: column 'text' holds null"):
        check_text_dataset(str(path), split="train[5:]", every_row=True)
    part = ds.add_column(ROW_COLUMN, list(range(len(ds)))).train_test_split(test_size=0.5, seed=0)
    bad = next(p for p in part.values() if 2 in p[ROW_COLUMN])
    with pytest.raises(ValueError, match=rf"^line 9 of {re.escape(str(path))}: column 'text' holds null"):
        tokenize_dataset(bad, chat_tokenizer(), seq_len=8)


@BLANK_LINES_READ
def test_a_streamed_local_file_names_lines(tmp_path: Path) -> None:
    from hf_tp.data.datasets import load_stream

    rows = [valid_row("completion", random.Random(i)) for i in range(6)]
    rows[3] = {"prompt": "a", "completion": None}
    path = tmp_path / "s.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))
    packed = PackedStream(load_stream(str(path)), detect_format(["prompt", "completion"]), chat_tokenizer(), 8, True)
    with pytest.raises(ValueError, match=rf"^line 5 of {re.escape(str(path))}: the completion is null"):
        for _ in range(20):
            packed.next_row()


def test_parquet_rows_are_counted_from_1(tmp_path: Path) -> None:
    datasets.Dataset.from_list([{"text": "a"}, {"text": None}]).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(
        ValueError, match=rf"^row 2 of {re.escape(str(tmp_path / 'p.parquet'))}: column 'text' holds null"
    ):
        check_text_dataset(str(tmp_path / "p.parquet"), every_row=True)


@pytest.mark.parametrize(
    ("name", "content"), [("blank.txt", "\n\n  \n"), ("spaces.txt", "   "), ("blank.jsonl", "\n \n\n")]
)
def test_a_blank_file_is_empty_before_launch(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    for every_row in (True, False):
        with pytest.raises(ValueError, match=rf"^dataset '{re.escape(str(path))}' is empty$"):
            check_text_dataset(str(path), split="train", text_column=None, messages_column=None, every_row=every_row)
    with pytest.raises(ValueError, match=rf"^dataset '{re.escape(str(path))}' is empty$"):
        load_text_dataset(str(path))  # what a rank raises too


def test_rows_of_blank_text_have_no_text_before_launch(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "blank-text.jsonl", [{"text": ""}, {"text": " \n "}])
    with pytest.raises(ValueError, match=r"^dataset '.*' has no text: every row of column 'text' is empty or blank"):
        check_text_dataset(str(path), every_row=True)


def test_a_blank_line_in_a_file_of_mixed_types_is_named(tmp_path: Path) -> None:
    path = tmp_path / "mix.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": 5}\n')
    at, blank = re.escape(str(path)), re.escape("grep -v '^[[:space:]]*$'")
    with pytest.raises(ValueError, match=rf"line 2 of {at} is blank, .*remove the blank lines with {blank} {at} >"):
        check_text_dataset(str(path), every_row=True)
