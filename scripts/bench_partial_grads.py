"""Time a training step with and without hf_tp's fused reduction of tp-Partial weight gradients.

Run under torchrun (one process per rank, gloo on CPU or nccl on GPUs):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 scripts/bench_partial_grads.py --tp 2 --dp 2

Builds a random-weight Qwen3-shaped model (per-head q/k norms: 4 replicated weights per layer plus
the final norm, so 4L+1 Partial gradients), parallelizes two copies of it, one with
``fuse_partial_grads=False`` (FSDP2 all-reduces each Partial gradient over tp on its own), and
times forward + backward + AdamW step of each, alternating the two so that machine noise hits
both alike. Prints the median step time of each and the number of all-reduces in backward + AdamW
(without FSDP2, dp=1, AdamW's DTensor ops are where the unfused gradients get all-reduced).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# (not torch's CollectiveCounter: see CollectiveCounter for why it breaks under transformers >= 5.25)
from tests.helpers import CollectiveCounter  # noqa: E402


def all_reduces(mode: CollectiveCounter) -> int:
    return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), device=device)
    runs = {}
    for fuse in (False, True):
        model = hf_tp.parallelize(
            copy.deepcopy(base),
            hf_tp.build_mesh(tp=args.tp, dp=args.dp, device_type=device.type),
            fuse_partial_grads=fuse,
        )
        runs[fuse] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])

    def step(fuse: bool, count: CollectiveCounter | None = None) -> float:
        model, opt, _ = runs[fuse]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = hf_tp.causal_lm_loss(model, ids, None, ids)
        with count or contextlib.nullcontext():
            loss.backward()
            opt.step()  # without FSDP2, AdamW's DTensor ops all-reduce Partial gradients (3 per weight)
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    counts = {}
    for fuse in (False, True):
        counts[fuse] = CollectiveCounter()
        step(fuse, counts[fuse])  # first step: counts the all-reduces of backward + AdamW, hooks the weights
    for i in range(args.warmup + args.steps):
        for fuse in (False, True) if i % 2 == 0 else (True, False):
            dt = step(fuse)
            if i >= args.warmup:
                runs[fuse][2].append(dt)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(
            f"Qwen3-shaped, {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, tp={args.tp} x dp={args.dp} "
            f"({world} ranks, {dist.get_backend()}), median of {args.steps} steps"
        )
        for fuse in (False, True):
            label = "fused (one all-reduce)" if fuse else "fuse_partial_grads=False"
            med = statistics.median(runs[fuse][2]) * 1e3
            print(f"  {label:26s} step {med:8.1f} ms   all-reduces in backward + AdamW: {all_reduces(counts[fuse])}")
    hf_tp.shutdown(exit_code=0)  # leave together, then exit without finalization (see its docstring)


if __name__ == "__main__":
    main()
