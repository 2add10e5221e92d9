"""The recipes under test live in examples/integrations/, imported by module name as a user's code imports them."""

from __future__ import annotations

import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "integrations"
sys.path.insert(0, str(RECIPES))
