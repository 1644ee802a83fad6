"""``agent_worker.py``, except on a bad host: every worker of an agent started with
``FLAKY_NODE=1`` in its environment exits with code 3 once ``OUT_DIR/go`` exists (at once
after that), so a test decides when the bad host starts failing (tests/test_exclusion.py)."""
from __future__ import annotations

import os
import runpy
import sys
import time

if __name__ == "__main__":
    if os.environ.get("FLAKY_NODE") == "1":
        go = os.path.join(sys.argv[1], "go")
        while not os.path.exists(go):
            time.sleep(0.05)
        sys.exit(3)
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_worker.py"),
                   run_name="__main__")
