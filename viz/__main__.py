"""``python -m viz PATH ...``: see ``viz.cli``."""
from viz.cli import main

raise SystemExit(main())
