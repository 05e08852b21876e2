import sys

from refit_core.tools.bench import main

sys.exit(main())
