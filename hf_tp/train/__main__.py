"""``python -m hf_tp.train`` / ``accelerate launch -m hf_tp.train``: the same as ``hf-tp train``."""

import sys

from hf_tp.cli.train import main
from hf_tp.train.errors import run_reporting_crashes

sys.exit(run_reporting_crashes(main))
