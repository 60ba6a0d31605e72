"""Preference data before and inside the ranks: bad pairs named in one line (or skipped and
counted with --skip-bad-rows), truncation said once, the objective and the data checked against
each other before launch, the settings through TrainConfig and YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_tp.cli.main import main
from hf_tp.data.formats import PREFERENCE, detect_format
from hf_tp.data.formats.preference import check_objective_data
from hf_tp.run.config import TrainConfig
from tests.helpers import offline_datasets
from tests.unit.test_bad_rows import run_like_hf_tp, write_rows


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_datasets(tmp_path, monkeypatch)


def _pair(prompt: str = "hi , i am ada .", chosen: str = " hello ada .", rejected: str = " go to rome .") -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "hi", "rejected": " go"}, "'chosen' is missing or null; a preference row needs both"),
        (_pair(chosen=" go to rome ."), "chosen and rejected are identical, so the pair carries no preference"),
        (_pair(chosen=""), "'chosen' is empty"),
        ({"chosen": "hi go", "rejected": "hi rome"}, "a string pair needs a 'prompt' column"),
        (
            _pair(rejected=[{"role": "assistant", "content": "go"}]),
            "chosen and rejected must both be strings or both be lists",
        ),
    ],
    ids=["missing", "identical", "empty", "no-prompt", "mixed"],
)
def test_a_bad_pair_is_named_in_one_line_or_skipped(tmp_path: Path, row: dict, says: str) -> None:
    path = write_rows(tmp_path / "pairs.jsonl", [_pair(), row, _pair(rejected=" i am dee .")])
    with pytest.raises(ValueError, match=rf"^line 2 of \S*pairs\.jsonl: {says}") as err:
        run_like_hf_tp(path, False, [], seq_len=32)
    assert "\n" not in str(err.value)
    notes: list[str] = []
    kept = run_like_hf_tp(path, True, notes, seq_len=32)
    assert len(kept) == 2 and len(notes) == 1 and f"dropped 1 bad row of dataset '{path}': line 2 of {path}" in notes[0]


def test_a_prompt_that_fills_seq_len_is_a_bad_row_and_long_pairs_are_cut(tmp_path: Path) -> None:
    long_prompt = "hi , i am ada . where should i go ? " * 3
    path = write_rows(tmp_path / "pairs.jsonl", [_pair(), _pair(prompt=long_prompt), _pair(chosen=" go to oslo " * 4)])
    with pytest.raises(ValueError, match=r"^line 2 of \S*: the prompt has 33 tokens, which fills --seq-len 12"):
        run_like_hf_tp(path, False, [], seq_len=12)
    notes: list[str] = []
    kept = run_like_hf_tp(path, True, notes, seq_len=12)
    assert len(kept) == 2 and all(len(ids) <= 12 for ids in list(kept["input_ids"]) + list(kept["rejected_input_ids"]))
    assert notes[0].startswith("hf-tp: --skip-bad-rows dropped 1 bad row")
    assert notes[1] == (
        f"hf-tp: 1 of 2 preference pairs of dataset '{path}' cut to --seq-len 12 tokens per side (the end of the "
        "completion dropped, as TRL's keep_start)"
    )


def test_objective_and_data_must_fit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fmt = detect_format(["prompt", "chosen", "rejected"])
    assert fmt.kind == PREFERENCE
    with pytest.raises(ValueError, match=r"^dataset 'p' holds preference pairs .*: pass --objective dpo"):
        check_objective_data("sft", fmt, "p")
    with pytest.raises(ValueError, match=r"^--objective simpo trains on preference pairs, but dataset 'c' is chat"):
        check_objective_data("simpo", detect_format(["messages"]), "c")
    path = write_rows(tmp_path / "text.jsonl", [{"text": "a b c"}])
    assert main(["train", "--dataset", str(path), "--objective", "dpo", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--objective dpo trains on preference pairs" in err and "\n" not in err, err
    pairs = write_rows(tmp_path / "pairs.jsonl", [_pair()])
    assert main(["train", "--dataset", str(pairs), "--objective", "dpo", "--pack", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--objective dpo does not pack pairs" in err and "\n" not in err, err


def test_settings_from_yaml_and_their_checks(tmp_path: Path) -> None:
    yaml = tmp_path / "dpo.yaml"
    yaml.write_text("objective: dpo\nbeta: 0.2\nlabel-smoothing: 0.1\n")
    cfg = TrainConfig(**TrainConfig.from_yaml(yaml))
    assert (cfg.objective, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma) == ("dpo", 0.2, 0.1, 0.5)
    assert not cfg.packs and TrainConfig().packs and not TrainConfig(pack=False).packs  # pairs: padded rows
    from transformers import LlamaConfig

    from hf_tp.run.validate import run_fingerprint

    # a run saved before pack could be unset recorded pack=True (the old default): it still resumes
    assert run_fingerprint(cfg, LlamaConfig())["pack"] is True
    cfg.validate()
    for bad, says in (
        (dict(objective="orpo"), "--objective must be one of sft, dpo, simpo"),
        (dict(objective="dpo", label_smoothing=0.5), r"--label-smoothing must be in \[0, 0.5\)"),
        (dict(objective="simpo", beta=0.0), "--beta must be positive"),
        (dict(objective="dpo", streaming=True), "--objective dpo reads whole pairs: drop --streaming"),
        (dict(objective="simpo", pack=True), r"--objective simpo does not pack pairs .*: drop --pack / pack: true"),
        (dict(objective="simpo", precompute_ref=True), "--precompute-ref is for --objective dpo"),
        (dict(objective="dpo", precompute_ref=True, eval_split=0.1), "--precompute-ref scores the training pairs only"),
    ):
        with pytest.raises(ValueError, match=says):
            TrainConfig(**bad).validate()


def test_columns_under_other_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--prompt-column / --chosen-column / --rejected-column: the same pairs as the standard names,
    before launch and in the ranks; a column that is not there, or named twice, is one line."""
    from hf_tp.data import load_text_dataset, tokenize_dataset
    from hf_tp.data.datasets import check_text_dataset
    from tests.chat_data import chat_tokenizer

    pairs = [_pair(), _pair(rejected=" i am dee .")]
    standard = write_rows(tmp_path / "pairs.jsonl", pairs)
    other = [{"question": p["prompt"], "better": p["chosen"], "worse": p["rejected"], "prompt": "x"} for p in pairs]
    renamed = write_rows(tmp_path / "renamed.jsonl", other)
    cfg = TrainConfig(prompt_column="question", chosen_column="better", rejected_column="worse", objective="dpo")
    renames = cfg.column_renames
    assert renames == {"question": "prompt", "better": "chosen", "worse": "rejected"}
    fmt, first = check_text_dataset(str(renamed), every_row=True, renames=renames)
    assert fmt.kind == PREFERENCE and first == pairs[0]  # the unchosen 'prompt' column dropped
    tok = chat_tokenizer()
    got = tokenize_dataset(load_text_dataset(str(renamed), renames=renames), tok, seq_len=32)
    want = tokenize_dataset(load_text_dataset(str(standard)), tok, seq_len=32)
    assert got.to_dict() == want.to_dict() and len(got) == 2
    with pytest.raises(ValueError, match=r"^--chosen-column names column 'nope', which dataset '\S+' does not have"):
        check_text_dataset(str(renamed), every_row=True, renames={"nope": "chosen"})
    argv = ["train", "--dataset", str(renamed), "--objective", "dpo", "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--prompt-column", "question", "--chosen-column", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--chosen-column names column 'nope'" in err and "its columns are: question, better, worse" in err, err
    assert "\n" not in err
    with pytest.raises(ValueError, match="two of --prompt-column, .* name column 'better'"):
        TrainConfig(chosen_column="better", rejected_column="better").validate()
