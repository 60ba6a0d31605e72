"""A fast estimate: the model cut to a few periods of its decoder-layer kinds, extended to its depth.

The decoder layers of a model repeat: the same layer (Llama), a period of kinds (Gemma-2's sliding
and full attention, a MoE layer every n-th), after a prefix of layers unlike the rest (DeepSeek-V3's
first dense layers). :func:`estimate_fast` simulates the prefix and 3, then 4 periods of the rest
(:data:`PERIODS`), and extends every count along the line through the two to the model's own
number of periods:

- exact for what is a fixed part plus the same amount per period: parameters, gradients and
  optimizer state, every collective (count, bytes, bytes sent), FLOPs and bytes moved, the MoE
  figures, the state after the optimizer step;
- the peak, from the step's memory by segment (:mod:`hf_tp.estimate.memory`). At any op of a
  layer's forward or backward, what is live is a fixed part plus an amount per layer before or
  after it (saved activations, gradient shards) plus the sharded state (per layer of the model), so
  a segment's largest moment moves along a line with the depth, and with the layer's index. The
  segments are grouped by where their layer sits: the prefix layers one by one, the first period,
  the last, and the periods between (each position in a period apart). Over the periods between,
  the largest moment is that of the one next to the first or the last (a line in the index peaks at
  an end), the same neighbour at 3 and 4 periods as at any depth. So every group's largest moment is
  on a line in the number of periods, and the peak is the largest group extended to the depth.

Not extended (simulated in full): multimodal wrappers, models whose layers after a prefix do not
repeat with a period, models of at most 5 periods (nothing to gain), and a cut config that does
not build the same layer kinds as the full model's first layers.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.adapters.shrink import layer_kinds
from hf_tp.estimate.counters import CommStat
from hf_tp.estimate.estimate_run import Estimate, model_label, simulate_spec
from hf_tp.estimate.layouts import config_key
from hf_tp.estimate.memory import MemoryBreakdown, SegmentKey
from hf_tp.estimate.spec import EstimateSpec

PERIODS = (4, 5)  # periods of the repeating layers simulated
CHECK = 6  # periods of the run a checked extension must predict exactly
Simulated = tuple[Estimate, dict[SegmentKey, MemoryBreakdown]]  # simulate_spec's result
# MoEStats fields that are one layer's figure (the rest sum over the MoE layers)
_PER_LAYER_MOE = {"experts", "experts_per_rank", "top_k", "routed_rows", "forward_peak_bytes", "balanced_routing"}


@dataclass(frozen=True)
class Layering:
    """Decoder layers as ``prefix`` layers unlike the rest, then ``periods`` repeats of ``period`` layers."""

    prefix: int
    period: int
    periods: int

    def layers(self, periods: int) -> int:
        return self.prefix + periods * self.period

    def position(self, index: int, periods: int) -> tuple[str, int]:
        """Where layer ``index`` sits in a model of ``periods`` periods: ("prefix", i), or ("first" /
        "between" / "last", its place in its period)."""
        if index < self.prefix:
            return "prefix", index
        j, offset = divmod(index - self.prefix, self.period)
        return ("first" if j == 0 else "last" if j == periods - 1 else "between"), offset


def layering(config: PretrainedConfig) -> Layering | None:
    """How ``config``'s decoder layers repeat, or None where the fast estimate does not apply (see
    the module docstring). Read once per config (a meta model of each depth: no memory)."""
    if get_adapter(config).language_model:
        return None
    key = config.to_json_string()
    if key not in _KNOWN:
        _KNOWN[key] = _find_layering(config)
    return _KNOWN[key]


_KNOWN: dict[str, Layering | None] = {}


def _find_layering(config: PretrainedConfig) -> Layering | None:
    kinds = layer_kinds(config)
    depth = len(kinds)
    shapes = [
        (prefix, period)
        for prefix in range(depth)
        for period in range(1, (depth - prefix) // (PERIODS[1] + 1) + 1)
        if (depth - prefix) % period == 0
        and all(kinds[i] == kinds[prefix + (i - prefix) % period] for i in range(prefix, depth))
    ]
    if not shapes:
        return None
    prefix, period = min(shapes, key=lambda s: s[0] + PERIODS[1] * s[1])  # the fewest layers simulated
    found = Layering(prefix, period, (depth - prefix) // period)
    for n in PERIODS:
        if layer_kinds(cut_config(config, found.layers(n))) != kinds[: found.layers(n)]:
            return None
    return found


def cut_config(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """``config`` with its first ``layers`` decoder layers (every per-layer list cut to match)."""
    whole = config.to_dict()
    depth = config.num_hidden_layers
    cut = {k: v[:layers] for k, v in whole.items() if isinstance(v, list) and len(v) == depth and k != "architectures"}
    return config.__class__.from_dict({**whole, **cut, "num_hidden_layers": layers})


class Simulations:
    """The simulations of one sweep (:func:`hf_tp.estimate.estimate_run.simulate_spec`), each run once, by
    (config, spec). With ``jobs`` > 1 they run in that many worker processes, forked from this one
    when the first is submitted: a simulation is single-threaded Python (fake tensors), so processes
    are what spreads a sweep over cores, and a forked worker starts without importing torch and
    transformers again (seconds each). :meth:`submit` queues a run, :meth:`get` waits for it."""

    def __init__(self, jobs: int = 1) -> None:
        self.jobs = max(1, jobs)
        self._pool: ProcessPoolExecutor | None = None
        self._runs: dict[tuple[str, EstimateSpec], Future | Simulated] = {}

    def submit(self, config: PretrainedConfig, spec: EstimateSpec, name: str | None) -> None:
        """Start simulating ``config`` as ``spec`` in a worker (nothing without workers)."""
        key = (config_key(config), spec)
        if self.jobs > 1 and key not in self._runs:
            self._runs[key] = self._workers().submit(simulate_spec, config, spec, name)

    def get(self, config: PretrainedConfig, spec: EstimateSpec, name: str | None) -> Simulated:
        """The simulation of ``config`` as ``spec``: a worker's (waited for) or run here."""
        key = (config_key(config), spec)
        self.submit(config, spec, name)
        run = self._runs.get(key)
        if run is None:
            run = simulate_spec(config, spec, name)
        elif isinstance(run, Future):
            try:
                run = run.result()
            except BrokenProcessPool as exc:  # (killed: out of memory, a signal)
                raise WorkerDied(
                    f"a simulation worker process died ({exc}); rerun with fewer --jobs (1: no workers)"
                ) from exc
        self._runs[key] = run
        return run

    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=_context(self.jobs), initializer=_ignore_interrupts)
        return self._pool

    def close(self) -> None:
        """Stop the workers (queued runs dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Simulations:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkerDied(RuntimeError):
    """A sweep's worker process ended before its simulation did."""


