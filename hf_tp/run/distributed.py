"""A rank's place in the run: its device, the process group, and leaving it together.

Also :func:`rank0_first`, for work one rank does before the others (downloads, dataset caches).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from hf_tp.run.config import TrainConfig
from hf_tp.run.launch import free_port
from hf_tp.run.validate import device_type

T = TypeVar("T")


def resolve_device(cfg: TrainConfig) -> torch.device:
    """CPU, or this rank's GPU (``LOCAL_RANK``)."""
    if device_type(cfg) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> None:
    """Join the process group that the launcher described in the environment (or a 1-rank one)."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a single process started by hand: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def shutdown(exit_code: int | None = None) -> None:
    """Leave the process group together with the other ranks: a barrier (a rank that quits while
    a peer is still in a collective with it fails the peer: "Connection closed by peer"), then
    ``destroy_process_group``. For the success path only: a failed rank must not wait for others.

    That does not stop gloo's worker threads while DTensors and DeviceMeshes still reference the
    groups; one may still be freeing the last collective's tensors when the interpreter finalizes,
    which ends the process with "terminate called without an active exception" (SIGABRT), rarely,
    after all the work is done. With ``exit_code``, stdout/stderr are flushed and the process
    leaves with ``os._exit(exit_code)``, skipping finalization: use it where the process ends anyway
    (a script run on each rank), never inside a notebook or a test process.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def rank0_first(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0, then on the others (downloads and dataset caches are built once).

    An error on rank 0 is broadcast, so every rank raises it instead of waiting in a barrier.
    """
    err: list[tuple[bool, str] | None] = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            err[0] = (isinstance(exc, ValueError), str(exc) if isinstance(exc, ValueError) else repr(exc))
            dist.broadcast_object_list(err, src=0)
            raise
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        is_value_error, message = err[0]
        raise (ValueError if is_value_error else RuntimeError)(message)
    return result if dist.get_rank() == 0 else fn()
