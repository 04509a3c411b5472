"""``python -m tools.sass``: see the package's docstring."""

import sys

from . import main

sys.exit(main())
