"""The pipeline settings torch's schedules can run, checked from the numbers alone (no torch import:
the training config checks them on every rank before launch)."""

from __future__ import annotations

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved1f1b", "loopedbfs", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, rank r holding stages r and 2 pp - 1 - r
MULTI_STAGE = ("interleaved1f1b", "loopedbfs", *V_SHAPED)  # schedules that run several stages per rank


def check_pipeline(pp: int, schedule: str, microbatches: int, virtual: int, layers: int | None = None) -> None:
    """One line for a pipeline setting torch's schedules cannot run (the settings alone: every
    rank raises the same before any collective)."""
    if pp < 1:
        raise ValueError(f"--pp must be a positive integer, got {pp}")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"--pp-schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
    if virtual < 1:
        raise ValueError(f"--pp-virtual-stages must be a positive integer, got {virtual}")
    if schedule in V_SHAPED and virtual != 2:
        raise ValueError(
            f"--pp-schedule {schedule} places exactly 2 stages per rank (V-shaped): set --pp-virtual-stages 2"
        )
    if schedule in MULTI_STAGE and virtual < 2:
        raise ValueError(f"--pp-schedule {schedule} runs several stages per rank: set --pp-virtual-stages 2 or more")
    if schedule not in MULTI_STAGE and virtual > 1:
        raise ValueError(
            f"--pp-virtual-stages {virtual} needs --pp-schedule {', '.join(MULTI_STAGE)} ({schedule} runs one stage per rank)"
        )
    if microbatches < 1:
        raise ValueError(f"--microbatches must be a positive integer, got {microbatches}")
    if schedule in ("1f1b", "interleaved1f1b") and pp > 1 and microbatches < pp:
        raise ValueError(
            f"--pp-schedule {schedule} needs at least as many micro-batches as stages' ranks: --microbatches {microbatches} < --pp {pp}"
        )
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(
            f"--pp-schedule dualpipev needs at least as many micro-batches as stages: --microbatches {microbatches} < {2 * pp}"
        )
    if layers is not None and layers < pp * virtual:
        raise ValueError(_too_many_stages(pp, schedule, virtual, layers))


def _too_many_stages(pp: int, schedule: str, virtual: int, layers: int) -> str:
    """The line for more pipeline stages than decoder layers, with the largest ``--pp`` that fits."""
    if virtual == 1:
        stages = f"--pp {pp}: {pp} stages"
    elif schedule in V_SHAPED:
        stages = f"--pp-schedule {schedule} places 2 stages per rank: --pp {pp} x 2 = {pp * virtual} stages"
    else:
        stages = f"--pp {pp} x --pp-virtual-stages {virtual} = {pp * virtual} stages"
    most = layers // virtual
    fix = f"use --pp {most} or less" if most >= 2 else "use fewer virtual stages, or train with --pp 1"
    if schedule in V_SHAPED and most < 2:
        fix = "use --pp-schedule 1f1b or gpipe, or train with --pp 1"
    return f"{stages} but the model has {layers} decoder layers: at most one stage per layer; {fix}"


def check_tied_schedule(tied: bool, schedule: str) -> None:
    """A weight tied across the first and the last stage (``lm_head`` and the embedding) under a
    V-shaped schedule, which runs both stages on one rank: refused (the two copies are not kept in
    step there yet)."""
    if tied and schedule in V_SHAPED:
        raise ValueError(
            f"--pp-schedule {schedule} runs the first and the last stage on one rank, where a tied lm_head's two "
            "copies are not kept in step yet: use --pp-schedule 1f1b, gpipe, interleaved1f1b or loopedbfs"
        )
