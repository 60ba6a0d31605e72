"""Context parallelism end to end: a parity sample over families, paddings, packed documents,
sliding windows, cp x tp x dp layouts and activation checkpointing (one torchrun world for all
cases, tests/cp_grid.py), refusals, and `hf-tp train --cp` giving plain HF's loss curve (dense
with the fused loss, resumed at cp 1; MoE with the router aux loss over dp x cp is one of
tests/e2e/test_families_fit.py's runs)."""

from __future__ import annotations

import pytest

from hf_tp.checkpoint.checkpoint_dirs import latest_checkpoint
from tests.cp_grid import CPCase, run_cases
from tests.e2e.test_train_cli import COMMON, STEPS, hf_tp_train, metrics, setup  # noqa: F401
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e

# Hand-written families, a sample of generic and MoE ones; padding on both sides, packed documents
# (crossing the chunk borders), windows shorter than a chunk where the family has one.
CASES = [
    CPCase("llama", rows="right"),
    CPCase("llama", cp=4, tp=1, rows="left"),
    CPCase("llama", tp=1, rows="packed"),  # cp 2 x dp 2
    CPCase("qwen2"),
    CPCase("mistral", rows="right", ac=True),
    CPCase("qwen3", rows="left"),
    CPCase("gemma", tp=1),
    CPCase("gemma2"),  # eager attention: soft-capping through the family's own kernel
    CPCase("gemma3_text", rows="right"),
    CPCase("olmo2"),
    CPCase("phi3", rows="left"),
    CPCase("qwen3_moe"),
    CPCase("mixtral", tp=1),
    CPCase("qwen3_moe", ep=2, rows="right"),  # ep over the cp ranks, experts also split over tp
    CPCase("mixtral", tp=1, ep=4),  # ep over dp x cp
    CPCase("olmoe", tp=1, ep=2),  # dp_out 2: experts also sharded by FSDP2
    CPCase("mixtral", tp=1, ep=2),  # a second model on an equal ep mesh in one process (FSDP2's mesh identity)
    CPCase("qwen2", rows="right", ac=True, lora=True),  # LoRA on a frozen base, against plain peft
    CPCase("deepseek_v3"),  # latent attention: its up-projected K/V are gathered
    CPCase("gpt_oss"),  # attention sinks, sliding window
]
REFUSED = {CPCase("falcon_h1"): "mixes tokens outside attention", CPCase("lfm2"): "mixes tokens outside attention"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, str]:
    return run_cases([*CASES, *REFUSED], tmp_path_factory.mktemp("cp"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cp_parity(results, case) -> None:
    assert results[case.name] == "parity", results[case.name]


@pytest.mark.parametrize("case", list(REFUSED), ids=lambda c: c.name)
def test_cp_refusal(results, case) -> None:
    assert results[case.name].startswith("refused:") and REFUSED[case] in results[case.name], results[case.name]


def _check_curve(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step + 1}: loss {g} vs plain HF {w}"


def test_train_cp2_tp2_then_resume_at_cp1(setup, tmp_path) -> None:  # noqa: F811
    model_dir, data = setup
    out = tmp_path / "run"
    flags = ["--model", str(model_dir), "--dataset", str(data), "--output-dir", str(out), *COMMON, "--batch-size", "4"]
    half = STEPS // 2
    first = hf_tp_train(
        *flags, "--tp", "2", "--cp", "2", "--dp", "1", "--save-every", str(half), "--max-steps", str(half)
    )
    assert first.returncode == 0, first.stderr[-4000:]
    assert "tp 2 x cp 2 x dp 1" in first.stdout and latest_checkpoint(out).name == f"step-{half}"
    second = hf_tp_train(*flags, "--tp", "2", "--dp", "1", "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    want, _ = reference_losses(
        str(model_dir), str(data), seq_len=15, global_batch=4, steps=STEPS, lr=3e-3, warmup_steps=2
    )
    _check_curve([r["loss"] for r in metrics(out)], want)