def _ignore_interrupts() -> None:
    """A worker leaves Ctrl-C to the sweep's process, which stops the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _context(jobs: int) -> multiprocessing.context.BaseContext:
    """How workers start: forked from this process where it runs no other Python thread (fast: no
    imports, and the caller's set-up, e.g. a registered adapter, carried over); else from a fork
    server started clean, which imports hf_tp's estimate once (a fork copies the locks other
    threads hold at that moment, held forever in the child: a hang seen under pytest-xdist's threads)."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["hf_tp.estimate.estimate_run"])
        return context
    raise ValueError(
        f"--jobs {jobs}: a sweep's worker processes are forked, and this platform cannot fork (Windows); use --jobs 1"
    )


def default_jobs() -> int:
    """Worker processes a sweep uses by default: one per core this process may run on, where they
    can be forked from it (:func:`_context`); else 1."""
    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class Simulator:
    """How a sweep simulates one stage: from short runs (``fast``, :func:`estimate_fast`, with
    ``check``) or at every layer, through ``sims``; :meth:`prefetch` queues what a call will run."""

    sims: Simulations
    fast: bool = True
    check: bool = False

    def __call__(self, config: PretrainedConfig, spec: EstimateSpec, model_name: str | None = None) -> Estimate:
        if self.fast:
            return estimate_fast(config, spec, model_name, self.sims, self.check)
        return self.sims.get(config, spec, model_name)[0]

    def prefetch(self, config: PretrainedConfig, spec: EstimateSpec, model_name: str | None = None) -> None:
        found, name = layering(config) if self.fast else None, model_label(config, model_name)
        if found is None or found.periods <= (CHECK if self.check else PERIODS[1]):
            self.sims.submit(config, spec, name)
            return
        for n in PERIODS + ((CHECK,) if self.check and found.periods > CHECK else ()):
            self.sims.submit(cut_config(config, found.layers(n)), spec, name)


def estimate_fast(
    config: PretrainedConfig,
    spec: EstimateSpec,
    model_name: str | None = None,
    sims: Simulations | None = None,
    check: bool = False,
) -> Estimate:
    """One rank's estimate of ``config`` laid out as ``spec``, from the model cut to :data:`PERIODS`
    periods of its layers and extended to its depth (see the module docstring); simulated in full
    where that does not apply. With ``check`` the extension is also simulated one period further
    (:data:`CHECK`) and must match that run in every figure; where it does not, the model is
    simulated in full. ``sims`` runs and keeps the simulations (in parallel where it has workers)."""
    sims = sims or Simulations()
    found = layering(config)
    name = model_label(config, model_name)
    if found is None or found.periods <= PERIODS[1] or (check and found.periods <= CHECK):
        return sims.get(config, spec, name)[0]
    periods = PERIODS + ((CHECK,) if check else ())
    configs = [cut_config(config, found.layers(n)) for n in periods]
    for cut in configs:
        sims.submit(cut, spec, name)
    (lo, lo_segments), (hi, hi_segments), *third = (sims.get(cut, spec, name) for cut in configs)
    layers = tuple(found.layers(n) for n in PERIODS)
    fast = _extended(found, lo, lo_segments, hi, hi_segments, found.periods - PERIODS[0], layers)
    if fast is None:
        return sims.get(config, spec, name)[0]
    if not third:
        return fast
    at = third[0][0]
    if same_figures(_extended(found, lo, lo_segments, hi, hi_segments, CHECK - PERIODS[0], layers), at):
        return dataclasses.replace(fast, extended_from=(*layers, found.layers(CHECK)))
    return sims.get(config, spec, name)[0]


def _extended(
    found: Layering, lo: Estimate, lo_segments, hi: Estimate, hi_segments, steps: int, layers
) -> Estimate | None:
    """``lo`` (``hi`` one period past it) extended ``steps`` periods; None where the peak cannot be."""
    peak = extended_peak(found, lo_segments, hi_segments, steps)
    if peak is None:
        return None
    return dataclasses.replace(extend(lo, hi, steps), peak=peak, extended_from=layers)


def same_figures(a: Estimate | None, b: Estimate) -> bool:
    """Whether two estimates agree in every figure a sweep reads (the peak to the byte, the state,
    every collective, the work, the MoE figures, the parameter counts)."""
    if a is None:
        return False
    key = lambda c: (c.dim, c.collective, c.group_size)  # noqa: E731
    return (
        a.peak.total == b.peak.total
        and a.state == b.state
        and sorted(a.comms, key=key) == sorted(b.comms, key=key)
        and (a.work, a.moe, a.num_params, a.trainable_params) == (b.work, b.moe, b.num_params, b.trainable_params)
    )


def grouped(found: Layering, periods: int, segments: dict[SegmentKey, MemoryBreakdown]) -> dict[tuple, MemoryBreakdown]:
    """``segments`` of a run of ``periods`` periods, grouped by where their layer sits: the largest of each group."""
    out: dict[tuple, MemoryBreakdown] = {}
    for (event, backward, index), held in segments.items():
        key = (event, backward, found.position(index, periods) if index >= 0 else None)
        if key not in out or out[key].total < held.total:
            out[key] = held
    return out


def extended_peak(
    found: Layering, lo: dict[SegmentKey, MemoryBreakdown], hi: dict[SegmentKey, MemoryBreakdown], steps: int
) -> MemoryBreakdown | None:
    """The largest group of segments extended ``steps`` periods past ``lo`` (``hi`` one period past
    it); None when the two runs' groups differ or no decoder layer was seen."""
    low, high = grouped(found, PERIODS[0], lo), grouped(found, PERIODS[1], hi)
    if set(low) != set(high) or not any(key[2] for key in low):  # (no layer seen: torch's hooks moved)
        return None
    return max((_line(low[k], high[k], steps) for k in low), key=lambda b: b.total)


def extend(lo: Estimate, hi: Estimate, steps: int) -> Estimate:
    """The estimate ``steps`` periods past ``lo``, ``hi`` being one period past it (all but the peak)."""
    key = lambda c: (c.dim, c.collective, c.group_size)  # noqa: E731
    low, high = {key(c): c for c in lo.comms}, {key(c): c for c in hi.comms}
    zero = {k: CommStat(*k, 0, 0, 0) for k in {**low, **high}}
    comms = [_line(low.get(k, zero[k]), high.get(k, zero[k]), steps) for k in sorted(zero)]
    return dataclasses.replace(
        _line(lo, hi, steps, {"peak", "comms", "moe", "work", "seconds"}),
        comms=comms,
        moe=None if hi.moe is None else _line(lo.moe, hi.moe, steps, _PER_LAYER_MOE),
        work=None if hi.work is None else _line(lo.work, hi.work, steps),
        seconds=lo.seconds + hi.seconds,
    )


def _line(lo, hi, steps: int, keep: frozenset[str] | set[str] = frozenset()):
    """The dataclass ``lo + steps * (hi - lo)`` field by field: numbers, dicts of numbers and nested
    dataclasses; other fields and those in ``keep`` are ``hi``'s."""
    changes = {}
    for f in dataclasses.fields(lo):
        a, b = getattr(lo, f.name), getattr(hi, f.name)
        if f.name in keep:
            continue
        if dataclasses.is_dataclass(a):
            changes[f.name] = _line(a, b, steps)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            changes[f.name] = a + steps * (b - a)
        elif isinstance(a, dict):
            changes[f.name] = {k: a.get(k, 0) + steps * (b.get(k, 0) - a.get(k, 0)) for k in {**a, **b}}
    return dataclasses.replace(hi, **changes)
