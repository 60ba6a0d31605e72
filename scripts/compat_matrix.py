"""docs/compatibility.md's matrix: the columns of scripts/compat_grid.py (one TSV per release) side
by side, a row per family.

    python scripts/compat_matrix.py /tmp/grid-5.17.0.tsv /tmp/grid-5.21.0.tsv /tmp/grid-5.24.0.tsv

Each cell is "parity (N%)" (N: the share of the tiny model's decoder-layer weights tp=2 shards),
"needs 5.x" (refused naming the release that serves it), "refused" (refused on every release: its
reason is listed once below the table) or "absent" (no such model_type in that release).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

NEEDS = re.compile(r"needs transformers >= (\S+?)[ ;]")


def read(path: Path) -> tuple[str, dict[str, tuple[str, str, str]]]:
    """(release, model_type -> (status, sharded %, reason)) of one compat_grid TSV."""
    release, rows = path.stem, {}
    for line in path.read_text().splitlines():
        if line.startswith("# transformers "):
            release = line.split()[2].rstrip(",")
        elif line and not line.startswith("#"):
            family, status, share, reason = (line.split("\t") + ["", "", ""])[:4]
            rows[family] = (status, share, reason)
    return release, rows


def cell(row: tuple[str, str, str] | None) -> str:
    if row is None:
        return "absent"
    status, share, reason = row
    if status == "parity":
        return f"parity ({share}%)"
    if status == "refused" and (m := NEEDS.search(reason)):
        return f"needs {m.group(1)}"
    return status


def main(paths: list[str]) -> None:
    columns = [read(Path(p)) for p in paths]
    families = sorted({f for _, rows in columns for f in rows})
    print("| model_type | " + " | ".join(f"transformers {r}" for r, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    reasons = {}
    for family in families:
        cells = [cell(rows.get(family)) for _, rows in columns]
        print(f"| {family} | " + " | ".join(cells) + " |")
        if all(c in ("refused", "absent") for c in cells):
            reasons[family] = next(rows[family][2] for _, rows in reversed(columns) if family in rows)
        for c, (_, rows) in zip(cells, columns, strict=True):
            if c in ("crash", "error") and family not in reasons:
                reasons[family] = rows[family][2]
    if reasons:
        print("\nRefused on every release (the latest release's reason), and crashes:\n")
        for family, reason in reasons.items():
            print(f"- {family}: {reason}")


if __name__ == "__main__":
    main(sys.argv[1:])
