"""Time the fused lm_head + cross entropy (``hf_tp.linear_cross_entropy``) against the unfused one.

One process, one device, forward + backward of the loss alone on Qwen2-0.5B's head shapes
(16,384 tokens x hidden 896, vocab 151,936, bf16): the variants of the fused version that
``hf_tp/parallel/linear_ce.py`` chose between, and HF's path (logits, fp32 upcast, cross
entropy) eager and compiled. Prints the median time, the peak memory above the inputs, and each
variant's largest gradient difference from the unfused eager one.

    python scripts/bench_fused_loss.py             # GPU
    python scripts/bench_fused_loss.py --smoke     # CPU, tiny shapes (checks the script runs)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_tp.parallel import linear_ce


def unfused(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), t, reduction="sum") / t.numel()


def fused(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return linear_ce.linear_cross_entropy(h, w, t)


def _old_accumulate(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    grad_w += (g.t() @ h).float()  # before: a product in the compute dtype, cast, then added


def run(fn: Callable, h, w, t, steps: int, sync: Callable[[], None]) -> tuple[float, float, tuple]:
    times = []
    for i in range(steps + 2):
        h.grad = w.grad = None
        if h.is_cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        sync()
        t0 = time.perf_counter()
        fn(h, w, t).backward()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if h.is_cuda else float("nan")
    return statistics.median(times) * 1e3, peak, (h.grad.float().clone(), w.grad.float().clone())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.steps = 256, 64, 1000, 2
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    h = (torch.randn(args.tokens, args.hidden, device=dev, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device=dev, generator=g) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), device=dev, generator=g)
    default_chunk, new_accumulate = linear_ce.CHUNK_BYTES, linear_ce._accumulate_weight_grad
    default = linear_ce._chunk_step_compiled  # what hf_tp uses: automatic dynamic shapes
    static = torch.compile(linear_ce._chunk_step, dynamic=False)
    dynamic = torch.compile(linear_ce._chunk_step, dynamic=True)  # hf_tp before 2026-11-23

    def configure(chunk_bytes: int, accumulate, step) -> Callable[[], None]:
        def apply() -> None:
            linear_ce.CHUNK_BYTES, linear_ce._accumulate_weight_grad = chunk_bytes, accumulate
            linear_ce._chunk_step_compiled = step

        return apply

    variants = [
        ("unfused, eager (HF's path)", unfused, configure(default_chunk, new_accumulate, default)),
        ("unfused, torch.compile", torch.compile(unfused), configure(default_chunk, new_accumulate, default)),
        ("fused, dynamic=True, product cast and added", fused, configure(default_chunk, _old_accumulate, dynamic)),
        ("fused, dynamic=True, accumulated in the GEMM", fused, configure(default_chunk, new_accumulate, dynamic)),
        ("fused, dynamic=False, GEMM", fused, configure(default_chunk, new_accumulate, static)),
        ("fused, default dynamic (hf_tp), GEMM", fused, configure(default_chunk, new_accumulate, default)),
        ("fused, dynamic=True, GEMM, 1 GiB chunks", fused, configure(2**30, new_accumulate, dynamic)),
        ("fused, dynamic=True, GEMM, 2 GiB chunks", fused, configure(2**31, new_accumulate, dynamic)),
    ]
    print(f"{args.tokens} tokens x hidden {args.hidden}, vocab {args.vocab}, {dtype}, {dev}")
    print("| variant | ms (fwd+bwd) | peak MiB above inputs | max abs diff d/dh | max abs diff d/dw |")
    print("|---|---|---|---|---|")
    ref = None
    try:
        for name, fn, apply in variants:
            apply()
            ms, peak, grads = run(fn, h, w, t, args.steps, sync)
            ref = ref or grads
            dh, dw = ((a - b).abs().max().item() for a, b in zip(grads, ref, strict=True))
            print(f"| {name} | {ms:.2f} | {peak:.0f} | {dh:.2e} | {dw:.2e} |", flush=True)
    finally:
        configure(default_chunk, new_accumulate, default)()


if __name__ == "__main__":
    main()
