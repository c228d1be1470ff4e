"""The tensor-parallel tests reuse the tiny checkpoint builders of ``test/models``; their
collectives time out after two minutes instead of a day, so a broken rank fails a test
instead of hanging it."""

import os
import sys
from pathlib import Path

MODELS = str(Path(__file__).resolve().parents[1] / "models")
if MODELS not in sys.path:
    sys.path.insert(0, MODELS)

os.environ.setdefault("UNIMEM_TP_TIMEOUT_S", "120")
