"""Is a published checkpoint whole? A size record written at save, checked before resume or export.

The atomic rename (:mod:`hf_tp.checkpoint.dcp`) keeps a crash from publishing half a save, but a
filesystem can still lose data after the fact (a node crash before write-back, a full disk on a
network filesystem, a file truncated by hand). A save therefore records every file's size in
``manifest.json`` before its ``COMPLETE`` marker; a checkpoint whose files are missing or of
another size, whose DCP metadata does not load, or whose trainer state is not JSON is damaged,
and :func:`newest_good_checkpoint` says so and falls back to the one before. Sizes, not checksums:
hashing every shard would read the whole checkpoint again at each save (terabytes at scale).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from hf_tp.checkpoint.checkpoint_dirs import MARKER, checkpoint_root, complete_checkpoints, unfinished_checkpoints

MANIFEST = "manifest.json"
# What to do when no checkpoint of a run is whole: hf-tp train's advice (hf-tp export passes its own).
TRAIN_ADVICE = "restore one, or start again without --resume in a new --output-dir"


def write_manifest(folder: Path) -> None:
    """Record the size of every file under ``folder`` (call when all of them are written)."""
    sizes = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MARKER, MANIFEST)
    }
    with open(folder / MANIFEST, "w") as f:
        json.dump({"sizes": sizes}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def damage(ckpt: Path) -> str | None:
    """What is wrong with a published checkpoint, or None when it is whole. Checkpoints saved
    before manifests existed are checked for their metadata and trainer state only. A ``.metadata``
    that could run code is no damage to fall back from: :class:`UnsafeCheckpoint` is raised."""
    try:
        sizes = json.loads((ckpt / MANIFEST).read_text())["sizes"] if (ckpt / MANIFEST).exists() else {}
    except (OSError, ValueError, KeyError):
        return f"its {MANIFEST} does not parse"
    for name, size in sizes.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes where the save wrote {size} (truncated or overwritten)"
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "trainer_state.json is missing or not valid JSON"
    from hf_tp.checkpoint.safe_load import UnsafeCheckpoint, read_safe_metadata  # torch: only once needed

    try:
        read_safe_metadata(ckpt / ".metadata")
    except UnsafeCheckpoint:
        raise  # not damage to fall back from: someone put code there
    except Exception as exc:  # noqa: BLE001 - any failure to read it means the checkpoint cannot load
        return f"its DCP metadata (.metadata) does not load ({type(exc).__name__})"
    return None


def newest_good_checkpoint(
    output_dir: str | Path, say: Callable[[str], None] = print, advice: str = TRAIN_ADVICE
) -> Path | None:
    """The newest published checkpoint that is whole; each damaged newer one is named through
    ``say``. None when there is no checkpoint at all; a ``ValueError`` listing what is wrong with
    each when there are some and none is whole, ending with ``advice`` (what the caller accepts)."""
    damaged = []
    for ckpt in reversed(complete_checkpoints(output_dir)):
        problem = damage(ckpt)
        if problem is None:
            for skipped in unfinished_checkpoints(output_dir, after=int(ckpt.name.removeprefix("step-"))):
                say(f"hf-tp: skipped {skipped} (no {MARKER} marker: its save did not finish); using {ckpt.name}")
            if damaged:
                say(f"hf-tp: using {ckpt.name}, the newest checkpoint that is whole")
            return ckpt
        damaged.append(f"{ckpt.name}: {problem}")
        say(f"hf-tp: checkpoint {ckpt} is damaged ({problem}); trying the one before")
    if damaged:
        raise ValueError(f"no checkpoint in {checkpoint_root(output_dir)} is whole ({'; '.join(damaged)}); {advice}")
    return None
