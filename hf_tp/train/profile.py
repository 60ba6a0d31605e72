"""``--profile-steps A-B``: a torch.profiler trace and op table of optimizer steps A..B, per rank.

torch.profiler does the recording; this file only chooses the steps (one warm-up step before A,
as the profiler's schedule advises), writes the files where a user finds them, and adds the one
number the op table lacks: how much of the steps' wall time the device was busy.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from hf_tp.run.config import parse_profile_steps

__all__ = ["StepProfiler", "parse_profile_steps"]


class StepProfiler:
    """Call :meth:`step` at the end of every optimizer step; files land in ``out_dir``.

    ``first_step`` is the number of the next step to run (> 1 after a resume).
    """

    def __init__(
        self, steps: tuple[int, int] | None, out_dir: Path, rank: int, device: torch.device, first_step: int = 1
    ):
        self.prof = None
        self.done = False
        if steps is None:
            return
        a, b = steps
        wait = a - 1 - first_step  # steps before the warm-up step
        if wait < 0:
            if rank == 0:
                print(f"hf-tp: --profile-steps {a}-{b} starts before step {first_step + 1}; not profiling")
            return
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.active = b - a + 1
        self.t_active: float | None = None
        self.count = 0
        self.start_at = wait + 1  # step() calls before the active window opens
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=1, active=self.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=False,
            with_stack=False,
        )
        self.prof.start()

    def step(self) -> None:
        if self.prof is None or self.done:
            return
        self.count += 1
        if self.count == self.start_at:
            self._sync()
            self.t_active = time.perf_counter()
        if self.count == self.start_at + self.active:
            self._sync()
            self.wall_s = time.perf_counter() - self.t_active
        self.prof.step()
        if self.count == self.start_at + self.active:
            self.prof.stop()
            self.done = True

    def close(self) -> None:
        """Stop early (a run that ended or failed inside the window): nothing is written then."""
        if self.prof is not None and not self.done:
            self.done = True
            self.prof.stop()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{self.rank}.trace.json.gz"
        prof.export_chrome_trace(str(trace))
        on_device = self.device.type == "cuda"
        averages = prof.key_averages()
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        table = averages.table(sort_by=sort, row_limit=40)
        wall_ms = getattr(self, "wall_s", float("nan")) * 1e3
        lines = [f"{self.active} steps, {wall_ms / self.active:.1f} ms per step (wall)"]
        if on_device:
            # Kernels, copies and memsets are the device-side events; the CPU ops' "self device
            # time" re-counts the same kernels, and user annotations (ProfilerStep#) span them.
            busy_ms = (
                sum(
                    e.self_device_time_total
                    for e in averages
                    if e.device_type == DeviceType.CUDA
                    and not getattr(e, "is_user_annotation", False)
                    and not e.key.startswith("ProfilerStep")
                )
                / 1e3
            )
            lines.append(
                f"device busy {busy_ms / self.active:.1f} ms per step ({100 * busy_ms / wall_ms:.1f}% of wall; "
                "kernels on several streams can overlap)"
            )
        (self.out_dir / f"rank{self.rank}.ops.txt").write_text("\n".join(lines) + "\n\n" + table + "\n")
        if self.rank == 0:
            print(f"hf-tp: profile of {self.active} steps in {self.out_dir} (open the .trace.json.gz in Perfetto)")
