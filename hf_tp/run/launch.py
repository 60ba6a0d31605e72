"""Start tp*dp ranks through accelerate's launcher (torch elastic underneath), in this process.

torch elastic's warnings and its ``ChildFailedError`` traceback are hidden unless ``--verbose``: the
launching process prints the ranks' first error itself, once (:mod:`hf_tp.run.errors`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from hf_tp.run.config import TrainConfig
from hf_tp.run.errors import ERROR_DIR_ENV, VERBOSE_ENV, explain_failure, record_launcher_failures
from hf_tp.run.faults import EXIT_PREEMPTED, PREEMPTED_FILE
from hf_tp.run.supervise import forward_to_ranks, kill_stragglers_after_failure, restore_handlers

_ELASTIC_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


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
    pairs = cfg.objective != "sft"  # preference objectives: a pair is two rows (chosen, rejected)
    tokens = cfg.global_batch * cfg.seq_len * (2 if pairs else 1)
    unit = f"{'preference pair' if pairs else 'sequence'}{'s' if cfg.global_batch > 1 else ''}"
    split = f"{cfg.batch_size} per rank x dp {cfg.dp}" + (
        f" x grad-accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""
    )
    verb = "launching" if launching else "running in this process:" if cfg.world_size == 1 else "running in place:"
    return (
        f"hf-tp train: {verb} {cfg.world_size} rank{'s' if cfg.world_size > 1 else ''} = {f'pp {cfg.pp} ({cfg.pp_schedule}) x ' if cfg.pp > 1 else ''}tp {cfg.tp}{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} x dp {cfg.dp}{f' (ep {cfg.ep})' if cfg.ep > 1 else ''}{f' (HSDP: {cfg.dp_replicate} replicas x shard {cfg.dp // cfg.dp_replicate})' if cfg.dp_replicate > 1 else ''} "
        f"({nodes}) on {where}, {backend}, {dtype}; global batch {cfg.global_batch} {unit} "
        f"({split}) = {'up to ' if not cfg.packs else ''}{tokens:,} tokens per step, {cfg.max_steps} steps -> {cfg.output_dir}"
    )


def launcher_args(cfg: TrainConfig, config_path: Path, module: str = "hf_tp.train") -> list[str]:
    """The ``accelerate launch`` arguments that run ``python -m MODULE --config CONFIG_PATH`` on
    every rank (``hf_tp.train``; ``hf_tp.verify`` for ``hf-tp verify``)."""
    return [
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
        module,
        "--config",
        str(config_path),
    ]


def launch(cfg: TrainConfig, *, verbose: bool = False, module: str = "hf_tp.train") -> int:
    """Run the ranks of this node and wait. On failure print the first rank error (or how the
    ranks ended) as the last line; returns 0, 2 (bad input), 1, 75 when a stop signal (SIGTERM,
    SIGUSR1) made the ranks save a checkpoint and exit, or 128 + N when signal N (Ctrl-C) ended them.

    accelerate's launcher (torch elastic's agent) runs in this process: the ranks are its children,
    started with this process's environment plus the variables below, set for the launch only.
    (A launcher process of its own would cost every run a second interpreter's imports.)"""
    env = {"HF_TP_LAUNCHED": "1", VERBOSE_ENV: "1" if verbose else None}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, cfg.world_size // cfg.nnodes)))
    with tempfile.TemporaryDirectory(prefix="hf_tp-launch-") as folder:
        env[ERROR_DIR_ENV] = folder
        config_path = Path(folder) / "config.yaml"  # the ranks' settings; not the run's record
        cfg.save(config_path)
        with _environment(env):
            code = _run_launcher(launcher_args(cfg, config_path, module), Path(folder), verbose)
        if code == 0 or code > 128:  # success, or stopped by a signal (said already)
            return code
        if (Path(folder) / PREEMPTED_FILE).is_file():  # rank 0 printed where the checkpoint is
            return EXIT_PREEMPTED
        message, code = explain_failure(Path(folder), code)
    print(message, file=sys.stderr, flush=True)
    return code


def stopped_line(signal_name: str) -> str:
    """The one line of a run a stop signal (Ctrl-C) ended before it could save."""
    return (
        f"hf-tp train: stopped by {signal_name}; the ranks were ended without saving "
        "(SIGTERM or SIGUSR1 once training has started make them save a checkpoint first)"
    )


@contextlib.contextmanager
def _environment(changes: dict[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (None: unset) inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in changes}
    _apply(changes)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _run_launcher(argv: list[str], folder: Path, verbose: bool) -> int:
    """``accelerate launch ARGV``; when a rank fails, record how each one ended and return 1
    quietly (torch elastic's warnings and traceback only with ``verbose``). Stop signals go on to
    the ranks (:func:`hf_tp.run.supervise.forward_to_ranks`); ranks a failed one left waiting
    are killed after a grace period."""
    import logging

    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    if not verbose:
        logging.disable(logging.ERROR)  # "Sending process N closing signal", "failed (exitcode: 1)"
    # SIGTERM is ours (forwarded to the ranks, which save first): torch elastic must not handle it.
    # Its launcher takes the list from PET_SIGNALS_TO_HANDLE (its --signals-to-handle) and writes it
    # to TORCHELASTIC_SIGNALS_TO_HANDLE; both are put back after.
    elastic_signals = ",".join(sig.name for sig in _ELASTIC_SIGNALS)
    with _environment({"PET_SIGNALS_TO_HANDLE": elastic_signals, "TORCHELASTIC_SIGNALS_TO_HANDLE": elastic_signals}):
        # torch elastic sets its own SIGINT/SIGHUP/SIGQUIT handlers and leaves them: all put back after
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.getsignal(sig) for sig in _ELASTIC_SIGNALS} if main else {}
        previous |= forward_to_ranks(folder)  # SIGTERM/SIGUSR1: the ranks save and stop
        watcher = kill_stragglers_after_failure(folder)
        try:
            accelerate_launch(args)
        except ChildFailedError as exc:
            if (folder / PREEMPTED_FILE).is_file():
                return EXIT_PREEMPTED
            record_launcher_failures(exc.failures)
            if verbose:
                raise
            return 1
        except (SignalException, SystemExit) as exc:  # Ctrl-C, SIGHUP, SIGQUIT; SIGTERM before any rank registered
            # (accelerate >= 1.16 turns the signal into sys.exit(128 + N))
            code = 128 + exc.sigval if isinstance(exc, SignalException) else exc.code
            if (folder / PREEMPTED_FILE).is_file():
                return EXIT_PREEMPTED
            if verbose or not isinstance(code, int) or code <= 128:
                raise
            print(stopped_line(signal.Signals(code - 128).name), file=sys.stderr)
            return code
        except Exception as exc:  # noqa: BLE001 - the launcher itself failed (rendezvous, port in use)
            if verbose:
                raise
            print(f"hf-tp train: the launcher failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            watcher.set()
            restore_handlers(previous)
            logging.disable(logging.NOTSET)
    return 0
