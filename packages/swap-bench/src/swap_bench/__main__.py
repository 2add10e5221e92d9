"""``python -m swap_bench``."""

from .cli import main

raise SystemExit(main())
