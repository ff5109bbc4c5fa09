"""``python -m poller.sim``: see ``poller.sim.cli``."""

from __future__ import annotations

import sys

from poller.sim.cli import main

sys.exit(main())
