"""Errors of launched ranks, reported once, last, by the process that launched them.

``hf-tp train`` gives the ranks a folder (``HF_TP_ERROR_DIR``). A rank that fails writes its error
there (``rank{R}.json``: type, message, exit code, time, and the traceback of a crash) and prints
nothing; the launcher (:mod:`hf_tp.run.launch`) records how each failed rank ended
(``launcher.json``) and hides torch elastic's own report. The launching process then prints the
first error as the last line and exits with 2 for bad input (``ValueError``), 1 for anything else.
``--verbose`` (``HF_TP_VERBOSE``) lets every rank and the launcher print as they would on their own.
Without the folder (``torchrun``, ``accelerate launch``, one process) each rank prints its error.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hf_tp.run.supervise import STRAGGLERS_FILE

ERROR_DIR_ENV = "HF_TP_ERROR_DIR"
VERBOSE_ENV = "HF_TP_VERBOSE"
LAUNCHER_FILE = "launcher.json"
# Signals with which the launcher itself stops the other ranks once one has failed.
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def exit_code(exc: BaseException) -> int:
    """2 for bad input (a ``ValueError``), 1 for everything else."""
    return 2 if isinstance(exc, ValueError) else 1


def _quiet() -> bool:
    """Whether a launching process collects the errors (so a rank prints none)."""
    return bool(os.environ.get(ERROR_DIR_ENV)) and not os.environ.get(VERBOSE_ENV)


def _write_json(path: Path, record: dict) -> None:
    try:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # reporting must never turn one error into another


def save_traceback(text: str) -> Path | None:
    """An unexpected error's traceback, kept in a file of the temp dir (not the run's directory,
    which a failed start leaves as it was) for the one line that names it."""
    try:
        fd, name = tempfile.mkstemp(prefix="hf_tp-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return None


def crash_line(rank: int, kind: str, message: str, tb: str) -> str:
    """The one line of an unexpected error: its type, the message's first line, where the
    traceback is."""
    first = next((ln for ln in message.splitlines() if ln.strip()), "")
    kept = save_traceback(tb)
    where = f"traceback in {kept}" if kept else "the traceback could not be saved"
    return f"hf-tp train: training failed [rank {rank}]: {kind}: {first} ({where}; --verbose prints it)"


def report_rank_error(exc: BaseException, rank: int, *, crash: bool = False) -> int:
    """Record ``exc`` of this rank for the launching process (printing it only when no launching
    process will); returns the rank's exit code. ``crash``: an unexpected error, recorded with its
    traceback (printed as one line naming a file that holds it)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    tb = "".join(traceback.format_exception(exc)) if crash else None
    if folder:
        record = {
            "rank": rank,
            "type": type(exc).__name__,
            "message": str(exc),
            "code": exit_code(exc),
            "time": time.time(),
            "traceback": tb,
        }
        _write_json(Path(folder) / f"rank{rank}.json", record)
    if not _quiet():
        line = crash_line(rank, type(exc).__name__, str(exc), tb) if tb else f"hf-tp train: error [rank {rank}]: {exc}"
        print(line, file=sys.stderr, flush=True)
    return exit_code(exc)


def run_reporting_crashes(main: Callable[[], int]) -> int:
    """A launched rank's entry point: ``main()``, with an unexpected exception recorded for the
    launching process instead of printed by every rank (it is re-raised when nobody collects it)."""
    try:
        return main()
    except KeyboardInterrupt:  # the launcher ending the ranks after a Ctrl-C: it says so itself
        if not _quiet():
            raise
        return 130
    except Exception as exc:  # noqa: BLE001 - recorded (with its traceback) or re-raised
        if not _quiet():
            raise
        return report_rank_error(exc, int(os.environ.get("RANK", "0")), crash=True)


def record_launcher_failures(failures: dict[int, object]) -> None:
    """In the launcher: how each failed rank ended (torch elastic's ``ProcessFailure``s)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    ended = [
        {"rank": rank, "exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else None}
        for rank, f in sorted(failures.items())
    ]
    _write_json(Path(folder) / LAUNCHER_FILE, {"failures": ended})


def explain_failure(folder: Path, launcher_code: int) -> tuple[str, int]:
    """What the launching process prints (its last lines) and exits with after a failed launch."""
    records = []
    for path in Path(folder).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    try:
        failures = json.loads((Path(folder) / LAUNCHER_FILE).read_text())["failures"]
    except (OSError, ValueError, KeyError):
        failures = []
    reported = {r["rank"] for r in records}
    try:  # ranks the launcher itself killed, left waiting by a failed rank (hf_tp.run.supervise)
        reported |= set(json.loads((Path(folder) / STRAGGLERS_FILE).read_text()))
    except (OSError, ValueError):
        pass
    # A rank killed from outside (SIGKILL by the OOM killer, a segfault) leaves no error of its own;
    # the Python errors of the other ranks ("connection closed") only follow from it.
    killed = [f for f in failures if f.get("signal") and f["signal"] not in _STOP_SIGNALS and f["rank"] not in reported]
    if killed:
        f = killed[0]
        return (
            f"hf-tp train: training failed [rank {f['rank']}]: the process was killed by {f['signal']} without a "
            "Python error (from outside, e.g. out of memory); --verbose shows the launcher's report",
            1,
        )
    if records:
        first = min(records, key=lambda r: (r["time"], r["rank"]))
        if first.get("traceback"):
            return crash_line(first["rank"], first["type"], first["message"], first["traceback"]), first["code"]
        return f"hf-tp train: error [rank {first['rank']}]: {first['message']}", first["code"]
    ended = ", ".join(
        f"rank {f['rank']} {'by ' + f['signal'] if f.get('signal') else 'with exit code ' + str(f['exitcode'])}"
        for f in failures
    )
    return (
        f"hf-tp train: training failed (launcher exit code {launcher_code}"
        + (f"; ended: {ended}" if ended else "")
        + ") without an error from the ranks; run again with --verbose for the launcher's output",
        1,
    )
