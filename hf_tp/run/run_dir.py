"""A run's output directory: what counts as a run, what may be written where, and the run's record.

Nothing a user saved is lost or half-written here:
- the directory is checked before launch (a path, creatable, writable), and a directory that holds
  another run is refused unless ``--resume`` (continue it) or ``--overwrite`` (start a new run:
  the earlier one is moved to ``OUTPUT_DIR/replaced/<time>/``, never deleted, so a later
  ``--resume`` or ``hf-tp export`` cannot pick up its checkpoints by mistake);
- the record (``config.yaml``, ``history.jsonl``) is written once the run is accepted, by rank 0
  after the model, the data and a resumed checkpoint have loaded: a refused ``--resume`` or a
  failed start leaves the directory as it was.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from hf_tp.paths import unwritable_reason
from hf_tp.run.config import TrainConfig

# What hf-tp train writes into OUTPUT_DIR (wandb's offline folder included); a run is a metrics
# record or a checkpoint (holds_run). Everything else in the directory is the user's and is never moved.
RUN_MARKS = ("metrics.jsonl", "config.yaml", "checkpoints")
RUN_ENTRIES = (*RUN_MARKS, "history.jsonl", "metrics.superseded.jsonl", "tensorboard", "export", "profile", "wandb")
REPLACED = "replaced"
HISTORY = "history.jsonl"


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a run of hf-tp train: a step's metrics record or a checkpoint (a run
    that failed before its first step, leaving only its config and an empty metrics file, is not
    one: its rerun may write there)."""
    checkpoints = out / "checkpoints"
    return _has_record(out / "metrics.jsonl") or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def _has_record(metrics: Path) -> bool:
    try:
        with open(metrics) as f:
            return any(line.strip() for line in f)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable: count it, rather than write over it


def check_output_dir(out: Path, cfg: TrainConfig) -> None:
    """The output directory can be made and written, and starting here loses no other run."""
    if not str(cfg.output_dir or "").strip():  # Path("") is the current directory
        raise ValueError(
            f"--output-dir is empty ({cfg.output_dir!r}); pass a folder path, e.g. --output-dir outputs/run "
            "(--output-dir . for the current directory)"
        )
    check_writable_dir(out, "--output-dir")
    if cfg.resume and cfg.overwrite:
        raise ValueError(
            "pass --resume (continue the run in --output-dir) or --overwrite (start a new run there; the earlier "
            f"one is moved to {out / REPLACED}/), not both"
        )
    if cfg.export_on_finish and not cfg.overwrite:  # with --overwrite the earlier export moves aside
        from hf_tp.checkpoint.hf_folder import check_replaceable

        try:
            check_replaceable(out / "export", overwrite=True)
        except ValueError as exc:
            raise ValueError(f"--export-on-finish writes {out / 'export'}: {exc}") from None
    if holds_run(out) and not (cfg.overwrite or cfg.resume):
        found = ", ".join(name for name in RUN_MARKS if (out / name).exists())
        raise ValueError(
            f"output dir {out} already holds a run ({found}); pass --resume to continue it, another --output-dir, "
            f"or --overwrite (the earlier run is moved to {out / REPLACED}/, not deleted)"
        )


def check_writable_dir(path: Path, what: str) -> None:
    """``path`` is a directory that exists or can be created, and files can be made in it."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory; pass a directory path")
    if (reason := unwritable_reason(path)) is not None:
        raise ValueError(f"{what} {path} cannot be created or written: {reason}; pass a directory you can write")


def replace_earlier_run(out: Path) -> Path | None:
    """``--overwrite``: move the earlier run's entries (never the user's other files) to
    ``OUTPUT_DIR/replaced/<UTC time>/``; returns that folder, None when there was no run."""
    present = [name for name in RUN_ENTRIES if (out / name).exists()]
    if not holds_run(out) or not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = out / REPLACED / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out / REPLACED / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in present:
        os.replace(out / name, dest / name)  # a rename within one directory tree: nothing copied
    return dest


def describe(folder: Path) -> str:
    """ "metrics, config, 2 checkpoints" of a moved run, for the line that says where it went."""
    parts = []
    if (folder / "metrics.jsonl").exists():
        parts.append("metrics")
    if (folder / "config.yaml").exists():
        parts.append("config")
    ckpts = [p for p in (folder / "checkpoints").glob("step-*")] if (folder / "checkpoints").is_dir() else []
    if ckpts:
        parts.append(f"{len(ckpts)} checkpoint{'s' if len(ckpts) > 1 else ''}")
    return ", ".join(parts) or "its files"


def write_run_record(out: Path, cfg: TrainConfig, start_step: int, resumed_from: Path | None) -> None:
    """Rank 0, once the run is accepted: ``config.yaml`` (this start's settings, atomically) and
    one line appended to ``history.jsonl`` per start (time, step, checkpoint, layout, settings),
    so a resumed run adds to the record instead of replacing it."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, out / "config.yaml")
    entry = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "start_step": start_step,
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
        "layout": {
            "tp": cfg.tp,
            "cp": cfg.cp,
            "dp": cfg.dp,
            "ep": cfg.ep,
            "dp_replicate": cfg.dp_replicate,
            "pp": cfg.pp,
            "nnodes": cfg.nnodes,
        },
        "config": cfg.to_dict(),
    }
    with open(out / HISTORY, "a") as f:
        f.write(json.dumps(entry) + "\n")


def supersede_metrics(path: Path, keep_steps: int) -> int:
    """A resumed run: the records after the checkpoint's step (written by the attempt that stopped
    after it, and about to be written again) move from ``metrics.jsonl`` to
    ``metrics.superseded.jsonl``, so the curve has one record per step and nothing is deleted.
    Returns how many moved."""
    if not path.exists():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    keep, moved = [], []
    for ln in lines:
        try:
            step = json.loads(ln)["step"]
        except (ValueError, KeyError, TypeError):
            step = None  # a torn last line of a killed run: not a record of any step
        (keep if step is not None and step <= keep_steps else moved).append(ln)
    if not moved:
        return 0
    with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
        f.write("".join(ln + "\n" for ln in moved))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)
    return len(moved)
