"""``python -m hf_tp.train`` / ``accelerate launch -m hf_tp.train``: the same as ``hf-tp train``.

A rank process leaves with ``os._exit`` (see :func:`hf_tp.shutdown`): gloo's worker threads can
outlive ``destroy_process_group`` and abort the interpreter's finalization after a successful run.
"""

import os
import sys

from hf_tp.cli.train import main
from hf_tp.run.errors import run_reporting_crashes

code = run_reporting_crashes(main)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
