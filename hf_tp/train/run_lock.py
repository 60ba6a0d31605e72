"""One writer per run folder: ``OUTPUT_DIR/.hf_tp.lock``, taken before launch and held until the
run ends (failed, preempted or stopped included), names the host and pid of the run holding it.

A second run into the same folder is refused in one line. A lock whose process is gone (same
host, no such pid: a run killed with SIGKILL, a node rebooted) is stale: taken over with a line
saying so. A lock of another host cannot be checked from here (shared storage of several nodes):
refused, naming the host and pid, with how to clear it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOCK = ".hf_tp.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holder(lock: Path) -> dict | None:
    """The lock's record, or None when it cannot be read (it is being written: retried)."""
    for _ in range(20):
        try:
            record = json.loads(lock.read_text())
            if isinstance(record, dict) and "pid" in record:
                return record
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


def _create(lock: Path, record: dict) -> bool:
    """Write the lock if no one holds it (atomic: O_EXCL); False when it exists."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    return True


def acquire(out: Path, what: str = "hf-tp train") -> dict:
    """Take ``out``'s lock for this process (``ValueError`` when a live run holds it); returns the
    record written."""
    lock = out / LOCK
    host = socket.gethostname()
    record = {"host": host, "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for _ in range(3):
        if _create(lock, record):
            return record
        held = _holder(lock)
        if held == {}:
            continue  # released between the two looks
        if held is None:
            raise ValueError(
                f"--output-dir {out} is locked by {lock}, which does not read as a lock; if no run writes there, "
                "delete it, or pass another --output-dir"
            )
        pid, where, since = held.get("pid"), held.get("host"), held.get("since", "?")
        if where != host:
            raise ValueError(
                f"--output-dir {out} is in use by pid {pid} on host {where} (since {since}); if that run has ended, "
                f"delete {lock}, or pass another --output-dir"
            )
        if isinstance(pid, int) and _alive(pid):
            raise ValueError(
                f"--output-dir {out} is in use by another run (pid {pid} on this host, since {since}); wait for it "
                "to end, or pass another --output-dir"
            )
        print(f"{what}: taking over the stale lock {lock} of pid {pid} (no such process on {host})", file=sys.stderr)
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    raise ValueError(f"--output-dir {out} is being locked by several runs at once; pass another --output-dir")


def release(out: Path, record: dict) -> None:
    """Remove the lock if it is still this record's (a stale-lock takeover may have replaced it)."""
    lock = out / LOCK
    if _holder(lock) == record:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def take(out: Path, what: str = "hf-tp train") -> Callable[[], None]:
    """Take ``out``'s lock (the folder made if missing); returns what releases it, and removes the
    folder again when it was made for the lock alone and is still empty."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        record = acquire(out, what)
    except BaseException:
        _remove_if_empty(out, made)
        raise

    def give_back() -> None:
        release(out, record)
        _remove_if_empty(out, made)

    return give_back


def _remove_if_empty(out: Path, made: bool) -> None:
    if made:
        with contextlib.suppress(OSError):  # not empty: the run wrote there
            out.rmdir()
