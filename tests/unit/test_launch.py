"""hf-tp train's launcher, run in the launching process: what a Ctrl-C or a SIGTERM leaves behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hf_tp.run.faults import EXIT_PREEMPTED
from hf_tp.run.launch import _run_launcher, free_port

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # not a zombie


def _launch_then_signal(folder: Path, sig: signal.Signals, seen: dict) -> int:
    """Two idle ranks through the launcher; ``sig`` to this process once both registered (``seen``:
    the SIGTERM handler in force at that moment)."""
    argv = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0"]
    argv += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    argv += ["--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tests.unit.idle_rank", str(folder)]

    def signal_once_both_ranks_run() -> None:
        deadline = time.monotonic() + 60
        while len(list(folder.glob("pid-rank*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["sigterm_handler"] = signal.getsignal(signal.SIGTERM)
        os.kill(os.getpid(), sig)

    threading.Thread(target=signal_once_both_ranks_run, daemon=True).start()
    return _run_launcher(argv, folder, verbose=False)


@pytest.fixture
def restored(monkeypatch):
    """The test process's handlers and environment, checked unchanged after the launch."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    env_before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    assert {sig: signal.getsignal(sig) for sig in before} == before  # torch elastic's handlers taken back
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == env_before


def test_ctrl_c_ends_the_ranks_with_one_line(tmp_path, capsys, restored) -> None:
    code = _launch_then_signal(tmp_path, signal.SIGINT, {})
    assert code == 128 + signal.SIGINT
    assert "hf-tp train: stopped by SIGINT; the ranks were ended without saving" in capsys.readouterr().err
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-rank*")]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_sigterm_goes_to_the_ranks_not_to_torch_elastic(tmp_path, restored) -> None:
    """torch elastic would stop the ranks itself and SIGKILL them 30 s later, mid-save."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    seen: dict = {}
    assert _launch_then_signal(tmp_path, signal.SIGTERM, seen) == EXIT_PREEMPTED
    assert seen["sigterm_handler"] is not _terminate_process_handler
    assert sorted(p.name for p in tmp_path.glob("sigterm-*")) == ["sigterm-0", "sigterm-1"]
