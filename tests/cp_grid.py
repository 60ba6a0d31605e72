"""Context-parallel parity: a tiny random model of a family trained at cp x tp x dp against plain
single-process HF on the same rows, with padding or packed documents and a sliding window
shorter than a cp chunk.

Cases run inside one torchrun world of 4 gloo processes (:func:`run_cases`; every rank also
computes the single-process reference itself): torch's in-process threaded process group
mismatches the collectives of a flattened (dp x cp) mesh after a few worlds in one process.
Used by tests/e2e/test_context_parallel.py (a sample) and ``python -m tests.cp_grid [FAMILY...]``
(default: every family with a tp plan, at cp 2 x tp 2 with packed documents).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

WORLD = 4
SEQ = 24  # a multiple of 2 x cp x tp at cp 2 x tp 2 (8)
# The sliding window (where the family has one): shorter than a cp chunk (6 tokens).
WINDOW = int(os.environ.get("CP_GRID_WINDOW", 5))
WORKER = Path(__file__).resolve()


@dataclass(frozen=True)
class CPCase:
    family: str
    cp: int = 2
    tp: int = 2
    rows: str = "packed"  # "packed" documents, or "right" / "left" padding
    ac: bool = False  # activation checkpointing
    ep: int = 1  # expert parallelism (MoE families): ranks borrowed from dp x cp
    lora: bool = False  # peft LoRA on the projections the plan splits (frozen base), against plain peft

    def __post_init__(self) -> None:
        if self.rows != "packed" and self.dp > 1:  # (train_steps' dp loss: the mean of equal rows' means)
            raise ValueError(f"{self.name}: padded rows of different lengths need dp 1 to compare with plain HF")

    @property
    def dp(self) -> int:
        return WORLD // (self.cp * self.tp)

    @property
    def name(self) -> str:
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        tail = f"{'-ac' if self.ac else ''}{'-lora' if self.lora else ''}"
        return f"{self.family}-cp{self.cp}-tp{self.tp}-dp{self.dp}{ep}-{self.rows}{tail}"


def cp_batch(vocab: int, rows: str, b: int) -> dict[str, torch.Tensor]:
    """``b`` rows of SEQ tokens: ``"right"`` / ``"left"`` padded (different lengths), or ``"packed"``
    documents (position_ids restarting, no attention_mask: HF's packed format) crossing chunk borders."""
    from tests.helpers import batch

    if rows != "packed":
        return batch(vocab, b=b, s=SEQ, pad=rows)
    ids = batch(vocab, b=b, s=SEQ, pad=None)["input_ids"]
    docs = [(5, 11, 8), (13, 11), (24,), (3, 3, 18)][:b]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def run_case(case: CPCase, steps: int = 2) -> str:
    """On every rank of a world of ``case.cp * case.tp * case.dp``: parity of the logits of this
    rank's tokens, the loss curve, every gradient and the weights after AdamW with plain HF, or
    ``"refused: ..."`` with hf_tp's reason (the same on every rank)."""
    import torch.distributed as dist

    import hf_tp
    from hf_tp.context.token_share import TokenShare
    from tests.family_grid import grid_config, grid_model, is_moe
    from tests.parity import Trace, assert_parity, train_steps

    extra = {"sliding_window": WINDOW} if "sliding_window" in grid_config(case.family).to_dict() else {}
    config = grid_config(case.family, **extra)
    try:  # parallelize's first checks, before a refused family's (possibly large) model is built
        hf_tp.get_adapter(config).validate(config, case.tp)
    except ValueError as exc:
        return f"refused: {exc}"
    if is_moe(config):
        config.output_router_logits = False  # HF's own aux loss is per forward (hf_tp.fit reduces it globally)
    ref = grid_model(config)
    if case.lora:
        from tests.lora_grid import lora, plan_targets

        ref = lora(ref, plan_targets(ref, case.tp))
    model = copy.deepcopy(ref)
    data = cp_batch(config.vocab_size, case.rows, b=2 * case.dp)
    want = train_steps(ref, data, steps=steps)
    mesh = hf_tp.build_mesh(tp=case.tp, cp=case.cp, dp=case.dp, device_type="cpu")
    try:
        hf_tp.parallelize(model, mesh, activation_checkpointing=case.ac, ep=case.ep)
    except ValueError as exc:
        return f"refused: {exc}"
    d = mesh.get_local_rank("dp")
    rows = slice(2 * d, 2 * d + 2)
    local = {k: v[rows] for k, v in data.items()}
    dp_group = mesh["dp"].get_group() if case.dp > 1 else None
    got = train_steps(model, local, steps=steps, ctx=hf_tp.loss_parallel, dp_group=dp_group)
    mine = TokenShare(case.cp, mesh.get_local_rank("cp")).indices(SEQ)
    assert_parity(got, Trace(want.logits[rows][:, mine], want.grads, want.losses, want.params, want.start))
    dist.barrier()
    return "parity"


def run_cases(cases: list[CPCase], out: Path, timeout: float = 900, show: bool = False) -> dict[str, str]:
    """Run ``cases`` in one ``torchrun`` world of 4 processes; case name -> "parity", "refused: ..."
    or "FAILED ..." (a mismatch or a crash)."""
    spec = out / "cases.json"
    spec.write_text(json.dumps([asdict(c) for c in cases]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    proc = subprocess.run([*cmd, str(WORKER), str(spec)], env=env, capture_output=not show, text=True, timeout=timeout)
    results = out / "results.json"
    if not results.exists() or proc.returncode != 0 and not show:
        raise AssertionError(f"the cp worker wrote no results (exit {proc.returncode}):\n{(proc.stderr or '')[-4000:]}")
    return json.loads(results.read_text())


def _worker(spec: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for fields in json.loads(spec.read_text()):
        case = CPCase(**fields)
        try:
            outcome = run_case(case)
        except Exception:  # noqa: BLE001 - reported per case; a hang would need every rank to agree
            outcome = "FAILED " + traceback.format_exc()[-3000:]
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        failed = [o for o in outcomes if o.startswith("FAILED")]
        results[case.name] = failed[0] if failed else outcomes[0]
        if dist.get_rank() == 0:  # after every case: a crash of the world keeps the cases before it
            print(f"{case.name}: {results[case.name].splitlines()[0][:160]}", flush=True)
            (spec.parent / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from hf_tp.adapters.census import tensor_parallel_causal_lm_types

    names = sys.argv[1:] or sorted(tensor_parallel_causal_lm_types())
    results: dict[str, str] = {}
    todo = [CPCase(n) for n in names]
    while todo:  # a world killed by one case (out of memory, say) goes on with the next
        with tempfile.TemporaryDirectory() as tmp:
            try:
                results.update(run_cases(todo, Path(tmp), timeout=7200, show=True))
            except AssertionError:
                pass
            done = json.loads((Path(tmp) / "results.json").read_text()) if (Path(tmp) / "results.json").exists() else {}
        results.update(done)
        rest = [c for c in todo if c.name not in results]
        if rest:
            results[rest[0].name] = "FAILED: the torchrun world died in this case"
        todo = rest[1:]
    for name, outcome in results.items():
        if outcome.startswith("FAILED"):
            print(f"\n{name}:\n" + "\n".join(outcome.splitlines()[-12:]))
    held = sum(r == "parity" for r in results.values())
    print(f"{held} of {len(results)} at parity")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        _worker(Path(sys.argv[1]))
    else:
        main()
