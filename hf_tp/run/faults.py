"""What clusters do to a run's ranks: preemption signals, and a rank that stops answering.

The loop asks one question after every optimizer step, :meth:`Faults.stop_agreed` ("did any rank
get SIGTERM or SIGUSR1?"), in one tiny all-reduce so that every rank stops after the same step and
saves the same checkpoint. Slurm (``--signal=USR1@120``) and Kubernetes (SIGTERM, then SIGKILL after
a grace period) send the signal before they kill; the step in flight always finishes.

A rank that stops answering (wedged in a collective, stopped, its node gone) would hold the others
in their next collective for torch's default of 30 minutes (gloo) or forever; after set-up every
process group gets ``--collective-timeout`` instead (set-up keeps torch's default: rank 0 may be
downloading a model while the others wait). Each rank records the step it starts in the process
group's store, so the rank that times out can name the one that fell behind.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from hf_tp.compat.torch_distributed import default_store, set_collective_timeout

# torch is imported inside the functions: the launching processes read the constants and must
# answer `hf-tp train --help` and bad flags without loading it.
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: "try again later"; scripts/slurm_train.sh requeues on it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_FILE = "preempted.json"  # in the launcher's error folder: tells the launching process
_HEARTBEAT = "hf_tp/step/{rank}"


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``--collective-timeout`` for another rank."""


class Faults:
    """One rank's stop requests (signals noted, not obeyed mid-step) and its heartbeat."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum).name

    def stop_agreed(self, device) -> bool:
        """Collective: whether any rank has received a stop signal (all ranks answer alike)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Give the signals back to whoever handled them before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def apply_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the world, the mesh dims') times out after ``seconds``."""
    set_collective_timeout(seconds)


def heartbeat(step: int) -> None:
    """Record in the process group's store that this rank starts ``step`` (1-based)."""
    import torch.distributed as dist

    store = _store()
    if store is not None:
        store.set(_HEARTBEAT.format(rank=dist.get_rank()), str(step))


def is_timeout(exc: BaseException) -> bool:
    """A collective gave up waiting (gloo: "Timed out waiting ...ms for recv"; NCCL: "Watchdog caught
    collective operation timeout")."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out waiting" in text or "collective operation timeout" in text)


def timeout_error(step: int, seconds: float) -> CollectiveTimeout:
    """The one line a rank reports when a collective of ``step`` timed out, naming the ranks that
    fell behind where the store can tell."""
    behind = _ranks_behind(step)
    who = (
        ", ".join(f"rank {r} (last started step {s})" for r, s in behind)
        if behind
        else "another rank (every rank started this step: one is stuck inside it)"
    )
    return CollectiveTimeout(
        f"step {step}: {who} stopped answering; a collective waited over {seconds:g} s (--collective-timeout) "
        "and the run stops. Checkpoints already written are complete and --resume continues from the newest; "
        "raise --collective-timeout if a step can take that long"
    )


def _ranks_behind(step: int) -> list[tuple[int, int]]:
    import torch.distributed as dist

    store = _store()
    if store is None:
        return []
    behind = []
    for rank in range(dist.get_world_size()):
        key = _HEARTBEAT.format(rank=rank)
        try:
            seen = int(store.get(key)) if store.check([key]) else 0
        except Exception:  # noqa: BLE001 - the store's host may be the rank that is gone
            return behind
        if seen < step:
            behind.append((rank, seen))
    return behind


def _store():
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no store (a fake or threaded group): no heartbeat
        return None


def register_rank(folder: str | None) -> None:
    """Under ``hf-tp train``'s launcher: tell it this rank's pid (it forwards stop signals to the
    ranks and ends ranks left behind by a failed one)."""
    import torch.distributed as dist

    if folder:
        Path(folder, f"pid-rank{dist.get_rank()}").write_text(str(os.getpid()))


def record_preempted(folder: str | None, line: str) -> None:
    """Rank 0, under the launcher: the run stopped for a signal with a checkpoint saved."""
    if folder:
        Path(folder, PREEMPTED_FILE).write_text(line)
