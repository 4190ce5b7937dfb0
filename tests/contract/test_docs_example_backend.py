"""The "Writing a backend" page's worked example passes the public contract suite in our run.

The page shows `docs/examples/dict_backend.py` (the backend) and
`docs/examples/dict_backend_test.py` (the few lines a backend author writes); this module collects
the latter's test class as is.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))
try:
    TestDictBackend = importlib.import_module("dict_backend_test").TestDictBackend
finally:
    sys.path.remove(str(EXAMPLES))

__all__ = ["TestDictBackend"]
