"""Regenerate tests/plans/<model_type>.txt, the ``hf-tp plan`` snapshots at tp=2 of every supported
family (tests/unit/test_plan_snapshots.py compares them): ``python scripts/update_plan_snapshots.py``
for all, or name model types. Read ``git diff tests/plans`` before committing: each change is a
derived plan that changed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.unit.test_plan_snapshots import write_snapshots  # noqa: E402


def main(argv: list[str]) -> int:
    changed = write_snapshots(argv or None)
    print("\n".join(changed) if changed else "every snapshot is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
