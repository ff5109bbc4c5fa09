"""``python -m poller_lab.sim``: see ``poller_lab.sim.cli``."""

from __future__ import annotations

import sys

from poller_lab.sim.cli import main

sys.exit(main())
