"""The longest sequence that fits, by context-parallel size: `hf-tp estimate` searched over seq_len.

For each model, tp 8, and cp in 1/2/4/8 with dp = 8 / cp (64 GPUs, FSDP2 over dp x cp = 8 in
every row, so the sharded state is the same and only the split of the sequence changes), with
and without activation checkpointing: the longest seq_len (a multiple of STEP, at most the
model's max_position_embeddings) whose estimated peak fits a GPU of --gpu-memory by the sweep's
rule (peak x 1.10 + 1 GiB). One sequence per dp rank. Prints a markdown table for docs/estimate.md.

    OMP_NUM_THREADS=1 python scripts/cp_longest_sequence.py [--models llama-3.1-8b,llama-3.1-70b] [--gpu-memory 80GiB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP = 8192
TP = 8
FSDP = 8  # dp x cp


def longest(config, cp: int, ac: bool, gpu: int, cap: int, say) -> tuple[int, object | None]:
    """The longest fitting seq_len (0 if not even STEP fits) and its estimate."""
    from hf_tp.estimate.api import estimate
    from hf_tp.estimate.sweep import fits

    def ok(seq: int):
        est = estimate(config, TP, FSDP // cp, seq, 1, activation_checkpointing=ac, cp=cp)
        say(f"  cp {cp} ac {ac} seq {seq}: peak {est.peak.total / 2**30:.1f} GiB")
        return est if fits(est, gpu) else None

    best, best_est, seq = 0, None, STEP
    while seq <= cap and (est := ok(seq)) is not None:  # doubling
        best, best_est, seq = seq, est, seq * 2
    lo, hi = best, min(seq, cap + STEP)  # lo fits (or 0), hi does not (or is past the cap)
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        if (est := ok(mid)) is not None:
            lo, best, best_est = mid, mid, est
        else:
            hi = mid
    return best, best_est


def _run_one(name: str, cp: int, ac: bool, gpu_memory: str) -> tuple[int, dict | None]:
    """One configuration's search in a fresh process: a second fake world with another mesh
    shape in one process fails to resolve a process group inside DTensor (torch 2.13)."""
    cmd = [sys.executable, __file__, "--one", f"{name}:{cp}:{int(ac)}", "--gpu-memory", gpu_memory]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, text=True).stdout
    found = json.loads(out.strip().splitlines()[-1])
    return found["seq"], found["estimate"]


def _sent(est: dict | None, dim: str) -> int:
    return sum(c["sent_bytes"] for c in est["comms"] if c["dim"] == dim) if est else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b")
    p.add_argument("--gpu-memory", default="80GiB")
    p.add_argument("--cp", default="1,2,4,8")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    from hf_tp.estimate.configs import resolve_model_config
    from hf_tp.estimate.sweep import parse_memory

    gpu = parse_memory(args.gpu_memory)
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {line}", file=sys.stderr, flush=True)

    if args.one:  # one (model, cp, ac) in this process: see _run_one
        name, cp, ac = args.one.split(":")
        config, _ = resolve_model_config(name)
        seq, est = longest(config, int(cp), ac == "1", gpu, config.max_position_embeddings, say)
        print(json.dumps({"seq": seq, "estimate": est.to_dict() if est else None}))
        return 0
    rows = []
    for name in args.models.split(","):
        config, _ = resolve_model_config(name)
        cap = config.max_position_embeddings
        for ac in (False, True):
            for cp in map(int, args.cp.split(",")):
                seq, est = _run_one(name, cp, ac, args.gpu_memory)
                cp_sent = _sent(est, "cp") / 2**30
                tp_sent = _sent(est, "tp") / 2**30
                peak = f"{est['peak']['total'] / 2**30:.1f}" if est else "-"
                capped = " (max positions)" if seq == cap else ""
                rows.append(
                    f"| {name} | {cp} | {FSDP // cp} | {'on' if ac else 'off'} | {seq // 1024}k{capped} | {peak} "
                    f"| {tp_sent:.1f} | {cp_sent:.1f} |"
                )
                say(rows[-1])
    print(f"tp {TP}, dp x cp = {FSDP} (64 GPUs), one sequence per dp rank, {args.gpu_memory} per GPU, bf16\n")
    print("| model | cp | dp | act. ckpt | longest seq | peak GiB | TP sent/step GiB | CP sent/step GiB |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n(searched in steps of {STEP // 1024}k tokens in {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
