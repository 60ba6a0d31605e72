"""Image + text parity of the multimodal wrappers in tests/image_grid.py: hf_tp at tp=2 and
tp2 x dp2 against plain transformers on the same tiny wrapper (logits, loss, every trainable
gradient, an AdamW step; greedy generate with images at tp=2). Prints a markdown table:

    OMP_NUM_THREADS=1 python scripts/image_grid.py [--ac] [--compile] [MODEL_TYPE ...]
    OMP_NUM_THREADS=1 python scripts/image_grid.py --processors [MODEL_TYPE ...]

``--ac``: activation checkpointing; ``--compile``: torch.compile on each of the language model's
decoder layers (inductor on CPU, about a minute a case; no generate: decoding would recompile).
``--processors``: the families whose real processor is built offline (tests/processor_images.py),
TRL rows rendered by it and batched by hf_tp's data path, loss and gradients at tp2 and tp2 x dp2.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from tests.image_grid import FAMILIES, ImageCase, run_image_cases  # noqa: E402
from tests.processor_images import PROCESSORS, processor_parity  # noqa: E402


def processor_grid(names: list[str]) -> None:
    """One row per family and mesh: the max relative loss and gradient differences to plain HF."""
    print("| wrapper | processor | mesh | loss | grads | seconds (both meshes) |")
    print("|---|---|---|---|---|---|")
    for mt in names:
        start = time.time()
        with tempfile.TemporaryDirectory() as folder:
            try:
                diffs = processor_parity(mt, Path(folder))
            except AssertionError as exc:
                print(f"| {mt} | | FAILS: {str(exc).splitlines()[-1][:150]} ||||")
                continue
        name = type(PROCESSORS[mt][0]()).__name__
        for dp in (1, 2):
            mesh = "tp2" if dp == 1 else "tp2 x dp2"
            cells = f"{diffs[dp, 'loss']:.1e} | {diffs[dp, 'grads']:.1e}"
            print(f"| {mt} | {name} | {mesh} | {cells} | {time.time() - start:.1f} |")


def main() -> None:
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    opts = dict(ac="--ac" in flags, compile="--compile" in flags)
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--processors" in flags:
        processor_grid(names or list(PROCESSORS))
        return
    names = names or list(FAMILIES)
    print("| wrapper | mesh | vision tower | logits | loss | loss after AdamW | grads | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for mt in names:
        for dp, tower in ((1, False), (2, False), (2, True)):
            start = time.time()
            torch._dynamo.reset()  # compiled frames of an earlier case's threads and process groups
            try:
                diffs = run_image_cases([ImageCase(mt, dp=dp, train_vision_tower=tower, **opts)])[(mt, dp)]
            except AssertionError as exc:
                print(f"| {mt} | tp2 x dp{dp} | FAILS: {str(exc).splitlines()[-1][:150]} |||||||")
                continue
            cells = " | ".join(f"{diffs[k]:.1e}" for k in ("logits", "loss", "loss after AdamW", "grads"))
            mesh = "tp2" if dp == 1 else "tp2 x dp2"
            print(f"| {mt} | {mesh} | {'trained' if tower else 'frozen'} | {cells} | {time.time() - start:.1f} |")


if __name__ == "__main__":
    main()
