"""Start tp=2 CPU ranks from inside one Python process twice, as re-running a notebook cell does.

    python tests/e2e/notebook_launcher_worker.py --out DIR

``accelerate.notebook_launcher`` (torch elastic, fork start method; on CPU it starts
``num_processes`` real processes, which then join a gloo group from the environment).

Each run: parallelize the tiny default Llama, greedy-generate, train a few AdamW steps inside
``hf_tp.loss_parallel()``, greedy-generate again, leave the process group. Every rank writes
``DIR/run{i}-rank{r}.json``. Between the two runs the parent launches a function whose rank 1
raises (a failing cell), then does plain HF generation (so the next fork happens after the parent
used torch, as in a notebook). It writes ``DIR/parent.json`` with what it saw after each run.
tests/e2e/test_notebook.py checks the files.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tp
from hf_tp.demo.assets import ensure_default_assets

TP = 2
STEPS = 3
SEQ_LEN = 32
NEW_TOKENS = 8
PROMPT = "counting up : one two"
# Variables a launcher sets in the parent's environment while it runs; it must restore them.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC", "ACCELERATE_USE_CPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixed_batch(tokenizer, data_file: str) -> torch.Tensor:
    """Two rows of SEQ_LEN tokens cut from the start of the corpus: the same on every rank."""
    text = " ".join(Path(data_file).read_text().splitlines()[:20])
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return ids[: 2 * SEQ_LEN].view(2, SEQ_LEN)


def rank_main(model_dir: str, data_file: str, out_file_pattern: str) -> None:
    """The function every launched rank runs."""
    dist.init_process_group("gloo")  # from the environment notebook_launcher set
    rank = dist.get_rank()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_tp.parallelize(model, hf_tp.build_mesh(tp=TP, device_type="cpu"))
    prompt = tokenizer(PROMPT, return_tensors="pt")
    before = hf_tp.generate(model, **prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    ids = fixed_batch(tokenizer, data_file)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        with hf_tp.loss_parallel():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.full_tensor().item())
    after = hf_tp.generate(model, **prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    world = dist.get_world_size()
    dist.barrier()  # nobody leaves while another rank may still be in a collective
    dist.destroy_process_group()
    record = {
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "losses": losses,
        "before": before[0].tolist(),
        "after": after[0].tolist(),
        "pg_left": not dist.is_initialized(),
    }
    Path(out_file_pattern.format(rank=rank)).write_text(json.dumps(record))


def failing_rank() -> None:
    """Rank 1 raises while rank 0 waits in a barrier: the launch must fail, not hang."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


def launch(fn, args: tuple = ()) -> None:
    from accelerate import notebook_launcher

    # use_port: the default 29500 collides with any other run on the machine.
    notebook_launcher(fn, args=args, num_processes=TP, use_port=str(free_port()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--assets", help="where to build the default assets (default: hf_tp's cache)")
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    assets = ensure_default_assets(opts.assets)
    model_dir, data_file = str(assets.model_dir), str(assets.data_file)
    parent: dict = {"pid": os.getpid(), "runs": []}
    env_before = {k: os.environ.get(k) for k in LAUNCH_ENV}
    for run in range(2):
        if run == 1:  # a cell that fails in between must not break the next launch
            try:
                launch(failing_rank)
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                parent["failure"] = type(exc).__name__
        launch(rank_main, (model_dir, data_file, str(out / f"run{run}-rank{{rank}}.json")))
        # The notebook's own process after a launch: no group, no children, no launcher env.
        state = {
            "pg_initialized": dist.is_initialized(),
            "children": len(multiprocessing.active_children()),
            "changed_env": sorted(k for k in LAUNCH_ENV if os.environ.get(k) != env_before[k]),
        }
        # Use torch in the parent before the next fork, as a notebook does between cells.
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        prompt = tokenizer(PROMPT, return_tensors="pt")
        state["plain_greedy"] = plain.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
        parent["runs"].append(state)
    (out / "parent.json").write_text(json.dumps(parent))


if __name__ == "__main__":
    main()
