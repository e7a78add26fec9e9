"""Make the launch's modules importable here and, through the workers' copy of sys.path, in the workers; and
the S3 test server of the core's tests."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parents[1] / "core" / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
