"""A stand-in service for tests/test_zygote.py: ``python -m tests.zygote_probe <what> <file>``.

``block FILE``: create FILE, then sleep (until a signal ends it; no handlers of its own).
``draw FILE``: write a draw of numpy's legacy global RNG into FILE.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":
    what, path = sys.argv[1], Path(sys.argv[2])
    if what == "block":
        path.touch()
        time.sleep(600)
    elif what == "draw":
        import numpy as np

        path.write_text(repr(np.random.random()))
    raise SystemExit(0)
