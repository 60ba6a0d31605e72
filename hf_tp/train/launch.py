"""Start tp*dp ranks through accelerate's launcher (torch elastic underneath)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from hf_tp.train.config import TrainConfig


def free_port() -> int:
    """A TCP port free right now on this host (accelerate always defaults to 29500, so two runs
    on one machine would collide)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_command(cfg: TrainConfig, config_path: Path) -> list[str]:
    """The ``accelerate launch`` command line that runs ``python -m hf_tp.train`` on every rank."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
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


def launch(cfg: TrainConfig, config_path: Path) -> int:
    """Run the ranks of this node and wait; returns the launcher's exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, cfg.world_size // cfg.nnodes))))
    env["HF_TP_LAUNCHED"] = "1"
    return subprocess.call(launch_command(cfg, config_path), env=env)
