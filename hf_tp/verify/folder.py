"""``hf-tp verify --output-dir``: a folder verify made (it holds :data:`MARKER`), or a new or empty
one; never a run, a model folder or anything else of the user's (verify writes its random model,
a checkpoint and an export there). No torch: checked before launch."""

from __future__ import annotations

from pathlib import Path

MARKER = ".hf_tp_verify"


def check_work_dir(given: str | None) -> None:
    """``--output-dir`` may be written by verify (None: a temporary folder); ``ValueError`` naming
    what is refused."""
    if given is None:
        return
    if not given.strip():
        raise ValueError(
            "--output-dir is empty (''); pass a folder path, or leave --output-dir out for a temporary folder"
        )
    from hf_tp.paths import unwritable_reason

    path = Path(given).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--output-dir {path} is a file, not a directory; pass a new or empty folder")
    if (reason := unwritable_reason(path)) is not None:
        raise ValueError(f"--output-dir {path} cannot be created or written: {reason}; pass a folder you can write")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if entries and MARKER not in entries:
        shown = ", ".join(entries[:4]) + (f", ... ({len(entries)} entries)" if len(entries) > 4 else "")
        raise ValueError(
            f"--output-dir {path} holds files hf-tp verify did not write ({shown}); verify writes a random model, "
            "a checkpoint and an export there: pass a new or empty folder, or leave --output-dir out for a "
            "temporary one"
        )


def claim(path: Path) -> None:
    """Make ``path`` (checked by :func:`check_work_dir`) and leave the marker that lets a later
    verify reuse it."""
    path.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER
    if not marker.exists():
        marker.write_text("a folder of hf-tp verify: its random model, checkpoint and export\n")
