"""Families served by the generic plan train through ``hf_tp.fit`` (the loop ``hf-tp train``
runs: tests/e2e/test_api_vs_cli.py) and each gives plain HF's loss curve on the global batch.
One torchrun launch (4 ranks) runs them all; the file is also the worker
(``torchrun ... test_families_fit.py RUNS_JSON``).

- GPT-NeoX (its own module paths, attention called positionally, packed per-head
  query_key_value, parallel residual, its lm_head saved as embed_out), the farthest from Llama's
  layout, at tp2 x dp2.
- Mixtral, OLMoE and Qwen2-MoE (shared expert) with expert parallelism on three meshes, the
  router's aux loss on (also under gradient accumulation: the aux loss is the whole step's).
- GPT-OSS (hf_tp's own tp plan: attention sinks, transposed experts with biases, a router
  with a bias) at tp2 x ep2.
- Qwen3-MoE under context parallelism (cp2 x dp2): the router's aux loss is the whole global
  batch's, over dp x cp (the loop's side of tests/e2e/test_context_parallel.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.e2e.test_train_cli import ROOT, STEPS, metrics, run_killing_group
from tests.e2e.test_train_families import _family_model
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e
# (family, tp, cp, dp, ep, grad_accum). MoE: expert TP inside EP, two micro-steps; EP over all of
# dp; EP over half of dp (two replicas of each expert, their gradients summed across the replicas);
# GPT-OSS's experts' biases under expert TP inside EP; the aux loss under cp. Every MoE run has the
# router's aux loss on.
MESHES = [
    ("gpt_neox", 2, 1, 2, 1, 1),
    ("mixtral", 2, 1, 2, 2, 2),
    ("olmoe", 1, 1, 4, 4, 1),
    ("qwen2_moe", 1, 1, 4, 2, 1),
    ("gpt_oss", 2, 1, 2, 2, 1),
    ("qwen3_moe", 1, 2, 2, 1, 1),
]
DENSE = {"gpt_neox"}
MOE = dict(output_router_logits=True, num_experts=8, num_local_experts=8)
SETTINGS = {"seq_len": 15, "max_steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "report_to": "none"}


def test_families_train_like_plain_hf(tmp_path) -> None:
    runs, dirs = [], {}
    for family, tp, cp, dp, ep, accum in MESHES:
        model_dir, assets = _family_model(family, tmp_path, **({} if family in DENSE else MOE))
        dirs[family] = model_dir
        runs.append(
            dict(SETTINGS, model=str(model_dir), dataset=str(assets.data_file), output_dir=str(tmp_path / family))
            | dict(tp=tp, cp=cp, dp=dp, ep=ep, grad_accum=accum, batch_size=4 // dp // accum)
        )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__]
    proc = run_killing_group([*cmd, json.dumps(runs)], env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for family, tp, cp, dp, ep, accum in MESHES:
        records = metrics(tmp_path / family)
        got = [r["loss"] for r in records]
        want, _ = reference_losses(
            str(dirs[family]), str(assets.data_file), seq_len=15, global_batch=4, steps=STEPS, lr=3e-3, warmup_steps=2
        )
        assert len(got) == STEPS and all((r.get("aux_loss", 0) > 0) == (family not in DENSE) for r in records)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) <= 1e-5 * abs(w), (
                f"{family} tp{tp} cp{cp} dp{dp} ep{ep} x{accum} step {step + 1}: {g} vs plain HF {w}"
            )


def _worker(runs: str) -> None:
    """One torchrun rank: every run of ``runs`` in turn, in the same process group."""
    import hf_tp
    from tests.e2e.rank_exit import end_rank

    for settings in json.loads(runs):
        hf_tp.fit(hf_tp.TrainConfig(**settings))
    end_rank()


if __name__ == "__main__":
    _worker(sys.argv[1])
