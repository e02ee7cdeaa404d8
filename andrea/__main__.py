"""Entry point: `python -m andrea`."""

import sys

from andrea.cli import main

sys.exit(main())
