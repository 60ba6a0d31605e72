"""Compare the estimate of a pipeline layout with a real CPU pipeline step, per stage.

    OMP_NUM_THREADS=1 python scripts/measure_pipeline_memory.py [--schedule gpipe] [--microbatches 4] [--dp 2]

This process runs the estimate (``hf_tp.estimate.layouts.estimate_layout``: the busiest stage
simulated with the embedding and lm_head, the in-flight micro-batches added); then pp x dp gloo
processes each build a ~45M-parameter Llama (4 layers, real random weights), cut it as ``hf-tp
train --pp`` does, and run one tracked pipeline step (torch's schedule over the micro-batches, then
AdamW) while a dispatch mode counts the bytes of every live tensor storage (torch's MemTracker
cannot run here: its gradient hooks break the autograd.grad call torch's stage makes to infer its
shapes) and counts the collectives it sees (c10d ops). With ``--dp`` > 1 each stage is FSDP2 over
its dp ranks. Prints each stage's measured peak beside the estimate's (a bound on every stage: see
docs/scale.md), and the FSDP2 collectives of the step beside the estimate's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_tp  # noqa: E402
from hf_tp.estimate.api import MiB  # noqa: E402
from hf_tp.estimate.layouts import estimate_layout  # noqa: E402
from hf_tp.estimate.spec import EstimateSpec  # noqa: E402
from hf_tp.parallel.pipeline_build import pipeline_parallelize  # noqa: E402
from scripts.measure_memory import small_llama  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by live tensor storages: ``base`` ones at the start (the
    parameters and optimizer state), plus every storage an op creates, until it is freed."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.refs: dict[int, weakref.ref] = {}
        self.current = self.peak = 0
        self.collectives: dict[str, int] = {}
        for t in held:
            self._add(t)
        self.peak = self.current

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        st = t.untyped_storage()
        key = id(st)
        if key in self.refs or not st.nbytes():
            return
        size = st.nbytes()
        self.refs[key] = weakref.ref(st, lambda _, key=key, size=size: self._free(key, size))
        self.current += size
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, size: int) -> None:
        if self.refs.pop(key, None) is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            self.collectives[name] = self.collectives.get(name, 0) + 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One pipeline rank: build, cut, one tracked step; its peak written to ``out``."""
    world = args.pp * args.dp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = small_llama()
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    mesh = hf_tp.build_mesh(tp=1, dp=args.dp, pp=args.pp, device_type="cpu")
    pipe = pipeline_parallelize(model, mesh, schedule=args.schedule, microbatches=args.microbatches)
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=False)
    for p in params:  # AdamW's state before tracking, as the estimate creates it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows = args.microbatches * args.micro_rows
    ids = torch.randint(0, config.vocab_size, (rows, args.seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = [*params, *(b for m in pipe.models for b in m.buffers()), *state]
    with LiveBytes(held) as live:
        pipe.step(batch, rows * (args.seq_len - 1) * args.dp, args.dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
    Path(out, f"{rank}.json").write_text(
        json.dumps({"total": live.peak, "held": LiveBytes(held).peak, "collectives": live.collectives})
    )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-rows", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    spec = EstimateSpec(
        1, args.dp, args.seq_len, args.microbatches * args.micro_rows, "fp32", pp=args.pp, pp_schedule=args.schedule,
        microbatches=args.microbatches,
    )  # fmt: skip
    est = estimate_layout(small_llama(), spec)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(args, 29400 + os.getpid() % 500, out), nprocs=args.pp * args.dp, join=True)
        measured = [json.loads(Path(out, f"{r * args.dp}.json").read_text()) for r in range(args.pp)]
    print(
        f"pp {args.pp} x dp {args.dp}, {args.schedule}, {args.microbatches} micro-batches of {args.micro_rows} x {args.seq_len}, fp32"
    )
    print(f"{'MiB':<22}{'estimate':>12}" + "".join(f"{'stage ' + str(r):>12}" for r in range(args.pp)))
    held = est.state.parameters + est.state.optimizer + est.state.other
    print(f"{'peak':<22}{est.peak.total / MiB:>12,.1f}" + "".join(f"{m['total'] / MiB:>12,.1f}" for m in measured))
    print(
        f"{'weights + AdamW state':<22}{held / MiB:>12,.1f}" + "".join(f"{m['held'] / MiB:>12,.1f}" for m in measured)
    )
    for c in est.comms:
        print(f"estimate {c.dim} {c.collective}: {c.count} calls, {c.bytes / MiB:,.1f} MiB")
    for r, m in enumerate(measured):
        print(f"stage {r} (its first dp rank) c10d ops: {m['collectives']}")
    print(f"(estimate: the busiest stage, {est.stage_layers} layers, {est.in_flight:g} micro-batches in flight)")


if __name__ == "__main__":
    main()
