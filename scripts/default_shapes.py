"""Plan every causal-LM family of the installed transformers at its default (published) shape,
tp=2 on the meta device, and print one line each: ``model_type  plan|refused: reason  seconds``
(tests/unit/test_default_shapes.py runs a sample in CI). Exit status 1 if any family crashed
(an exception other than hf_tp's one-line ValueError) or a flagship is refused."""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.unit.test_default_shapes import FAMILIES, FLAGSHIPS, default_shape  # noqa: E402


def main() -> int:
    bad = 0
    for model_type in FAMILIES:
        start = time.perf_counter()
        try:
            outcome = default_shape(model_type)
        except Exception as exc:  # noqa: BLE001 - a crash is what this script reports
            outcome = f"CRASH {type(exc).__name__}: {exc}".splitlines()[0]
            traceback.print_exc(limit=2)
        bad += outcome.startswith("CRASH") or (model_type in FLAGSHIPS and outcome != "plan")
        print(f"{model_type}\t{outcome[:200]}\t{time.perf_counter() - start:.1f}s", flush=True)
    counts = sum(1 for _ in FAMILIES)
    print(f"{counts} families, {bad} crashed or flagships refused")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
