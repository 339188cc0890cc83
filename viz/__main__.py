"""``python -m viz PATH ...``: see ``viz.cli``."""
from sparsebalance.viz.cli import main

raise SystemExit(main())
