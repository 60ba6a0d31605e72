"""Image + text end to end: ``hf-tp train`` on a tiny saved LLaVA (its processor built offline)
and a TRL-style ``images.jsonl``, preempted at tp2 x dp2, resumed at tp1 x cp2 x dp2 (context
parallelism with images: each cp rank runs the tower, keeps its share of the merged tokens), exported; against a
plain single-process transformers loop on the same global batches (tests/reference_loop.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from hf_tp.run.faults import EXIT_PREEMPTED
from tests.e2e.test_train_cli import hf_tp_train, metrics
from tests.image_data import image_rows, llava_processor, save_tiny_llava, write_images, write_jsonl
from tests.parity import assert_weights_after_adam_close
from tests.reference_loop import reference_run

pytestmark = pytest.mark.e2e
SEQ, STEPS, LR, WARMUP, NEW_TOKENS = 48, 4, 3e-3, 2, 6
RUN = ["--seq-len", str(SEQ), "--max-steps", str(STEPS), "--lr", str(LR), "--warmup-steps", str(WARMUP)]


def _frozen_tower(model: torch.nn.Module) -> torch.nn.Module:
    model.model.vision_tower.requires_grad_(False)  # hf-tp's default: the tower frozen, the projector trained
    return model


def _train(model_dir: Path, data: Path, run: Path) -> None:
    """tp2 x dp2, preempted after step 3 (SIGUSR1 to rank 0); resumed at tp1 x cp2 x dp2 to the end, exported."""
    flags = ["--model", str(model_dir), "--dataset", str(data), *RUN, "--output-dir", str(run), "--no-tensorboard"]
    os.environ["HF_TP_CRASH"] = "train:3:0:USR1"
    try:
        proc = hf_tp_train(*flags, "--tp", "2", "--dp", "2", "--batch-size", "2")
    finally:
        del os.environ["HF_TP_CRASH"]
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "llava is a multimodal checkpoint" in proc.stderr and "vision_tower" in proc.stderr
    assert "preempted at step 3" in proc.stdout
    resume = ["--tp", "1", "--cp", "2", "--dp", "2", "--batch-size", "2", "--resume", "--export-on-finish"]
    proc = hf_tp_train(*flags, *resume)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "(step 3)" in proc.stdout and "cp 2" in proc.stdout


def _greedy(model: torch.nn.Module, prompt: dict) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(
        **prompt, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    return out.sequences, torch.stack(out.logits)


def test_image_train_resume_on_another_mesh_export_and_generate(tmp_path: Path) -> None:
    """One run serves every check: the loss curve of plain HF across the preemption and the change
    of mesh; the export loads with AutoModelForImageTextToText and AutoProcessor, holds plain HF's
    weights after the same AdamW steps (the frozen tower byte for byte), and decodes an image
    prompt greedily to plain HF's trained model's tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration

    model_dir = save_tiny_llava(tmp_path / "llava", llava_processor())
    # Rows 3 and 7 hold no image: steps 1 (tp2 x dp2) and 4 (tp1 x cp2 x dp2) give one dp rank only
    # rows without images (hf_tp.data.image_steps adds its ghost row there).
    rows = image_rows(write_images(tmp_path, 3), counts=(1, 2, 1, 0, 1, 2, 1, 0))
    data = write_jsonl(tmp_path / "images.jsonl", rows)
    run = tmp_path / "run"
    _train(model_dir, data, run)

    want_weights: dict[str, torch.Tensor] = {}
    schedule = dict(seq_len=SEQ, global_batch=4, steps=STEPS, lr=LR, warmup_steps=WARMUP)
    want, _, _ = reference_run(str(model_dir), str(data), **schedule, wrap=_frozen_tower, weights_out=want_weights)
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    got_losses = [r["loss"] for r in records]
    worst = max(abs(g - w) / abs(w) for g, w in zip(got_losses, want, strict=True))
    assert worst <= 1e-5, f"hf-tp losses {got_losses} vs plain HF {want}"

    export = run / "export"
    got = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    assert type(got) is LlavaForConditionalGeneration
    start = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    assert_weights_after_adam_close(dict(got.state_dict()), want_weights, dict(start.state_dict()))
    source, exported = load_file(model_dir / "model.safetensors"), load_file(export / "model.safetensors")
    tower = [k for k in source if ".vision_tower." in k or k.startswith("vision_tower.")]
    assert tower and all(torch.equal(source[k], exported[k]) for k in tower)

    processor = AutoProcessor.from_pretrained(export)  # the checkpoint kept the processor the run used
    user = [{"role": "user", "content": rows[1]["messages"][0]["content"]}]  # two images
    text = processor.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    images = [Image.open(tmp_path / name).convert("RGB") for name in rows[1]["images"]]
    prompt = dict(processor(text=[text], images=[images], return_tensors="pt"))
    start.load_state_dict(want_weights)  # plain HF's model after the same steps
    tokens, logits = _greedy(got.eval(), prompt)
    want_tokens, want_logits = _greedy(start.eval(), prompt)
    assert torch.equal(tokens, want_tokens), f"export decodes {tokens.tolist()}, plain HF {want_tokens.tolist()}"
    logits_diff = ((logits - want_logits).abs().max() / want_logits.abs().max()).item()
    assert logits_diff < 1e-5
    print(f"image e2e: losses {worst:.1e} (relative), generate logits {logits_diff:.1e} (of the largest)")
