"""hf_tp.data: padding collator, dataset loading and tokenization, global batch plan (no network)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_tp.data import GlobalBatchOrder, PadToMultipleCollator, load_text_dataset, tokenize_dataset
from tests.helpers import offline_datasets

WORDS = ["<unk>", "</s>", "a", "b", "c", "d", "e"]
EOS = 1


@pytest.fixture(autouse=True)
def _offline_and_private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_datasets(tmp_path, monkeypatch)


def word_tokenizer(eos: bool = True) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over WORDS: "a b" -> [2, 3], built offline."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>" if eos else None)


def ids_of(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


# --- collator ---------------------------------------------------------------------------------


def test_collator_pads_to_a_multiple_with_masked_labels() -> None:
    batch = PadToMultipleCollator(pad_token_id=0, multiple_of=4)(
        [{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]
    )
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long and t.shape == (2, 8) for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 8, 9, -100, -100, -100], [-100, 2, 3, -100, -100, -100, -100, -100]]


def test_collator_keeps_exact_multiples_and_given_masks() -> None:
    collate = PadToMultipleCollator(pad_token_id=9, multiple_of=2)
    batch = collate([{"input_ids": [1, 2, 3, 4], "attention_mask": [0, 1, 1, 1]}, {"input_ids": [1]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [1, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert PadToMultipleCollator(pad_token_id=0)([{"input_ids": [1, 2, 3]}])["input_ids"].shape == (1, 3)


def test_collator_errors() -> None:
    with pytest.raises(ValueError, match="multiple_of must be a positive integer, got multiple_of=0"):
        PadToMultipleCollator(pad_token_id=0, multiple_of=0)
    collate = PadToMultipleCollator(pad_token_id=0, multiple_of=2)
    with pytest.raises(ValueError, match="empty list of examples"):
        collate([])
    with pytest.raises(ValueError, match="example 1 has 2 labels but 3 input_ids; they must have the same length"):
        collate([{"input_ids": [1]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}])


# --- loading ----------------------------------------------------------------------------------


def write(path: Path, rows: list[str], fmt: str) -> Path:
    if fmt == "txt":
        path.write_text("".join(r + "\n" for r in rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    elif fmt == "parquet":
        pd.DataFrame({"text": rows, "id": range(len(rows))}).to_parquet(path)
    elif fmt == "csv":
        pd.DataFrame({"text": rows, "id": range(len(rows))}).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet", "csv"])
def test_load_files_and_directories(tmp_path: Path, fmt: str) -> None:
    f = write(tmp_path / f"one.{fmt}", ["a b", "c d e"], fmt)
    ds = load_text_dataset(str(f))
    assert ds["text"] == ["a b", "c d e"]
    assert ds.info.dataset_name == str(f)
    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    write(folder / f"b.{fmt}", ["c"], fmt)
    write(folder / "sub" / f"a.{fmt}", ["d"], fmt)
    (folder / "README.md").write_text("ignored")
    assert sorted(load_text_dataset(str(folder))["text"]) == ["c", "d"]


def test_load_text_column_and_split_slice(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"body": w}) + "\n" for w in ["a", "b", "c"]))
    assert load_text_dataset(str(f), text_column="body", split="train[:2]")["body"] == ["a", "b"]


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"dataset not found: 'definitely-not/a-dataset-xyz' is not a local file/directory and not in the "
        r"datasets cache, and HF_HUB_OFFLINE is set; unset it to download the dataset, or pass a local file$",
    ):
        load_text_dataset("definitely-not/a-dataset-xyz")
    with pytest.raises(ValueError, match=r"dataset not found: '.*nope/x\.jsonl' is neither .*no such file"):
        load_text_dataset(str(tmp_path / "nope" / "x.jsonl"))
    for name, content in [("empty.txt", ""), ("empty.jsonl", ""), ("blank.jsonl", "\n\n")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match=rf"^dataset '.*{name}' is empty$"):
            load_text_dataset(str(tmp_path / name))
    write(tmp_path / "header.csv", [], "csv")
    with pytest.raises(ValueError, match=r"^dataset '.*header\.csv' is empty$"):
        load_text_dataset(str(tmp_path / "header.csv"))
    f = write(tmp_path / "cols.jsonl", ["a"], "jsonl")
    with pytest.raises(
        ValueError,
        match=r"^text column 'body' not in dataset '.*cols\.jsonl'; its columns are: text, id; pass --text-column$",
    ):
        load_text_dataset(str(f), text_column="body")
    with pytest.raises(ValueError, match=r"text column 'id' of dataset .* holds Value\('int64'\), not strings"):
        load_text_dataset(str(f), text_column="id")
    (tmp_path / "x.xlsx").write_text("a")
    with pytest.raises(
        ValueError,
        match=r"unsupported file extension '\.xlsx' .*; supported: \.txt, \.json, \.jsonl, \.parquet, \.csv, \.arrow$",
    ):
        load_text_dataset(str(tmp_path / "x.xlsx"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"\n')
    with pytest.raises(ValueError, match=r"cannot read dataset '.*bad\.jsonl' as json files \(.+\)"):
        load_text_dataset(str(tmp_path / "bad.jsonl"))


def test_prelaunch_check_rejects_what_loading_rejects_from_the_first_row(tmp_path: Path) -> None:
    """check_text_dataset (run by the launching process, before any rank) raises load_text_dataset's
    one-line errors, reading only a file's size or first row."""
    from hf_tp.data.datasets import check_text_dataset

    for name, content in [("empty.txt", ""), ("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("arr.json", "[]")]:
        (tmp_path / name).write_text(content)
    write(tmp_path / "header.csv", [], "csv")
    cols = write(tmp_path / "cols.jsonl", ["a"], "jsonl")
    (tmp_path / "x.xlsx").write_text("a")
    cases = [(str(tmp_path / n), "text") for n in ("empty.txt", "empty.jsonl", "blank.jsonl", "arr.json", "header.csv")]
    cases += [(str(cols), "body"), (str(tmp_path / "x.xlsx"), "text"), (str(tmp_path / "no" / "x.txt"), "text")]
    cases += [("definitely-not/a-dataset-xyz", "text"), (str(write(tmp_path / "t.txt", ["a"], "txt")), "body")]
    for source, column in cases:
        with pytest.raises(ValueError) as loading:
            load_text_dataset(source, text_column=column)
        with pytest.raises(ValueError) as checking:
            check_text_dataset(source, text_column=column)
        assert str(checking.value) == str(loading.value)
    with pytest.raises(ValueError, match=r"text column 'id' of dataset .* holds .*, not strings; pass --text-column"):
        check_text_dataset(str(cols), text_column="id")
    for fmt in ("txt", "jsonl", "parquet", "csv"):
        check_text_dataset(str(write(tmp_path / f"ok.{fmt}", ["a b"], fmt)))


def test_directory_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("a")
    with pytest.raises(ValueError, match="no data files in directory .*; supported extensions: .txt"):
        load_text_dataset(str(tmp_path))
    write(tmp_path / "a.txt", ["a"], "txt")
    write(tmp_path / "b.csv", ["b"], "csv")
    with pytest.raises(ValueError, match=r"mixes file types \(\.csv, \.txt\); keep files of one type in it"):
        load_text_dataset(str(tmp_path))


# --- tokenization -----------------------------------------------------------------------------


DOCS = ["a b c", "", "d e", "   ", "a a a a b", "c"]


def test_packing_is_exact_over_the_whole_stream() -> None:
    ds = datasets.Dataset.from_dict({"text": DOCS * 50, "other": list(range(300))})
    stream = [t for doc in DOCS * 50 if doc.strip() for t in ids_of(doc) + [EOS]]
    for seq_len in (1, 4, 7):
        out = tokenize_dataset(ds, word_tokenizer(), seq_len=seq_len)  # 300 rows: several map batches
        assert out.column_names == ["input_ids", "labels", "position_ids"]
        assert len(out) == len(stream) // seq_len
        blocks = out["input_ids"]
        assert all(len(b) == seq_len for b in blocks)
        assert [t for b in blocks for t in b] == stream[: len(out) * seq_len]
        plain = tokenize_dataset(ds, word_tokenizer(), seq_len=seq_len, document_masking=False)
        assert plain.column_names == ["input_ids", "labels"] and plain["labels"] == blocks
    no_eos = tokenize_dataset(ds, word_tokenizer(eos=False), seq_len=3)
    assert [t for b in no_eos["input_ids"] for t in b][:6] == ids_of("a b c d e a")


def test_packed_rows_restart_positions_per_document_and_mask_their_first_labels() -> None:
    ds = datasets.Dataset.from_dict({"text": ["a b c", "d e", "a a a a b"]})
    out = tokenize_dataset(ds, word_tokenizer(), seq_len=5)
    # stream: a b c </s> | d e </s> | a a a a b </s>; rows of 5 cut the third document
    assert out["input_ids"] == [ids_of("a b c") + [EOS, 5], [6, EOS] + ids_of("a a a")]
    assert out["position_ids"] == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    assert out["labels"] == [[-100, 3, 4, EOS, -100], [-100, EOS, -100, 2, 2]]


def test_packing_across_map_batches() -> None:
    ds = datasets.Dataset.from_dict({"text": ["a b c"] * 3000})  # > the 1000-row map batch
    out = tokenize_dataset(ds, word_tokenizer(), seq_len=5)
    stream = [2, 3, 4, EOS] * 3000
    assert out["input_ids"] == [stream[i : i + 5] for i in range(0, len(stream) - 4, 5)]


def test_unpacked_rows_are_truncated_and_empty_ones_dropped() -> None:
    ds = datasets.Dataset.from_dict({"text": DOCS})
    out = tokenize_dataset(ds, word_tokenizer(), seq_len=3, pack=False)
    assert out["input_ids"] == [ids_of("a b c"), ids_of("d e") + [EOS], ids_of("a a a"), ids_of("c") + [EOS]]


def test_tokenize_from_loaded_file_and_errors(tmp_path: Path) -> None:
    ds = load_text_dataset(str(write(tmp_path / "t.txt", ["a b", "c"], "txt")))
    assert tokenize_dataset(ds, word_tokenizer(), seq_len=5)["input_ids"] == [[2, 3, EOS, 4, EOS]]
    with pytest.raises(
        ValueError,
        match=r"^dataset '.*t\.txt' has only 5 tokens, fewer than one block of seq_len=6; lower --seq-len or add data$",
    ):
        tokenize_dataset(ds, word_tokenizer(), seq_len=6)
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got seq_len=0"):
        tokenize_dataset(ds, word_tokenizer(), seq_len=0)
    blank = datasets.Dataset.from_dict({"text": ["", "  "]})
    with pytest.raises(ValueError, match=r"dataset \(in memory\) has no tokens: every document in it is empty"):
        tokenize_dataset(blank, word_tokenizer(), seq_len=2)
    with pytest.raises(ValueError, match=r"dataset \(in memory\) has no tokens"):
        tokenize_dataset(blank, word_tokenizer(), seq_len=2, pack=False)
    with pytest.raises(ValueError, match="text column 'body' not in dataset"):
        tokenize_dataset(blank, word_tokenizer(), text_column="body", seq_len=2)


# --- global batch plan ------------------------------------------------------------------------


def test_every_index_once_per_epoch_and_steps_straddle_epochs() -> None:
    plan = GlobalBatchOrder(num_examples=10, global_batch=4, seed=3)
    assert plan.steps_per_epoch == 2
    stream = [i for s in range(5) for i in plan.step_indices(s)]  # 20 = two whole epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] == torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    assert stream[10:] == torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    assert plan.step_indices(2) == stream[8:12]  # the straddling step
    assert GlobalBatchOrder(num_examples=10, global_batch=4, seed=3).step_indices(7) == plan.step_indices(7)
    big = GlobalBatchOrder(num_examples=3, global_batch=7)  # one step spans three epochs
    assert big.steps_per_epoch == 0 and sorted(Counter(big.step_indices(0)).values()) == [2, 2, 3]


@pytest.mark.parametrize("step", [0, 1, 2, 5])
def test_local_indices_cover_the_same_batch_for_every_split(step: int) -> None:
    plan = GlobalBatchOrder(num_examples=9, global_batch=4, seed=1)
    splits = [(2, 2, 1), (1, 4, 1), (1, 1, 4), (2, 1, 2), (4, 1, 1)]  # (dp, micro_batch, grad_accum)
    expected = plan.step_indices(step)
    for dp, micro, accum in splits:
        per_rank = [plan.local_indices(step, dp_rank=r, dp=dp, micro_batch=micro, grad_accum=accum) for r in range(dp)]
        assert all(len(m) == accum and all(len(rows) == micro for rows in m) for m in per_rank)
        flat = [i for m in range(accum) for r in range(dp) for i in per_rank[r][m]]
        assert flat == expected  # micro-step m over all ranks is the m-th contiguous slice
    assert plan.local_indices(step, dp_rank=1, dp=2, micro_batch=2, grad_accum=1) == [expected[2:4]]


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match="num_examples=0"):
        GlobalBatchOrder(num_examples=0, global_batch=4)
    with pytest.raises(ValueError, match="global_batch must be a positive integer, got global_batch=0"):
        GlobalBatchOrder(num_examples=4, global_batch=0)
    plan = GlobalBatchOrder(num_examples=10, global_batch=8)
    with pytest.raises(
        ValueError, match=r"global_batch \(8\) must equal micro_batch \* dp \* grad_accum \(2\*2\*1=4\)"
    ):
        plan.local_indices(0, dp_rank=0, dp=2, micro_batch=2, grad_accum=1)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\), got dp_rank=2"):
        plan.local_indices(0, dp_rank=2, dp=2, micro_batch=2, grad_accum=2)
    with pytest.raises(ValueError, match="grad_accum must be a positive integer, got grad_accum=0"):
        plan.local_indices(0, dp_rank=0, dp=2, micro_batch=2, grad_accum=0)
    with pytest.raises(ValueError, match="step must be >= 0, got step=-1"):
        plan.step_indices(-1)


