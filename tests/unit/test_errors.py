"""How the launching process reports the ranks' errors: once, the first one, with 2 for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_tp.run import errors


def write(folder: Path, name: str, record: dict) -> None:
    (folder / name).write_text(json.dumps(record))


def rank_error(rank: int, t: float, exc_type: str = "ValueError", code: int = 2, tb: str | None = None) -> dict:
    return {"rank": rank, "type": exc_type, "message": f"boom {rank}", "code": code, "time": t, "traceback": tb}


def test_first_rank_error_is_the_last_line(tmp_path: Path) -> None:
    write(tmp_path, "rank1.json", rank_error(1, 10.0))
    write(tmp_path, "rank0.json", rank_error(0, 11.0, "RuntimeError", 1))
    assert errors.explain_failure(tmp_path, 1) == ("hf-tp train: error [rank 1]: boom 1", 2)


def test_a_crash_is_one_line_naming_its_traceback_file(tmp_path: Path) -> None:
    write(tmp_path, "rank0.json", rank_error(0, 1.0, "KeyError", 1, tb="Traceback ...\nKeyError: 'x'\n"))
    text, code = errors.explain_failure(tmp_path, 1)
    assert code == 1 and "\n" not in text
    m = re.fullmatch(
        r"hf-tp train: training failed \[rank 0\]: KeyError: boom 0 \(traceback in (\S+); --verbose prints it\)", text
    )
    assert m, text
    kept = Path(m.group(1))
    try:
        assert kept.read_text() == "Traceback ...\nKeyError: 'x'\n"
    finally:
        kept.unlink()


def test_a_killed_rank_is_the_cause_of_the_others_errors(tmp_path: Path) -> None:
    write(tmp_path, "rank0.json", rank_error(0, 1.0, "RuntimeError", 1))
    failures = [{"rank": 0, "exitcode": 1, "signal": None}, {"rank": 1, "exitcode": -9, "signal": "SIGKILL"}]
    write(tmp_path, errors.LAUNCHER_FILE, {"failures": failures})
    text, code = errors.explain_failure(tmp_path, 1)
    assert code == 1 and text.startswith("hf-tp train: training failed [rank 1]: the process was killed by SIGKILL")


def test_no_rank_error(tmp_path: Path) -> None:
    write(tmp_path, errors.LAUNCHER_FILE, {"failures": [{"rank": 0, "exitcode": 3, "signal": None}]})
    text, code = errors.explain_failure(tmp_path, 1)
    assert code == 1 and "ended: rank 0 with exit code 3" in text and "--verbose" in text


def test_a_rank_prints_only_when_nobody_collects(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(errors.VERBOSE_ENV, raising=False)
    assert errors.report_rank_error(ValueError("bad input"), 3) == 2
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "rank3.json").read_text())["message"] == "bad input"
    monkeypatch.setenv("RANK", "2")
    assert errors.run_reporting_crashes(lambda: {}["x"]) == 1
    assert json.loads((tmp_path / "rank2.json").read_text())["traceback"].startswith("Traceback")
    monkeypatch.delenv(errors.ERROR_DIR_ENV)
    assert errors.report_rank_error(FloatingPointError("nan"), 0) == 1
    assert capsys.readouterr().err == "hf-tp train: error [rank 0]: nan\n"
    with pytest.raises(KeyError):
        errors.run_reporting_crashes(lambda: {}["x"])


def test_verbose_lets_every_rank_print_and_still_records(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(errors.VERBOSE_ENV, "1")
    assert errors.report_rank_error(RuntimeError("peer gone"), 1) == 1
    assert capsys.readouterr().err == "hf-tp train: error [rank 1]: peer gone\n"
    assert (tmp_path / "rank1.json").is_file()
