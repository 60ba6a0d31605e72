"""What clusters do to a run: preemption signals (to a rank, to the launcher) and a hung rank.

Each case is a real ``hf-tp train`` launch (gloo, 2 CPU processes); the preempted run resumes
and must give plain single-process HF's loss curve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_tp.checkpoint.dcp import latest_checkpoint
from hf_tp.run.faults import EXIT_PREEMPTED
from tests.e2e.test_train_cli import ROOT, hf_tp_train, metrics, setup  # noqa: F401 - fixture
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e
RUN = ["--seq-len", "15", "--max-steps", "6", "--lr", "3e-3", "--warmup-steps", "2", "--no-tensorboard"]


def _train_signalled_when(flags: list[str], mark: Path, sig: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """``hf-tp train`` whose launching process gets ``sig`` once the file ``mark`` exists (a rank
    holding inside a step creates it: ``HF_TP_CRASH=...:SLEEP<s>`` with ``HF_TP_CRASH_MARK``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_TP_CRASH_MARK=str(mark))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "train", *flags]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if mark.is_file():
                proc.send_signal(sig)
                break
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_preempted_twice_then_resumed_gives_the_uninterrupted_curve(setup, tmp_path) -> None:  # noqa: F811
    model_dir, data = setup
    run = tmp_path / "run"
    flags = ["--model", str(model_dir), "--dataset", str(data), *RUN, "--output-dir", str(run)]
    # Two ranks (tp 1 x dp 2, so the data position is resumed per dp rank); --save-every 0: no
    # checkpoint but the preemption's.
    flags += ["--tp", "1", "--dp", "2", "--batch-size", "2"]

    # 1) SIGUSR1 reaches one rank only (rank 1, at the start of step 3): every rank finishes step 3,
    #    the run saves step-3 and exits with the requeue code.
    os.environ["HF_TP_CRASH"] = "train:3:1:USR1"
    try:
        proc = hf_tp_train(*flags)
    finally:
        del os.environ["HF_TP_CRASH"]
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "preempted at step 3 (a signal to another rank): checkpoint" in proc.stdout
    assert "saved; continue with --resume" in proc.stdout
    assert latest_checkpoint(run).name == "step-3"

    # 2) resumed, then SIGTERM to the launching `hf-tp train` process (Kubernetes' way) while rank 0
    #    holds 3 s at the start of step 5 (it marks the hold: sent on step 4's metrics line instead,
    #    the signal could beat step 4's own stop check, seen once in CI), so the run stops after
    #    step 5, not after step 6, the last, which would end it without a preemption.
    os.environ["HF_TP_CRASH"] = "train:5:0:SLEEP3"
    try:
        proc = _train_signalled_when([*flags, "--resume"], tmp_path / "holding", signal.SIGTERM)
    finally:
        del os.environ["HF_TP_CRASH"]
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    stopped = int(latest_checkpoint(run).name.split("-")[1])
    assert stopped == 5 and "preempted at step 5 (SIGTERM)" in proc.stdout

    # 3) the newest checkpoint is damaged afterwards (a shard lost its tail): --resume names it and
    #    falls back to step-3; resumed to the end, the loss curve is plain HF's on the same batches.
    shard = next((run / "checkpoints" / f"step-{stopped}").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    proc = hf_tp_train(*flags, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step-{stopped} is damaged ({shard.name} has 100 bytes where the save wrote" in proc.stdout
    assert "hf-tp: using step-3, the newest checkpoint that is whole" in proc.stdout
    assert "resumed from" in proc.stdout and "(step 3)" in proc.stdout
    got = [r["loss"] for r in metrics(run)]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    want, _ = reference_losses(str(model_dir), str(data), seq_len=15, global_batch=4, steps=6, lr=3e-3, warmup_steps=2)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step + 1}: preempted-and-resumed loss {g} vs plain HF {w}"


def test_a_stopped_rank_ends_the_run_naming_step_and_rank(setup, tmp_path) -> None:  # noqa: F811
    model_dir, data = setup
    run = tmp_path / "run"
    flags = ["--model", str(model_dir), "--dataset", str(data), *RUN, "--output-dir", str(run)]
    flags += ["--tp", "2", "--dp", "1", "--batch-size", "2", "--save-every", "2", "--collective-timeout", "3"]
    os.environ["HF_TP_CRASH"] = "train:3:1:STOP"  # rank 1 stops (SIGSTOP) at the start of step 3
    t0 = time.monotonic()
    try:
        proc = hf_tp_train(*flags, timeout=120)
    finally:
        del os.environ["HF_TP_CRASH"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "step 3: rank 1 (last started step 2) stopped answering" in last, last
    assert "--collective-timeout" in last
    assert time.monotonic() - t0 < 240  # not torch's 30-minute default (a generous bound: CI machines are slow)
    assert latest_checkpoint(run).name == "step-2"  # the last checkpoint stays good