def test_step_batches_count_the_global_batch_and_split_the_local_one() -> None:
    from hf_tp.data.steps import StepBatchSource

    rows = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 5, 2, 4, 6, 1, 7, 2)]})
    plan = GlobalBatchOrder(num_examples=len(rows), global_batch=4, seed=0)
    collate = PadToMultipleCollator(pad_token_id=0, multiple_of=2)
    per_rank = []
    for dp_rank in range(2):
        source = StepBatchSource(
            rows, plan, collate, dp_rank, 2, micro_batch=1, grad_accum=2, device=torch.device("cpu")
        )
        per_rank.append(source(1))
    lengths = [len(rows[i]["input_ids"]) for i in plan.step_indices(1)]
    for got in per_rank:  # the divisor and token count are the global batch's, equal on every rank
        assert (got.num_targets, got.tokens) == (sum(n - 1 for n in lengths), sum(lengths))
        assert len(got.micro_batches) == 2 and all(b["input_ids"].shape[0] == 1 for b in got.micro_batches)
        assert all(b["input_ids"].shape[1] % 2 == 0 for b in got.micro_batches)  # padded to tp
    seen = sorted(int(b["attention_mask"].sum()) for got in per_rank for b in got.micro_batches)
    assert seen == sorted(lengths)  # the two ranks' micro-batches are the step's four examples


def test_arrow_files_and_split_slices(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.table({"text": ["a b", "c", "d e", "a"]})
    with pa.ipc.new_stream(str(tmp_path / "part.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert load_text_dataset(str(tmp_path / "part.arrow"))["text"] == ["a b", "c", "d e", "a"]
    assert load_text_dataset(str(tmp_path / "part.arrow"), split="train[:50%]")["text"] == ["a b", "c"]
