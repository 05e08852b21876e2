"""``python -m refit_core``: the ``refit`` command line."""

from refit_core.tools.cli import main

raise SystemExit(main())
