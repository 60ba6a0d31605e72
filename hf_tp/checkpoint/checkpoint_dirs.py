"""Where checkpoints live and which count (plain paths and json, no torch: ``hf-tp export``'s
messages about a path need nothing more)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Published checkpoints (with their marker), oldest first; temp and half-written dirs are skipped."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def unfinished_checkpoints(output_dir: str | Path, after: int = -1) -> list[Path]:
    """``step-N`` folders without their marker (a save that did not finish, or a copy cut short),
    N > ``after``, oldest first: never resumed or exported, and named where an older one is used."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for step, p in sorted(found) if step > after and not (p / MARKER).is_file()]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = complete_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def load_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())
