"""``--profile-steps``: which steps are recorded and what lands on disk."""

from __future__ import annotations

import torch


def test_step_profiler_writes_trace_and_table(tmp_path) -> None:
    from hf_tp.train.profile import StepProfiler, parse_profile_steps

    assert parse_profile_steps("3") == (3, 3) and parse_profile_steps(None) is None
    prof = StepProfiler(parse_profile_steps("3-4"), tmp_path, rank=0, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    for _ in range(6):
        (x @ x).sum()
        prof.step()
    prof.close()
    assert (tmp_path / "rank0.trace.json.gz").stat().st_size > 0
    table = (tmp_path / "rank0.ops.txt").read_text()
    assert table.startswith("2 steps, ") and "aten::mm" in table
