"""The fast estimate (the model cut to a few periods of its layer kinds, extended to its depth:
``hf_tp/estimate/depth.py``) against the simulation of every layer.

For each case (bundled model, optionally cut to ``@N`` layers; tp, dp, ep, cp; activation
checkpointing; seq_len), batch 1, bf16: the full peak and the fast one's difference, whether the
state after the optimizer step, every collective, the work (FLOPs, bytes moved) and the MoE figures
are equal, the bytes sent and FLOPs of the step, and the CPU seconds of each. Prints a markdown
table for docs/estimate.md.

    OMP_NUM_THREADS=1 python scripts/check_fast_estimate.py [--cases llama-3.1-8b:2:4:1:1:0:4096,...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# model[@layers]:tp:dp:ep:cp:activation checkpointing:seq_len
CASES = (
    "llama-3.1-8b:2:4:1:1:0:4096",
    "llama-3.1-8b:2:4:1:1:1:4096",
    "llama-3.1-8b:2:2:1:2:1:8192",
    "qwen2-7b:4:4:1:1:1:4096",
    "gemma-2-9b:2:4:1:1:0:4096",
    "gemma-2-9b:8:8:1:1:1:4096",
    "qwen3-30b-a3b:2:4:1:1:0:4096",
    "qwen3-30b-a3b:2:8:4:1:1:4096",
    "deepseek-v3@12:8:8:8:1:0:2048",
)


def timed(fn, *args):
    start = time.process_time()
    out = fn(*args)
    return out, time.process_time() - start


def config_of(name: str):
    """A bundled config, cut to its first N layers for ``name@N``."""
    from hf_tp.estimate.depth import cut_config
    from hf_tp.estimate.spec import resolve_model_config

    base, _, layers = name.partition("@")
    config, _ = resolve_model_config(base)
    return cut_config(config, int(layers)) if layers else config


def row(case: str) -> str:
    """One case's markdown row."""
    from hf_tp.estimate import EstimateSpec, estimate_spec
    from hf_tp.estimate.depth import estimate_fast, layering

    name, tp, dp, ep, cp, ac, seq = case.split(":")
    config = config_of(name)
    spec = EstimateSpec(int(tp), int(dp), int(seq), 1, ep=int(ep), cp=int(cp), activation_checkpointing=ac == "1")
    fast, t_fast = timed(estimate_fast, config, spec, name)
    full, t_full = timed(estimate_spec, config, spec, name)
    key = lambda c: (c.dim, c.collective)  # noqa: E731
    same = {
        "state": fast.state == full.state,
        "comms": sorted(fast.comms, key=key) == sorted(full.comms, key=key),
        "work": fast.work == full.work,
        "moe": fast.moe == full.moe,
        "params": (fast.num_params, fast.trainable_params) == (full.num_params, full.trainable_params),
    }
    diff = fast.peak.total - full.peak.total
    found = layering(config)
    shape = "-" if found is None else f"{found.prefix} + {found.periods} x {found.period}"
    layout = f"{tp} x {dp}" + (f", ep {ep}" if ep != "1" else "") + (f", cp {cp}" if cp != "1" else "")
    sent = sum(c.sent_bytes for c in full.comms) / 2**30
    equal = ", ".join(k for k, v in same.items() if v) or "-"
    differ = ", ".join(k for k, v in same.items() if not v) or "-"
    return (
        f"| {name} | {config.num_hidden_layers}: {shape} | {layout} | {seq} | {'on' if ac == '1' else 'off'} "
        f"| {full.peak.total / 2**30:.3f} | {diff:+,d} ({diff / full.peak.total:+.2%}) "
        f"| {full.state.total / 2**30:.2f} | {sent:,.1f} | {full.work.model_flops / 1e12:,.1f} | {equal} | {differ} "
        f"| {t_fast:.1f} | {t_full:.1f} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="model[@layers]:tp:dp:ep:cp:ac:seq_len, comma-separated")
    args = p.parse_args()
    from hf_tp.estimate import EstimateSpec, estimate_spec

    # a process's first estimate pays one-off costs
    estimate_spec(config_of("llama-3.2-1b@1"), EstimateSpec(1, 2, 256, 1))
    print(
        "| model | layers: prefix + periods x period | tp x dp | seq | act. ckpt | full peak GiB | fast - full bytes "
        "| state GiB | sent/step GiB | model TFLOP/step | equal | differ | fast CPU s | full CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        print(row(case), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
