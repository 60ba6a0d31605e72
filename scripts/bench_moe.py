"""Expert tensor parallelism vs expert parallelism on a small Qwen3-MoE: step time and bytes moved.

Run under torchrun (one process per rank, gloo on CPU or nccl on GPUs):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 scripts/bench_moe.py

For each layout (tp, ep) that fits the world (dp = world / tp, ep dividing dp), builds the same
random-weight Qwen3-MoE, parallelizes it with hf_tp, and times forward + backward + AdamW
(median of ``--steps`` after ``--warmup``). Bytes per rank per step are counted from what the run
did: the expert all-to-alls from the rows that actually crossed ranks (both directions, forward
and backward), the MoE regions' all-gather + reduce-scatter over tp from the token count (ring:
(tp-1)/tp of the tensor each). Attention's and FSDP2's traffic is the same in every layout with the
same tp and dp and is left out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import hf_tp
from hf_tp.core.record import record_of


def layouts(world: int) -> list[tuple[int, int]]:
    out = []
    for tp in (1, 2, 4):
        if world % tp == 0:
            dp = world // tp
            out += [(tp, ep) for ep in (1, 2, 4) if dp % ep == 0 and ep <= dp]
    return out


def run(config: Qwen3MoeConfig, tp: int, ep: int, args, device: torch.device) -> tuple[float, float, float]:
    dp = dist.get_world_size() // tp
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    hf_tp.parallelize(model, hf_tp.build_mesh(tp=tp, dp=dp, device_type=device.type), ep=ep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank() // tp)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=gen).to(device)
    times, a2a_rows = [], 0
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with hf_tp.loss_parallel():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            a2a_rows += sum(sum(s.a2a_rows) for s in record_of(model).experts.values())
    row_bytes = config.hidden_size * 4
    a2a = 2 * a2a_rows / args.steps * row_bytes  # forward rows, and their gradients back in backward
    tokens = args.batch * args.seq_len
    moe_layers = config.num_hidden_layers
    tp_bytes = 4 * moe_layers * (tp - 1) / tp * tokens * row_bytes if tp > 1 else 0.0  # AG+RS, fwd+bwd
    return statistics.median(times), a2a / 2**20, tp_bytes / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    config = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=args.seq_len,
    )
    if dist.get_rank() == 0:
        print(
            f"Qwen3-MoE hidden {args.hidden}, {args.experts} experts (top-2, intermediate {args.hidden}), "
            f"{args.layers} layers, {args.batch} x {args.seq_len} tokens per dp rank, world {dist.get_world_size()}"
        )
        print(
            f"{'tp':>3} {'dp':>3} {'ep':>3} {'step ms':>9} {'all-to-all sent MiB/rank':>25} {'tp AG+RS sent MiB/rank':>23}"
        )
    for tp, ep in layouts(dist.get_world_size()):
        step, a2a, tp_mib = run(config, tp, ep, args, device)
        if dist.get_rank() == 0:
            dp = dist.get_world_size() // tp
            print(f"{tp:>3} {dp:>3} {ep:>3} {step * 1e3:>9.1f} {a2a:>25.2f} {tp_mib:>23.2f}", flush=True)
    hf_tp.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
