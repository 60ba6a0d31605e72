"""One writer per run folder (issue 51 case 3): the lock ``hf-tp train`` takes before launch, held
to the end of the run whatever the end, a stale one taken over with a line; a failed run with no
step does not block its rerun (case 14); verify's marker (cases 1, 2); the embedded default
ends with a checkpoint (case 9, the launch itself: tests/e2e/test_train_cli.py); the closed-form
memory check (case 6)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_tp.run.config import TrainConfig
from hf_tp.train.run_lock import LOCK, acquire, release, take


def test_a_second_run_is_refused_and_the_lock_goes_at_release(tmp_path: Path) -> None:
    out = tmp_path / "run"
    give_back = take(out)
    held = json.loads((out / LOCK).read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    with pytest.raises(ValueError, match=rf"--output-dir {out} is in use by another run \(pid {os.getpid()} on this"):
        take(out)
    give_back()
    assert not out.exists()  # made for the lock alone, empty again: removed
    (tmp_path / "kept").mkdir()
    take(tmp_path / "kept")()
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path: Path, capsys) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "since": "x"}))
    record = acquire(tmp_path)
    line = capsys.readouterr().err.strip()
    assert (
        line
        == f"hf-tp train: taking over the stale lock {tmp_path / LOCK} of pid {pid} (no such process on {socket.gethostname()})"
    )
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    release(tmp_path, {**record, "pid": -1})  # not ours: left alone
    assert (tmp_path / LOCK).exists()
    release(tmp_path, record)
    assert not (tmp_path / LOCK).exists()


def test_another_hosts_lock_is_named_and_refused(tmp_path: Path) -> None:
    (tmp_path / LOCK).write_text(json.dumps({"host": "node-7", "pid": 4242, "since": "2026-01-01T00:00:00Z"}))
    with pytest.raises(ValueError, match=r"in use by pid 4242 on host node-7 \(since 2026-01-01T00:00:00Z\); if that"):
        acquire(tmp_path)


@pytest.mark.parametrize("ending", ["failed", "preempted", "ctrl-c"])
def test_the_cli_holds_the_lock_through_the_launch_and_releases_it(tmp_path: Path, monkeypatch, ending) -> None:
    """Taken after the checks and before the ranks start; gone after, however the launch ended."""
    import hf_tp.run.launch as launch
    import hf_tp.run.validate as validate
    from hf_tp.cli.main import main

    out, seen = tmp_path / "out", []
    monkeypatch.setattr(validate, "prelaunch_checks", lambda cfg: "cpu")  # (the table of refusals: test_bad_inputs)

    def fake_launch(cfg, **kw):
        seen.append(json.loads((out / LOCK).read_text())["pid"])
        if ending == "ctrl-c":
            raise KeyboardInterrupt
        return {"failed": 1, "preempted": 75}[ending]

    monkeypatch.setattr(launch, "launch", fake_launch)
    argv = ["train", "--model", "m", "--dataset", "d.txt", "--seq-len", "32"]
    argv += ["--output-dir", str(out), "--tp", "2", "--dp", "1"]
    assert main(argv) == {"failed": 1, "preempted": 75, "ctrl-c": 130}[ending]
    assert seen == [os.getpid()] and not (out / LOCK).exists()


def test_ctrl_c_while_importing_or_checking_is_one_line(monkeypatch, capsys) -> None:
    """Issue 51 case 12: Ctrl-C in the first seconds (torch, transformers being imported, the
    checks running) printed a whole KeyboardInterrupt traceback."""
    import hf_tp.run.validate as validate
    from hf_tp.cli.main import main

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "prelaunch_checks", interrupted)
    capsys.readouterr()
    assert main(["train", "--model", "m", "--dataset", "d.txt"]) == 130
    assert capsys.readouterr().err == "hf-tp: stopped by Ctrl-C (SIGINT)\n"


def test_a_run_that_failed_before_its_first_step_does_not_block_its_rerun(tmp_path: Path) -> None:
    from hf_tp.run.run_dir import check_output_dir, holds_run

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("tp: 2\n")
    (out / "metrics.jsonl").write_text("")
    (out / "history.jsonl").write_text("{}\n")
    check_output_dir(out, TrainConfig(output_dir=str(out)))  # accepted
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert holds_run(out)
    with pytest.raises(ValueError, match="already holds a run"):
        check_output_dir(out, TrainConfig(output_dir=str(out)))
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    assert holds_run(out)


def test_verify_marks_its_folder_and_reuses_only_its_own(tmp_path: Path) -> None:
    from hf_tp.verify.folder import MARKER, check_work_dir, claim

    check_work_dir(str(tmp_path / "new"))
    claim(tmp_path / "new")
    (tmp_path / "new" / "model").mkdir()
    check_work_dir(str(tmp_path / "new"))  # its own: reused
    (tmp_path / "empty").mkdir()
    check_work_dir(str(tmp_path / "empty"))
    assert (tmp_path / "new" / MARKER).is_file()
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match=r"holds files hf-tp verify did not write \(model\.safetensors\)"):
        check_work_dir(str(tmp_path / "empty"))


def test_the_embedded_default_ends_with_a_checkpoint() -> None:
    from hf_tp.train.embedded_run import with_embedded_default

    assert with_embedded_default(TrainConfig()).save_every == TrainConfig().resolve().max_steps
    assert with_embedded_default(TrainConfig(save_every=3)).save_every == 3
    assert with_embedded_default(TrainConfig(export_on_finish=True)).save_every == 0  # it saves one itself


def test_a_step_far_beyond_the_machines_memory_is_refused_in_well_under_a_second() -> None:
    from transformers import LlamaConfig

    from hf_tp.run.fits import GiB, check_step_memory

    config = LlamaConfig(  # Llama 3.1 8B's sizes
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    )  # fmt: skip
    cfg = TrainConfig(model="m", dataset="d", tp=2, dp=2, batch_size=1, seq_len=2048).resolve()
    start = time.perf_counter()
    assert check_step_memory(cfg, config, "cuda", have=80 * GiB) is None  # 8B at tp 2 x dp 2: fits an H100
    huge = TrainConfig(model="m", dataset="d", tp=2, dp=2, batch_size=64, seq_len=8192).resolve()
    with pytest.raises(ValueError, match=r"a step needs about \d+\.\d GiB on one GPU \(.*\), far beyond its 80\.0 GiB"):
        check_step_memory(huge, config, "cuda", have=80 * GiB)
    assert time.perf_counter() - start < 0.5
    tight = TrainConfig(model="m", dataset="d", tp=2, dp=2, batch_size=4, seq_len=8192).resolve()
    warning = check_step_memory(tight, config, "cuda", have=80 * GiB)
    assert warning is not None and "GiB on one GPU" in warning and "far beyond" not in warning
    # on CPU the ranks of a node share its RAM
    cpu = check_step_memory(cfg, config, "cpu", have=128 * GiB)
    assert cpu is not None and "on 4 ranks on this machine" in cpu and "far beyond" not in cpu
