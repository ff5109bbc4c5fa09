"""Scrape runs that wrote nothing: counted by reason, and said once per pass, not per run.

Every such run counts in ``poller_scrapes_missed_total{why}``. Two reasons come from
APScheduler, which logs a WARNING per job and run for each: ``still_running`` (the run
was due while the job's previous run still went on: ``max_instances=1`` skipped it) and
``misfire`` (it started over its grace time late). While Redis hangs every job's write
hangs, so every job skips every run: about one line per endpoint per second. Those two
lines of APScheduler's are dropped here; the worker says each reason once per pass
instead, with how many runs of how many endpoints (``say``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from poller.service.metrics import PollerMetrics
from poller.util.logs import Tally

__all__ = ["MissedRuns"]

log = logging.getLogger(__name__)

# The two per-run lines (APScheduler 3.x: schedulers/base.py and executors/base.py), as
# logged (the format string) or as another filter may have left them (formatted: LiteLLM
# redacts every record in place, in a process that imports it).
_APSCHEDULER_LINES = re.compile(
    r'(?:Execution of job ".*" skipped: maximum number of running instances reached'
    r'|Run time of job ".*" was missed by)',
    re.DOTALL,
)
_APSCHEDULER_LOGGERS = ("apscheduler.scheduler", "apscheduler.executors.default")


class _PerRunLines(logging.Filter):
    """Drops APScheduler's per-run lines that ``MissedRuns`` says per pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg
        return not (isinstance(message, str) and _APSCHEDULER_LINES.match(message))


def quiet_apscheduler() -> None:
    """Install the filter on the loggers APScheduler writes those lines with (a filter
    on a logger sees only its own records); once per process."""
    for name in _APSCHEDULER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _PerRunLines) for f in logger.filters):
            logger.addFilter(_PerRunLines())


class MissedRuns:
    """``count(why)`` for every run that wrote nothing; ``skipped``/``late`` for
    APScheduler's, said by ``say()``."""

    def __init__(self, metrics: PollerMetrics) -> None:
        self._metrics = metrics
        self._children: dict[str, Any] = {}  # label child resolved once, not per run
        self._still_running = Tally(
            log,
            logging.WARNING,
            "scrape runs skipped, the previous run still going (Redis or the engine "
            "slow to answer): %(events)s of %(endpoints)s",
            event="run",
        )
        self._late = Tally(
            log,
            logging.WARNING,
            "scrape runs missed, due over a grace time ago (a starved event loop): "
            "%(events)s of %(endpoints)s",
            event="run",
        )

    def count(self, why: str) -> None:
        child = self._children.get(why)
        if child is None:
            child = self._children[why] = self._metrics.missed.labels(why)
        child.inc()

    def skipped(self, endpoint_id: str) -> None:
        """APScheduler skipped a run: the job's previous run was still going."""
        self.count("still_running")
        self._still_running.add(endpoint_id)

    def late(self, endpoint_id: str) -> None:
        """APScheduler dropped a run due longer than the job's grace time ago."""
        self.count("misfire")
        self._late.add(endpoint_id)

    def say(self) -> None:
        self._still_running.say()
        self._late.say()
