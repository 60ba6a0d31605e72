"""The launching process's part in faults: pass stop signals on to the ranks, end ranks that a
failed one left waiting.

``hf-tp train`` runs accelerate's launcher (torch elastic's agent, :mod:`hf_tp.run.launch`) in its
own process, and the agent starts the ranks in sessions of their own, so a signal sent to
``hf-tp train`` (Kubernetes' SIGTERM, Slurm's ``--signal``) would not reach them. It therefore
forwards SIGTERM and SIGUSR1 to the ranks, and torch elastic is told not to handle SIGTERM itself
(it would kill the ranks after 30 s, mid-save). The ranks note the signal and stop after the step
in flight (:mod:`hf_tp.run.faults`).

When a rank has failed, torch elastic stops the others with SIGTERM and waits 30 s before SIGKILL;
a rank that is stopped (SIGSTOP) or wedged ignores SIGTERM, so the launching process kills the
ranks still alive a few seconds after the first rank error instead.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from hf_tp.compat.torch_distributed import terminate_process_handler
from hf_tp.run.faults import STOP_SIGNALS

STRAGGLER_GRACE_S = 5.0
STRAGGLERS_FILE = "stragglers.json"  # the ranks the launching process killed after another rank's error


def restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def rank_pids(folder: Path) -> dict[int, int]:
    """rank -> pid of the ranks that registered and are still this process's children."""
    pids = {}
    for path in folder.glob("pid-rank*"):
        try:
            pid = int(path.read_text())
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():  # field 4: the parent's pid
            pids[int(path.name.removeprefix("pid-rank"))] = pid
    return pids


def forward_to_ranks(folder: Path) -> dict:
    """SIGTERM/SIGUSR1 go on to every registered rank; returns the old handlers (none off the main
    thread, where Python cannot set any). Before any rank has registered (nothing to save yet)
    torch elastic's own handling stops them."""

    def forward(signum: int, frame: object) -> None:
        pids = rank_pids(folder).values()
        if not pids:
            terminate_process_handler(signum, frame)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}


def kill_stragglers_after_failure(folder: Path, grace: float = STRAGGLER_GRACE_S) -> threading.Event:
    """A thread that SIGKILLs the ranks still alive ``grace`` seconds after
    the first rank error appeared in ``folder``; set the returned event to end it."""
    done = threading.Event()

    def watch() -> None:
        first = None
        while not done.wait(0.5):
            if first is None and any(folder.glob("rank*.json")):
                first = time.monotonic()
            if first is not None and time.monotonic() - first >= grace:
                left = rank_pids(folder)
                (folder / STRAGGLERS_FILE).write_text(json.dumps(sorted(left)))  # not "killed from outside"
                for pid in left.values():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return

    threading.Thread(target=watch, name="hf_tp-stragglers", daemon=True).start()
    return done
