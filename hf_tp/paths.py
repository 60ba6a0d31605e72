"""Whether a folder can be made somewhere: asked of the filesystem by trying, shared by the
commands that write one (``hf-tp train``'s output dir, ``hf-tp export``'s target)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable_reason(path: Path) -> str | None:
    """Why folders cannot be made at ``path`` (as ``mkdir -p`` would), or None when they can.

    A probe folder is made in the nearest existing ancestor and removed: ``os.access`` says yes
    to root under /proc and /sys and on read-only mounts, so only trying tells."""
    probe_in = Path(path)
    while not probe_in.exists():
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        return f"{probe_in} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hf_tp-probe-", dir=probe_in))
    except OSError as exc:
        return f"{probe_in} does not take new folders ({exc.strerror or exc})"
    return None
