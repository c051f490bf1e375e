"""The verl tests' environment: verl's own code (`make test-verl` builds .venv-verl with verl 0.9.1 and its pins) on
this machine's CPU, through the CPU platform registered with verl's extension point (cpu_platform.py)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cpu_platform  # noqa: E402,F401  (before verl resolves its platform)
