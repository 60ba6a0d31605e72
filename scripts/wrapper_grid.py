"""Run the whole wrapper grid (tests/wrapper_grid.py) and write its table into docs/multimodal.md.

Every multimodal wrapper of the installed transformers whose language model hf_tp trains, as a
tiny random checkpoint of its real config classes, trained on text at tp=2 (and tp2 x dp2 for a
few) against plain transformers on the same wrapper. Takes a few minutes on 2 CPU cores:

    OMP_NUM_THREADS=1 python scripts/wrapper_grid.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers.utils import logging as hf_logging  # noqa: E402

from tests.wrapper_grid import WrapperCase, WrapperResult, run_cases, wrapper_types  # noqa: E402

DP2 = ("llava", "gemma3", "gemma4", "qwen3_5", "mistral3", "internvl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
DOC = ROOT / "docs" / "multimodal.md"
BEGIN, END = "<!-- wrapper grid: begin -->", "<!-- wrapper grid: end -->"


def run(model_type: str, dp: int) -> WrapperResult:
    try:
        return run_cases([WrapperCase(model_type, dp=dp)])[0]
    except AssertionError as exc:  # a rank failed: parity does not hold
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        return WrapperResult(model_type, "", "FAILS", last[:200])


def table(rows: list[tuple[WrapperResult, WrapperResult | None, float]]) -> str:
    lines = [
        "| wrapper | language model | tp=2 | logits | grads | loss curve | tp2 x dp2 | seconds | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, d, secs in rows:
        diffs = (
            [f"{r.logits_diff:.1e}", f"{r.grad_diff:.1e}", f"{r.loss_diff:.1e}"]
            if r.status == "parity"
            else ["", "", ""]
        )
        dp = d.status if d is not None else ""
        reason = r.reason.replace("|", "/")
        lines.append(
            f"| {r.model_type} | {r.text_type} | {r.status} | {' | '.join(diffs)} | {dp} | {secs:.1f} | {reason} |"
        )
    return "\n".join(lines)


def main(only: list[str]) -> int:
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    types = wrapper_types()
    rows = []
    for model_type in only or sorted(types):
        start = time.perf_counter()
        result = run(model_type, 1)
        result.text_type = result.text_type or types.get(model_type, "")
        dp = run(model_type, 2) if model_type in DP2 and result.status == "parity" else None
        rows.append((result, dp, time.perf_counter() - start))
        print(f"{model_type}: {result.status} {result.reason}", flush=True)
    held = sum(r.status == "parity" for r, _, _ in rows)
    summary = (
        f"Last run: {time.strftime('%Y-%m-%d')}, {held} of {len(rows)} wrappers at parity "
        f"(`python scripts/wrapper_grid.py`). Diffs: max |hf_tp - HF| relative to the largest value "
        "(logits), to each tensor's largest gradient (grads, the worst tensor), and the AdamW steps' losses "
        "(HF computes its loss in fp32, so ~1e-7 is fp32 round-off; the grid's models are float64)."
    )
    if not only:
        text = DOC.read_text()
        block = f"{BEGIN}\n{summary}\n\n{table(rows)}\n{END}"
        DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S))
    print(summary)
    return 0 if all(r.status != "FAILS" and (d is None or d.status == "parity") for r, d, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
