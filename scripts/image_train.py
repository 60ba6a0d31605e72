"""End to end: ``hf-tp train`` on image + text conversations against a plain HF loop.

Builds (offline, in a temporary folder) a tiny random LLaVA saved with its processor, a few PNGs
and a TRL-style ``images.jsonl``; runs ``hf-tp train --tp 2 --dp 2`` on it and a single-process
plain transformers loop on the same global batches (vision tower frozen in both, AdamW, hf-tp's
schedule and clipping), and prints both loss curves and their largest relative difference:

    OMP_NUM_THREADS=1 python scripts/image_train.py [--tp 2 --cp 1 --dp 2 --steps 4] [--train-vision-tower]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hf_tp.data import GlobalBatchOrder, load_text_dataset  # noqa: E402
from hf_tp.data.formats.images import ImageBatchCollator  # noqa: E402
from hf_tp.data.image_data import encode_image_dataset  # noqa: E402
from tests.image_data import image_rows, llava_processor, save_tiny_llava, write_images, write_jsonl  # noqa: E402

LR, WARMUP, SEQ = 3e-3, 2, 48


def reference(model_dir: Path, data: Path, steps: int, global_batch: int, tower: bool) -> list[float]:
    """Plain transformers on the global batches hf-tp reads (the projector and language model train)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    raw = load_text_dataset(str(data))
    rows, _ = encode_image_dataset(
        raw, processor, seq_len=SEQ, assistant_only=True, label=f"'{data}'", base_dir=data.parent
    )
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.model.vision_tower.requires_grad_(tower)
    model.train()
    order = GlobalBatchOrder(num_examples=len(rows), global_batch=global_batch, seed=0)
    collate = ImageBatchCollator(processor, base_dir=data.parent)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / (WARMUP + 1)
        progress = (step - WARMUP) / max(1, steps - WARMUP)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * 0.9 + 0.1)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses = []
    for step in range(steps):
        loss = model(**collate([rows[i] for i in order.step_indices(step)]), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--train-vision-tower", action="store_true")
    args = parser.parse_args()
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir = save_tiny_llava(folder / "llava", llava_processor())
        data = write_jsonl(folder / "images.jsonl", image_rows(write_images(folder, 3)))
        out = folder / "run"
        cmd = [sys.executable, "-m", "hf_tp.cli.main", "train", "--model", str(model_dir), "--dataset", str(data)]
        cmd += [
            "--output-dir",
            str(out),
            "--tp",
            str(args.tp),
            "--cp",
            str(args.cp),
            "--dp",
            str(args.dp),
            "--batch-size",
            "2",
        ]
        cmd += ["--seq-len", str(SEQ), "--max-steps", str(args.steps), "--lr", str(LR), "--warmup-steps", str(WARMUP)]
        cmd += ["--no-tensorboard"] + (["--train-vision-tower"] if args.train_vision_tower else [])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        print(proc.stderr[-3000:])
        if proc.returncode != 0:
            raise SystemExit(proc.returncode)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        got = [r["loss"] for r in rows if r.get("split") != "eval"]
        want = reference(model_dir, data, args.steps, 2 * args.dp, args.train_vision_tower)
    diff = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    print(
        f"hf-tp train tp={args.tp} cp={args.cp} dp={args.dp}: {got}\nplain HF:            {want}\nmax relative diff {diff:.1e}"
    )
    if diff > 1e-5:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
