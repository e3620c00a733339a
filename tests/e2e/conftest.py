"""End-to-end client tests: the clients under clients/ against the real server.

The Python client is imported from its source tree (clients/python/src), so the tests
exercise what `pip install clients/python` ships without installing it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python" / "src"))
