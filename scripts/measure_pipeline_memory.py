"""Compare the estimate of a pipeline layout with a real CPU pipeline step, per stage.

    OMP_NUM_THREADS=1 python scripts/measure_pipeline_memory.py [--schedule gpipe] [--microbatches 4] [--dp 2]
        [--cp 2] [--ep 2 --moe] [--tied]

This process runs the estimate (``hf_tp.estimate.layouts.estimate_layout``: the busiest stage
simulated with the embedding and lm_head, the in-flight micro-batches added); then pp x dp x cp gloo
processes each build a ~45M-parameter Llama (4 layers, real random weights; ``--moe``: a Qwen3-MoE
of the same widths, 8 experts of which 2 per token, with transformers' router aux loss; ``--tied``:
lm_head tied to the embedding), cut it as ``hf-tp train --pp`` does, and run one tracked pipeline
step as training runs it (a MoE's routing pass for its aux loss, torch's schedule over the
micro-batches, the tied weight's gradient summed over the first and last stage and the clipped
norm, then AdamW) while a dispatch mode counts the bytes of every live tensor storage (torch's
MemTracker cannot run here: its gradient hooks break the autograd.grad call torch's stage makes to
infer its shapes) and :class:`hf_tp.estimate.counters.CommCounter`, the estimate's own counter, counts
the collectives by mesh dim (point-to-point sends and receives apart). With ``--dp`` or ``--cp`` > 1
each stage is FSDP2 over its dp x cp ranks; ``--ep`` splits the experts over them. Prints each
stage's measured peak beside the estimate's (a bound on every stage: see docs/scale.md), and the
step's collectives beside the estimate's.
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
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_tp  # noqa: E402
from hf_tp.core.mesh import split_mesh, stage_dims  # noqa: E402
from hf_tp.estimate.counters import CommCounter  # noqa: E402
from hf_tp.estimate.estimate_run import MiB  # noqa: E402
from hf_tp.estimate.layouts import estimate_layout  # noqa: E402
from hf_tp.estimate.memory import find_experts  # noqa: E402
from hf_tp.estimate.simulate import expert_groups  # noqa: E402
from hf_tp.estimate.spec import EstimateSpec  # noqa: E402
from hf_tp.parallel.grad import clip_grad_norm  # noqa: E402
from hf_tp.pipeline.pipeline_build import pipeline_parallelize  # noqa: E402
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
        if func.namespace == "c10d" and func.__name__.split(".")[0] in ("send", "recv_"):
            name = func.__name__.split(".")[0]
            count, nbytes = self.collectives.get(name, (0, 0))
            self.collectives[name] = (count + 1, nbytes + sum(t.nbytes for t in args[0]))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def model_config(args: argparse.Namespace):
    """The measured model: the small Llama, or a Qwen3-MoE of its widths (``--moe``), tied with ``--tied``."""
    config = small_llama()
    if args.moe:
        config = Qwen3MoeConfig(
            **{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads")},
            intermediate_size=1536, moe_intermediate_size=384, num_experts=8, num_experts_per_tok=2,
            num_hidden_layers=4, max_position_embeddings=2048, output_router_logits=True, router_aux_loss_coef=0.01,
        )  # fmt: skip
    config.tie_word_embeddings = args.tied
    return config


def counter_groups(pipe, mesh, config) -> tuple[dict, dict, dict]:
    """The real mesh's process groups by name as the estimate names its dims (for :class:`CommCounter`)."""
    stage = mesh[stage_dims(mesh)]
    dp_cp, tp = split_mesh(stage)
    groups = {
        dist.group.WORLD.group_name: ("world", dist.get_world_size()),
        mesh["pp"].get_group().group_name: ("pp", mesh["pp"].size()),
    }
    if dp_cp is not None:
        groups[dp_cp.get_group().group_name] = ("dp", dp_cp.size())
    if tp is not None:
        groups[tp.get_group().group_name] = ("tp", tp.size())
    functional = {}
    if "cp" in stage.mesh_dim_names:
        groups.setdefault(stage["cp"].get_group().group_name, ("cp", stage["cp"].size()))
        functional[stage["cp"].get_group().group_name] = ("cp", stage["cp"].size())
    by_collective = {}
    for model in pipe.models:
        by_collective.update(expert_groups(find_experts(model, config), groups))
    return groups, by_collective, functional


def rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One pipeline rank: build, cut, one tracked step; its peak written to ``out``."""
    world = args.pp * args.dp * args.cp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = model_config(args)
    model = AutoModelForCausalLM.from_config(config)
    mesh = hf_tp.build_mesh(tp=1, dp=args.dp, cp=args.cp, pp=args.pp, device_type="cpu")
    pipe = pipeline_parallelize(model, mesh, schedule=args.schedule, microbatches=args.microbatches, ep=args.ep)
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=False)
    for p in params:  # AdamW's state before tracking, as the estimate creates it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows = args.microbatches * args.micro_rows
    torch.manual_seed(1 + mesh.get_local_rank("dp"))  # each dp rank its own rows (cp ranks share them)
    ids = torch.randint(0, config.vocab_size, (rows, args.seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = [*params, *(b for m in pipe.models for b in m.buffers()), *state]
    counter = CommCounter(*counter_groups(pipe, mesh, config))
    with LiveBytes(held) as live, counter:
        routing = pipe.route([batch]) if pipe.has_aux else None  # a MoE's aux loss: the step's counts first
        pipe.step(batch, rows * (args.seq_len - 1) * args.dp, args.dp, routing.totals if routing else None)
        pipe.sync_tied_grads()  # the tied weight's gradients summed, the norm clipped, as training does
        clip_grad_norm(pipe.counted_parameters(), 1.0, pipe.group, pipe.mirrors)
        opt.step()
        opt.zero_grad(set_to_none=True)
    comms = {f"{c.dim} {c.collective}": (c.count, c.bytes) for c in counter.stats()}
    Path(out, f"{rank}.json").write_text(
        json.dumps({"total": live.peak, "held": LiveBytes(held).peak, "collectives": {**comms, **live.collectives}})
    )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE (8 experts, top 2, router aux loss)")
    p.add_argument("--tied", action="store_true", help="lm_head tied to the embedding")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-rows", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    spec = EstimateSpec(
        1, args.dp, args.seq_len, args.microbatches * args.micro_rows, "fp32", ep=args.ep, cp=args.cp, pp=args.pp,
        pp_schedule=args.schedule, microbatches=args.microbatches,
    )  # fmt: skip
    est = estimate_layout(model_config(args), spec)
    stage = args.dp * args.cp
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(args, 29400 + os.getpid() % 500, out), nprocs=args.pp * stage, join=True)
        measured = [json.loads(Path(out, f"{r * stage}.json").read_text()) for r in range(args.pp)]
    what = ("Qwen3-MoE" if args.moe else "Llama") + (" (tied)" if args.tied else "")
    print(
        f"{what}: pp {args.pp} x dp {args.dp} x cp {args.cp} (ep {args.ep}), {args.schedule}, "
        f"{args.microbatches} micro-batches of {args.micro_rows} x {args.seq_len}, fp32"
    )
    print(f"{'MiB':<22}{'estimate':>12}" + "".join(f"{'stage ' + str(r):>12}" for r in range(args.pp)))
    held = est.state.parameters + est.state.optimizer + est.state.other
    print(f"{'peak':<22}{est.peak.total / MiB:>12,.1f}" + "".join(f"{m['total'] / MiB:>12,.1f}" for m in measured))
    print(
        f"{'weights + AdamW state':<22}{held / MiB:>12,.1f}" + "".join(f"{m['held'] / MiB:>12,.1f}" for m in measured)
    )
    for c in est.comms:
        print(f"estimate {c.dim} {c.collective}: {c.count} calls, {c.bytes / MiB:,.3f} MiB")
    for r, m in enumerate(measured):
        ops = ", ".join(f"{k}: {n} calls, {b / MiB:,.3f} MiB" for k, (n, b) in sorted(m["collectives"].items()))
        print(f"stage {r} (its first rank) measured: {ops}")
    print(f"(estimate: the busiest stage, {est.stage_layers} layers, {est.in_flight:g} micro-batches in flight)")


if __name__ == "__main__":
    main()
