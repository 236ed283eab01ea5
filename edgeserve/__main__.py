"""`python -m edgeserve` runs the command line."""

import sys

from edgeserve.cli import main

sys.exit(main())
