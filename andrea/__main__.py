"""Entry point: `python -m andrea`."""

import sys

from andrea.control.run import early_signals

early_signals.install()  # before the heavy imports: a SIGTERM in the first second is still a clean stop

from andrea.cli import main  # noqa: E402

sys.exit(main())
