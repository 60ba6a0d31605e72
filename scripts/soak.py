"""Soak test: a long ``hf-tp train`` run of the embedded default, watching every rank for leaks.

Runs the embedded default (tiny Llama, tp 2 x dp 2 on CPU) for ``--steps`` optimizer steps with a
checkpoint every ``--save-every`` steps and ``--keep-checkpoints`` kept, tails metrics.jsonl, and every
``--sample-every`` steps reads each rank's resident memory (/proc/PID/status VmRSS) and open file
descriptors (/proc/PID/fd). At the end it prints a table and a verdict: flat when the growth from the
first sample after warm-up to the last stays under ``--rss-tolerance-mib`` and ``--fd-tolerance``.

    python scripts/soak.py --steps 2000            # the recorded run (docs/training.md, "Long runs")
    python scripts/soak.py --steps 300 --json      # quick look, machine-readable

Linux only (reads /proc). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Sample:
    """One reading of every rank at an optimizer step."""

    step: int
    seconds: float
    rss_mib: dict[int, float] = field(default_factory=dict)  # rank -> VmRSS in MiB
    fds: dict[int, int] = field(default_factory=dict)  # rank -> open file descriptors
    checkpoints: int = 0


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (through /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the training ranks under the launcher (the processes whose environment has RANK)."""
    ranks = {}
    for pid in _children(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        values = dict(item.split(b"=", 1) for item in env if b"=" in item)
        if b"RANK" in values and b"hf_tp.train" in cmdline:
            ranks[int(values[b"RANK"])] = pid
    return ranks


def read_rank(pid: int) -> tuple[float, int]:
    """(VmRSS in MiB, number of open file descriptors) of one process."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def last_step(metrics: Path) -> int:
    """The newest optimizer step recorded in metrics.jsonl (0 before the first record)."""
    if not metrics.exists():
        return 0
    step = 0
    for line in metrics.read_text().splitlines():
        try:
            step = max(step, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            continue  # a line being written right now
    return step


def run_soak(args: argparse.Namespace, out: Path) -> tuple[list[Sample], int]:
    """Start the run, sample its ranks every ``sample_every`` steps; returns the samples and the exit code."""
    cmd = [sys.executable, "-m", "hf_tp.cli.main", "train", "--max-steps", str(args.steps)]
    cmd += ["--save-every", str(args.save_every), "--keep-checkpoints", str(args.keep_checkpoints)]
    cmd += ["--output-dir", str(out), "--overwrite", "--log-every", "10", *args.extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - lives as long as the run
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    samples: list[Sample] = []
    next_step = args.sample_every
    while proc.poll() is None:
        time.sleep(args.poll)
        if last_step(out / "metrics.jsonl") < next_step:
            continue
        sample = Sample(step=next_step, seconds=round(time.time() - start, 1))
        for rank, pid in sorted(rank_pids(proc.pid).items()):
            try:
                sample.rss_mib[rank], sample.fds[rank] = read_rank(pid)
            except OSError:
                continue  # the rank ended between listing and reading
        sample.checkpoints = len(list((out / "checkpoints").glob("step-*")))
        next_step += args.sample_every
        if not sample.rss_mib:
            continue  # the ranks had already ended (the last step)
        samples.append(sample)
        if not args.json:
            print(_row(sample), flush=True)
    log.close()
    return samples, proc.returncode


def _row(s: Sample) -> str:
    rss = " ".join(f"{s.rss_mib[r]:7.1f}" for r in sorted(s.rss_mib))
    fds = " ".join(f"{s.fds[r]:4d}" for r in sorted(s.fds))
    return f"{s.step:6d} {s.seconds:8.0f}  rss MiB [{rss}]  fds [{fds}]  checkpoints {s.checkpoints}"


def verdict(samples: list[Sample], rss_tol: float, fd_tol: int) -> dict:
    """Growth per rank from the first sample to the last; flat when every rank stays within tolerance."""
    full = [s for s in samples if s.rss_mib]
    if len(full) < 2:
        return {"flat": False, "reason": "fewer than two samples of the ranks"}
    first, last = full[0], full[-1]
    ranks = sorted(set(first.rss_mib) & set(last.rss_mib))
    rss_growth = {r: round(last.rss_mib[r] - first.rss_mib[r], 1) for r in ranks}
    fd_growth = {r: last.fds[r] - first.fds[r] for r in ranks}
    flat = all(v <= rss_tol for v in rss_growth.values()) and all(v <= fd_tol for v in fd_growth.values())
    return {
        "flat": flat,
        "from_step": first.step,
        "to_step": last.step,
        "rss_growth_mib": rss_growth,
        "fd_growth": fd_growth,
        "rss_tolerance_mib": rss_tol,
        "fd_tolerance": fd_tol,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--sample-every", type=int, default=100, help="steps between readings of the ranks")
    p.add_argument("--rss-tolerance-mib", type=float, default=20.0, help="allowed RSS growth per rank")
    p.add_argument("--fd-tolerance", type=int, default=2, help="allowed growth of open descriptors per rank")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between looks at metrics.jsonl")
    p.add_argument("--output-dir", type=Path, help="run folder (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("extra", nargs="*", help="more `hf-tp train` flags, after --")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hf_tp-soak-") as tmp:
        out = args.output_dir or Path(tmp) / "run"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not args.json:
            print(f"soak: {args.steps} steps, save every {args.save_every}, keep {args.keep_checkpoints} -> {out}")
            print(f"{'step':>6} {'seconds':>8}  per rank 0..N-1")
        samples, code = run_soak(args, out)
        result = verdict(samples, args.rss_tolerance_mib, args.fd_tolerance)
        result.update(steps=args.steps, exit_code=code, samples=[asdict(s) for s in samples])
        if code != 0:
            result["flat"] = False
            tail = (out.parent / f"{out.name}.log").read_text().strip().splitlines()[-1:]
            result["reason"] = f"hf-tp train exited with {code}: {' '.join(tail)}"
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        growth = ", ".join(
            f"rank {r}: {v:+.1f} MiB / {result['fd_growth'][r]:+d} fds"
            for r, v in result.get("rss_growth_mib", {}).items()
        )
        state = "FLAT" if result["flat"] else "NOT FLAT"
        print(
            f"verdict: {state} from step {result.get('from_step')} to {result.get('to_step')} ({growth})"
            + (f"; {result['reason']}" if "reason" in result else "")
        )
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
