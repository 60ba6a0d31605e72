"""Start tp*dp ranks through accelerate's launcher (torch elastic underneath).

The launcher runs inside a thin wrapper (``python -m hf_tp.train.launch``, see :func:`_wrapper_main`)
that hides torch elastic's warnings and its ``ChildFailedError`` traceback unless ``--verbose``: the
launching process prints the ranks' first error itself, once (:mod:`hf_tp.train.errors`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_tp.train.config import TrainConfig
from hf_tp.train.errors import ERROR_DIR_ENV, VERBOSE_ENV, explain_failure, record_launcher_failures
from hf_tp.train.faults import EXIT_PREEMPTED, PREEMPTED_FILE
from hf_tp.train.supervise import (
    forward_stop_signals,
    forward_to_ranks,
    kill_stragglers_after_failure,
    restore_handlers,
)


def free_port() -> int:
    """A TCP port free right now on this host (accelerate always defaults to 29500, so two runs
    on one machine would collide)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_line(cfg: TrainConfig, device_type: str, *, launching: bool) -> str:
    """What is started: ranks, mesh, device, backend, dtype, the global batch in sequences and tokens."""
    nodes = f"{cfg.nnodes} nodes, {cfg.world_size // cfg.nnodes} ranks on this one" if cfg.nnodes > 1 else "1 node"
    where = "one GPU per rank" if device_type == "cuda" else "CPU"
    backend = "nccl" if device_type == "cuda" else "gloo"
    dtype = cfg.compute_dtype_name(device_type)
    dtype = "bf16 compute, fp32 master weights" if dtype == "bf16" else dtype
    tokens = cfg.global_batch * cfg.seq_len
    split = f"{cfg.batch_size} per rank x dp {cfg.dp}" + (
        f" x grad-accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""
    )
    verb = "launching" if launching else "running in this process:" if cfg.world_size == 1 else "running in place:"
    return (
        f"hf-tp train: {verb} {cfg.world_size} rank{'s' if cfg.world_size > 1 else ''} = tp {cfg.tp}{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} x dp {cfg.dp}{f' (ep {cfg.ep})' if cfg.ep > 1 else ''} "
        f"({nodes}) on {where}, {backend}, {dtype}; global batch {cfg.global_batch} sequence"
        f"{'s' if cfg.global_batch > 1 else ''} ({split}) = "
        f"{'up to ' if not cfg.pack else ''}{tokens:,} tokens per step, {cfg.max_steps} steps -> {cfg.output_dir}"
    )


def launch_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    """The ``accelerate launch`` command line that runs ``python -m hf_tp.train`` on every rank."""
    return [
        sys.executable,
        "-m",
        "hf_tp.train.launch",  # accelerate.commands.launch, quiet on failure (see _wrapper_main)
        "--multi_gpu",  # accelerate's switch for "several processes"; it works with gloo on CPU
        "--num_processes",
        str(cfg.world_size),
        "--num_machines",
        str(cfg.nnodes),
        "--machine_rank",
        str(cfg.node_rank),
        "--main_process_ip",
        cfg.master_addr,
        "--main_process_port",
        str(cfg.master_port or free_port()),
        "--mixed_precision",
        "no",  # hf_tp applies mixed precision itself (FSDP2 MixedPrecisionPolicy)
        "--dynamo_backend",
        "no",
        "-m",
        "hf_tp.train",
        "--config",
        str(config_path),
    ]


def launch(cfg: TrainConfig, config_path: Path, *, verbose: bool = False) -> int:
    """Run the ranks of this node and wait. On failure print the first rank error (or how the
    ranks ended) as the last line; returns 0, 2 (bad input), 1, or 75 when a stop signal (SIGTERM,
    SIGUSR1) made the ranks save a checkpoint and exit."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, cfg.world_size // cfg.nnodes))))
    env["HF_TP_LAUNCHED"] = "1"
    env.pop(VERBOSE_ENV, None)
    if verbose:
        env[VERBOSE_ENV] = "1"
    with tempfile.TemporaryDirectory(prefix="hf_tp-errors-") as folder:
        env[ERROR_DIR_ENV] = folder
        child = subprocess.Popen(launch_command(cfg, config_path), env=env)
        previous = forward_stop_signals(child)  # preemption: the ranks save, then exit
        try:
            code = child.wait()
        finally:
            restore_handlers(previous)
        if code == 0:
            return 0
        if (Path(folder) / PREEMPTED_FILE).is_file():  # rank 0 printed where the checkpoint is
            return EXIT_PREEMPTED
        message, code = explain_failure(Path(folder), code)
    print(message, file=sys.stderr, flush=True)
    return code


def _wrapper_main(argv: list[str]) -> int:
    """``accelerate launch ARGS``; when a rank fails, record how each one ended and exit 1 quietly
    (torch elastic's warnings and traceback only with ``HF_TP_VERBOSE``)."""
    import logging

    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    verbose = bool(os.environ.get(VERBOSE_ENV))
    if not verbose:
        logging.disable(logging.ERROR)  # "Sending process N closing signal", "failed (exitcode: 1)"
    folder = Path(os.environ[ERROR_DIR_ENV]) if os.environ.get(ERROR_DIR_ENV) else None  # set by hf-tp train
    watcher = None
    if folder is not None:
        forward_to_ranks(folder)  # SIGTERM/SIGUSR1: the ranks save and stop (hf_tp.train.supervise)
        watcher = kill_stragglers_after_failure(folder)
    try:
        accelerate_launch(args)
    except ChildFailedError as exc:
        if folder is not None and (folder / PREEMPTED_FILE).is_file():
            return EXIT_PREEMPTED
        record_launcher_failures(exc.failures)
        if verbose:
            raise
        return 1
    except Exception as exc:  # noqa: BLE001 - the launcher itself failed (rendezvous, port in use)
        if verbose:
            raise
        print(f"hf-tp train: the launcher failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.set()
    return 0


if __name__ == "__main__":
    sys.exit(_wrapper_main(sys.argv[1:]))
