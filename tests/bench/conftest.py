"""bench/ is no installed package: its modules are imported from the checkout."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
