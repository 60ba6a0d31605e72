"""``python -m hf_tp.train`` / ``accelerate launch -m hf_tp.train``: the same as ``hf-tp train``."""

import sys

from hf_tp.cli.train import main

sys.exit(main())
