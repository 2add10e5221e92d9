"""``python -m swap_core.bench``."""

from .cli import main

raise SystemExit(main())
