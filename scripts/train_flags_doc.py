"""Write `hf-tp train`'s flag table into docs/training.md (between its markers), generated from the
parser, which is generated from TrainConfig's fields; tests/unit/test_train_flags.py fails when
the two differ. Run after adding or changing a setting:

    python scripts/train_flags_doc.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_tp.cli.train import build_parser  # noqa: E402
from hf_tp.cli.train_flags import flags_markdown, with_flags  # noqa: E402

DOC = ROOT / "docs" / "training.md"


def main() -> int:
    text = DOC.read_text()
    new = with_flags(text, flags_markdown(build_parser()))
    if new != text:
        DOC.write_text(new)
    print(f"{DOC.relative_to(ROOT)}: {'rewritten' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
