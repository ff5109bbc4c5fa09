"""``python -m poller.lab.sim``: see ``poller.lab.sim.cli``."""

from __future__ import annotations

import sys

from poller.lab.sim.cli import main

sys.exit(main())
