"""hf_tp.generate and hf_tp.evaluate with real processes at tp=2 x dp=2 (FSDP2 + TP): greedy and sampled generate,
evaluate over the dp ranks' own rows. The file is also the torchrun worker (run as a script)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
NEW_TOKENS = 8


def test_generate_and_evaluate_tp2_dp2() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("GENERATE OK") == 4, proc.stdout[-3000:]


def _prompts(vocab: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """Two left-padded prompts of length 7 (and 4), different on each dp rank."""
    g = torch.Generator().manual_seed(10 + dp_rank)
    ids = torch.randint(3, vocab, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _worker() -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import hf_tp
    from hf_tp.parallel.generate import generate
    from hf_tp.parallel.held_out import evaluate
    from tests.e2e.rank_exit import end_rank
    from tests.helpers import batch, tiny_config, tiny_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_rank, tp_rank = divmod(rank, 2)
    config = tiny_config("qwen2", tied=True)
    ref = tiny_model(config)  # same seed on every rank: same weights
    model = copy.deepcopy(ref)
    prompt = _prompts(config.vocab_size, dp_rank)
    greedy = ref.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    # Sampling follows the first tp rank's RNG: plain HF seeded like that rank draws the same.
    torch.manual_seed(100 + 2 * dp_rank)
    sampled = ref.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=50)
    batches = {d: [batch(config.vocab_size, b=2, s=9 + d, seed=20 + 2 * d + i) for i in range(2)] for d in (0, 1)}
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches[0] + batches[1]:
            logits = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            targets = b["labels"][:, 1:]
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            count += int((targets != -100).sum())

    hf_tp.parallelize(model, hf_tp.build_mesh(tp=2, dp=2, device_type="cpu"))
    model.train()
    got = generate(model, **prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, greedy), (got, greedy)
    torch.manual_seed(100 + rank)  # the second tp rank's own seed is overridden while sampling
    own_state = torch.get_rng_state()
    got = generate(model, **prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=50)
    assert torch.equal(got, sampled), (got, sampled)
    if tp_rank == 1:
        assert torch.equal(torch.get_rng_state(), own_state)
    result = evaluate(model, batches[dp_rank])
    assert result.tokens == count and abs(result.loss - total / count) <= 1e-5 * total / count, (result, total / count)
    assert model.training
    print(f"GENERATE OK rank {rank}", flush=True)
    end_rank()


if __name__ == "__main__":
    _worker()
