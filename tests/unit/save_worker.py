"""One process (a world of one, gloo): save two checkpoints, then a third under a file-size limit
smaller than its shard file (the disk "fills"); prints what the third save raised, as JSON."""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
import torch.distributed as dist

from hf_tp.checkpoint.dcp import save_checkpoint
from hf_tp.run.launch import free_port


def main(out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 128)).sum().backward()
    opt.step()  # optimizer state exists: the shard file holds ~200 KB
    state = {"base_dtype": "fp32"}
    for step in (1, 2):
        save_checkpoint(out, step, model, opt, state, [])
    limit = 64 * 1024  # bytes per file: below the shard file, above every small file
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        save_checkpoint(out, 3, model, opt, state, [])
        error = None
    except ValueError as exc:
        error = str(exc)
    print(json.dumps({"error": error}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
