"""A rank that imports nothing heavy (tests/unit/test_launch.py: ``python -m tests.unit.idle_rank
FOLDER``): registers its pid in the launcher's folder as a training rank does, then waits. On
SIGTERM it does what a preempted rank does last: notes it, rank 0 leaves the preemption file, and
it exits with the requeue code."""

import os
import signal
import sys
import time
from pathlib import Path

folder, rank = Path(sys.argv[1]), os.environ["RANK"]


def preempted(signum, frame) -> None:
    (folder / f"sigterm-{rank}").write_text("")
    if rank == "0":
        (folder / "preempted.json").write_text("{}")
    os._exit(75)


signal.signal(signal.SIGTERM, preempted)
(folder / f"pid-rank{rank}").write_text(str(os.getpid()))
time.sleep(120)
