"""Let the op tests run from a plain checkout, before ``pip install -e .``."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("mtcore") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
