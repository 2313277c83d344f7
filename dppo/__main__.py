"""`python -m dppo train ...`: the same as the `dppo` console script."""

import sys

from dppo.cli import main

sys.exit(main())
