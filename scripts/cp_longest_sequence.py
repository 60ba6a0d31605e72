"""The longest sequence that fits, by context-parallel size: `hf-tp estimate` searched over seq_len.

For each model, tp 8, and cp in 1/2/4/8 with dp = 8 / cp (64 GPUs, FSDP2 over dp x cp = 8 in
every row, so the sharded state is the same and only the split of the sequence changes), with
and without activation checkpointing: the longest seq_len (a multiple of STEP, at most the
model's max_position_embeddings) whose estimated peak fits a GPU of --gpu-memory by the sweep's
rule (peak x 1.10 + 1 GiB). One sequence per dp rank. Prints a markdown table for docs/estimate.md.

Each point is the fast estimate (`hf_tp.estimate.depth.estimate_fast`, what `hf-tp estimate`'s
sweep uses): the model cut to 4 and 5 decoder layers, every count extended along the line through
the two to its depth, the peak from the step's memory by segment (docs/estimate.md, "The fast
estimate"). A full-depth estimate takes a minute or more on 2 cores; a search needs a dozen points
per row. `--check` runs the full-depth estimate at each row's answer and prints it beside.

    OMP_NUM_THREADS=1 python scripts/cp_longest_sequence.py [--models llama-3.1-8b,llama-3.1-70b] [--gpu-memory 80GiB] [--check]
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


def measure(config, cp: int, ac: bool, seq: int, full: bool = False) -> dict[str, float]:
    """Peak bytes and bytes sent per rank over tp and cp of one estimate: the fast one, or every
    layer simulated (``full``)."""
    from hf_tp.estimate.spec import EstimateSpec
    from hf_tp.estimate.sweep import estimate_candidate

    spec = EstimateSpec(TP, FSDP // cp, seq, 1, activation_checkpointing=ac, cp=cp)
    est = estimate_candidate(config, spec, fast=not full).to_dict()
    sent = {dim: sum(c["sent_bytes"] for c in est["comms"] if c["dim"] == dim) for dim in ("tp", "cp")}
    return {"peak": est["peak"]["total"], **sent}


def longest(config, cp: int, ac: bool, gpu: int, cap: int, say) -> tuple[int, dict | None]:
    """The longest fitting seq_len (0 if not even STEP fits) and its figures."""
    from hf_tp.estimate.sweep import usable_peak

    def ok(seq: int):
        got = measure(config, cp, ac, seq)
        say(f"  cp {cp} ac {ac} seq {seq}: peak {got['peak'] / 2**30:.1f} GiB")
        return got if usable_peak(got["peak"], gpu) >= 0 else None

    best, best_got, seq = 0, None, STEP
    while seq <= cap and (got := ok(seq)) is not None:  # doubling
        best, best_got, seq = seq, got, seq * 2
    lo, hi = best, min(seq, cap + STEP)  # lo fits (or 0), hi does not (or is past the cap)
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        if (got := ok(mid)) is not None:
            lo, best, best_got = mid, mid, got
        else:
            hi = mid
    return best, best_got


def _run_one(name: str, cp: int, ac: bool, gpu_memory: str, check: bool) -> dict:
    """One configuration's search in a fresh process (each simulation builds fake worlds of its
    own; a fresh process keeps one row's failure from ending the table)."""
    cmd = [sys.executable, __file__, "--one", f"{name}:{cp}:{int(ac)}", "--gpu-memory", gpu_memory]
    out = subprocess.run([*cmd, *(["--check"] if check else [])], stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b")
    p.add_argument("--gpu-memory", default="80GiB")
    p.add_argument("--cp", default="1,2,4,8")
    p.add_argument("--check", action="store_true", help="also a full-depth estimate at each answer")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    from hf_tp.estimate.spec import parse_memory, resolve_model_config

    gpu = parse_memory(args.gpu_memory)
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {line}", file=sys.stderr, flush=True)

    if args.one:  # one (model, cp, ac) in this process: see _run_one
        name, cp, ac = args.one.split(":")
        config, _ = resolve_model_config(name)
        seq, got = longest(config, int(cp), ac == "1", gpu, config.max_position_embeddings, say)
        full = measure(config, int(cp), ac == "1", seq, full=True)["peak"] if args.check and seq else None
        print(json.dumps({"seq": seq, "got": got, "full_peak": full}))
        return 0
    rows = []
    for name in args.models.split(","):
        config, _ = resolve_model_config(name)
        cap = config.max_position_embeddings
        for ac in (False, True):
            for cp in map(int, args.cp.split(",")):
                found = _run_one(name, cp, ac, args.gpu_memory, args.check)
                seq, got, full = found["seq"], found["got"] or {}, found["full_peak"]
                peak = f"{got['peak'] / 2**30:.1f}" if got else "-"
                if full is not None:
                    peak += f" ({full / 2**30:.1f} full depth)"
                capped = " (max positions)" if seq == cap else ""
                rows.append(
                    f"| {name} | {cp} | {FSDP // cp} | {'on' if ac else 'off'} | {seq // 1024}k{capped} | {peak} "
                    f"| {got.get('tp', 0) / 2**30:.1f} | {got.get('cp', 0) / 2**30:.1f} |"
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
