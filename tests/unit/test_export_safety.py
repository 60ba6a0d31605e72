"""``hf-tp export`` loses nothing: an out_dir that is, holds or lies inside the run or checkpoint
being exported, or a folder that is not an earlier export, is refused (even with --overwrite)
with one line and exit 2, every byte left in place; a file or an unwritable out_dir is refused
before the checkpoint is read; --overwrite replaces an earlier export (one with the marker) or an
empty folder, old export kept until the new one is in place; a full disk leaves out_dir as it was."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from transformers import AutoConfig

import hf_tp.checkpoint.hf_folder as export_module
from hf_tp.checkpoint.hf_folder import EXPORT_MARKER, export_checkpoint
from tests.unit.test_export_stream import fake_checkpoint


@pytest.fixture(scope="module")
def made_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir as hf-tp train leaves one: a step-1 checkpoint of a tiny Llama, metrics, config,
    history and tensorboard files. Copied per test (the base folder it names stays here, read only)."""
    root = tmp_path_factory.mktemp("made")
    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    ckpt, _ = fake_checkpoint(root, config)
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt.rename(run / "checkpoints" / "step-1")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 4.1}\n')
    (run / "config.yaml").write_text("model: tiny\nlr: 0.001\n")
    (run / "history.jsonl").write_text('{"event": "start"}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\x00\x01tb")
    return run


@pytest.fixture
def run(made_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(made_run, tmp_path / "run"))


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its bytes' hash (folders as such): equal snapshots, nothing lost."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


def export(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``hf-tp export ARGS`` by the CLI's own ``main`` in this process."""
    from hf_tp.cli.main import main

    capsys.readouterr()
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["hf-tp", "export", *args], code, out, err)


def one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one stderr line of a refused export (and its exit code)."""
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-tp export: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("RUN", "RUN", r"export dir \S+/run is the run being exported; "),
        ("RUN", "RUN/checkpoints", r"export dir \S+/run/checkpoints is the run's checkpoints folder; "),
        ("RUN", "RUN/checkpoints/step-1/", r"export dir \S+/step-1 is inside the run's checkpoints folder \S+; "),
        ("RUN/checkpoints/step-1", "RUN", r"export dir \S+/run is the run being exported; "),
        ("RUN", "OTHER", r"export dir \S+/other is not empty and is not an hf_tp export \(no \.hf_tp_export\.json; "),
        ("RUN", "RUN/tensorboard", r"export dir \S+/run/tensorboard is not empty and is not an hf_tp export "),
        ("RUN", "RUN/metrics.jsonl", r"export dir \S+/run/metrics\.jsonl is a file, not a folder; nothing was written"),
        ("RUN", "..", r"export dir \S+ contains the run being exported \(\S+/run\); "),
    ],
)
def test_refused_with_overwrite_and_every_byte_kept(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, source: str, target: str, message: str
) -> None:
    other = tmp_path / "other"
    (other / "notes").mkdir(parents=True)
    (other / "notes" / "thesis.tex").write_text("years of work\n")
    (other / "data.bin").write_bytes(os.urandom(256))
    paths = {"RUN": str(run), "OTHER": str(other), "..": str(tmp_path)}
    before = snapshot(tmp_path)  # the run, the unrelated folder, and no temp folder beside them
    head = [spec.partition("/") for spec in (source, target)]  # RUN/checkpoints -> (RUN, /, checkpoints)
    line = one_error_line(export(capsys, *(paths[name] + slash + rest for name, slash, rest in head), "--overwrite"), 2)
    assert re.search(message, line), line
    assert "nothing was written" in line or "nothing was deleted" in line, line
    assert snapshot(tmp_path) == before


def test_run_to_its_export_folder_twice(run: Path, capsys: pytest.CaptureFixture) -> None:
    """RUN -> RUN/export (what hf-tp train --export-on-finish writes), again with --overwrite, and
    as the training loop calls it (the step's path, overwrite=True); the run's files untouched."""
    from transformers import AutoModelForCausalLM

    before = snapshot(run)
    first = export(capsys, str(run), str(run / "export"))
    assert first.returncode == 0, first.stderr[-3000:]
    marker = json.loads((run / "export" / EXPORT_MARKER).read_text())
    assert marker["checkpoint"] == "step-1" and marker["step"] == 1 and str(run) not in json.dumps(marker)
    AutoModelForCausalLM.from_pretrained(run / "export")  # the marker is just another file to it
    again = one_error_line(export(capsys, str(run), str(run / "export")), 2)
    assert again.endswith("is not empty (an earlier export); pass --overwrite to replace it, or another dir"), again
    assert export(capsys, str(run), str(run / "export"), "--overwrite").returncode == 0
    export_checkpoint(run / "checkpoints" / "step-1", run / "export", overwrite=True)  # hf_tp.train.loop._finish
    after = snapshot(run)
    assert {k: v for k, v in after.items() if not k.startswith("export")} == before  # no leftover, nothing lost
    assert (run / "export" / "model.safetensors").is_file()


def test_overwrite_replaces_an_empty_folder(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    assert export(capsys, str(run), str(tmp_path / "empty"), "--overwrite").returncode == 0
    assert (tmp_path / "empty" / EXPORT_MARKER).is_file() and (tmp_path / "empty" / "config.json").is_file()


def test_replacing_an_earlier_export_keeps_one_whole_at_every_moment(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old export is renamed aside, the new one renamed in, then the old one deleted: when the
    new one is renamed in, the old one is whole beside it; a failure there puts the old one back."""
    out = tmp_path / "hf"
    assert export(capsys, str(run), str(out)).returncode == 0
    (out / "README.md").write_text("the earlier export's card\n")  # tells the two exports apart
    old = snapshot(out)
    real_replace, seen = os.replace, []

    def watching(src, dst) -> None:
        if Path(dst) == out and Path(src).name.startswith(".tmp-"):  # the new export renamed into place
            aside = [p for p in tmp_path.iterdir() if p.name.startswith(".old-hf-")]
            assert not out.exists() and len(aside) == 1 and snapshot(aside[0]) == old
            assert (Path(src) / EXPORT_MARKER).is_file() and (Path(src) / "model.safetensors").is_file()
            seen.append(src)
            if fail:
                raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(export_module.os, "replace", watching)
    fail = True
    line = one_error_line(export(capsys, str(run), str(out), "--overwrite"), 1)
    assert line == (
        f"hf-tp export: error: export to {out} failed (No space left on device); the half-built folder was "
        f"removed and {out} is as it was: free some space or fix the permission, or pass another dir"
    )
    assert snapshot(out) == old and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    fail = False
    assert export(capsys, str(run), str(out), "--overwrite").returncode == 0
    assert len(seen) == 2 and "the earlier export's card" not in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # the old one deleted, nothing left beside


def test_a_full_disk_while_writing_leaves_nothing(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors wraps the OSError in its own error: still one line, exit 1, the temp folder gone."""
    from safetensors import SafetensorError

    def full(*args, **kwargs) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("hf_tp.checkpoint.stream.save_file", full)
    line = one_error_line(export(capsys, str(run), str(tmp_path / "hf")), 1)
    assert f"export to {tmp_path / 'hf'} failed (No space left on device); the half-built folder was removed" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("FILE", r"export dir \S+/weights\.bin is a file, not a folder; nothing was written: pass a folder path"),
        (
            "FILE/sub",
            r"export dir \S+/sub cannot be created or written: \S+/weights\.bin is a file, not a directory; pass a dir",
        ),
        (
            "/proc/hf_tp_no/export",
            r"export dir /proc/hf_tp_no/export cannot be created or written: /proc does not take new ",
        ),
    ],
)
def test_a_file_or_unwritable_out_dir_is_refused_before_the_checkpoint_is_read(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, target: str, message
) -> None:
    (tmp_path / "weights.bin").write_bytes(b"mine")
    before = snapshot(tmp_path)

    def unread(path) -> None:
        raise AssertionError("the checkpoint was read before the export dir was checked")

    monkeypatch.setattr(export_module, "resolve_checkpoint", unread)
    target = target.replace("FILE", str(tmp_path / "weights.bin"))
    line = one_error_line(export(capsys, str(run), target, "--overwrite"), 2)
    assert re.search(message, line), line
    assert snapshot(tmp_path) == before


def test_overwrite_keeps_the_files_the_user_added(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 51 case 4: --overwrite over an earlier export deleted a file the user had added to it.
    Only the files the earlier export wrote (listed in its marker) are replaced."""
    out = tmp_path / "hf"
    assert export(capsys, str(run), str(out)).returncode == 0
    (out / "notes.txt").write_text("the user's own notes\n")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}\n")
    for _ in range(2):  # and again: the user's files are never the export's own
        assert export(capsys, str(run), str(out), "--overwrite").returncode == 0
        assert (out / "notes.txt").read_text() == "the user's own notes\n"
        assert (out / "eval" / "scores.json").read_text() == "{}\n"
        own = json.loads((out / EXPORT_MARKER).read_text())["files"]
        assert "model.safetensors" in own and "notes.txt" not in own and "eval" not in own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # nothing left beside


def test_export_names_the_unfinished_newest_step_it_skipped(run: Path, tmp_path: Path, capsys) -> None:
    """Issue 51 case 8: a newest step-N without its COMPLETE marker and manifest was passed over in
    silence; the export says which step it skipped and which it used."""
    unfinished = run / "checkpoints" / "step-2"
    shutil.copytree(run / "checkpoints" / "step-1", unfinished)
    for name in ("COMPLETE", "manifest.json"):
        (unfinished / name).unlink(missing_ok=True)
    proc = export(capsys, str(run), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    assert f"hf-tp: skipped {unfinished} (no COMPLETE marker: its save did not finish); using step-1" in proc.stdout
    assert json.loads((tmp_path / "hf" / EXPORT_MARKER).read_text())["checkpoint"] == "step-1"
