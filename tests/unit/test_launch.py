"""hf-tp train's launcher, run in the launching process: what a Ctrl-C leaves behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from hf_tp.train.launch import _run_launcher, free_port

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # not a zombie


def test_ctrl_c_ends_the_ranks_with_one_line_and_restores_the_process(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    argv = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0"]
    argv += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    argv += ["--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tests.unit.idle_rank", str(tmp_path)]
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    env_before = dict(os.environ)

    def interrupt_once_both_ranks_run() -> None:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C (handled by torch elastic's handler by now)

    threading.Thread(target=interrupt_once_both_ranks_run, daemon=True).start()
    code = _run_launcher(argv, tmp_path, verbose=False)
    assert code == 128 + signal.SIGINT
    assert "hf-tp train: stopped by SIGINT; the ranks were ended without saving" in capsys.readouterr().err
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    assert {sig: signal.getsignal(sig) for sig in before} == before  # torch elastic's handlers taken back
    assert dict(os.environ) == env_before
