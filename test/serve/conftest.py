"""The serving tests reuse the tiny checkpoint builders of ``test/models``."""

import sys
from pathlib import Path

MODELS = str(Path(__file__).resolve().parents[1] / "models")
if MODELS not in sys.path:
    sys.path.insert(0, MODELS)
