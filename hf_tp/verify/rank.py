"""A rank of ``hf-tp verify`` from start to end: join the process group, run the checks, print
the report on rank 0 and leave the verdict where the launching process reads it."""

from __future__ import annotations

import os
from pathlib import Path

from hf_tp.run.config import TrainConfig

RESULT_ENV = "HF_TP_VERIFY_RESULT"  # file the launching process reads the exit code from


def rank_main(cfg: TrainConfig) -> int:
    """0 when every check passed, 1 otherwise (the report printed by rank 0)."""
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from hf_tp.run.distributed import init_distributed, resolve_device
    from hf_tp.verify.report import gathered, render
    from hf_tp.verify.run import remove, verify_rank, work_dir

    hf_logging.disable_progress_bar()  # the tiny model's saves and loads: no bars between the lines
    device = resolve_device(cfg)
    init_distributed(device)
    work, made = work_dir(cfg)
    about, checks = verify_rank(cfg, work, device)
    text, code = render(gathered(checks), about)
    if made:  # (left in place when a rank failed: the others may still be using it)
        remove(work)
    if dist.get_rank() == 0:
        print(text, flush=True)
        if os.environ.get(RESULT_ENV):
            Path(os.environ[RESULT_ENV]).write_text(str(code))
    return code
