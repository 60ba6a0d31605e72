"""A rank that imports nothing heavy: writes its pid to ``OUT/pid-RANK``, then waits to be ended
(tests/unit/test_launch.py: ``python -m tests.unit.idle_rank OUT``)."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(120)
