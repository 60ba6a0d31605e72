"""``python -m hf_tp.verify --config FILE``: what each launched rank of ``hf-tp verify`` runs."""

from __future__ import annotations

import sys

from hf_tp.cli.verify import rank_entry

if __name__ == "__main__":
    sys.exit(rank_entry(sys.argv[1:]))
