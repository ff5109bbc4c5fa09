"""The ``poller`` command group, with every command registered explicitly.

Exit status: 0 success, 1 the job failed (a scrape, a contract, Redis), 2 bad usage
(one ``Error:`` line per problem on stderr, see ``oneline.py``).
"""

from __future__ import annotations

import click

from poller._version import __version__
from poller.cli.check import check
from poller.cli.drain import drain
from poller.cli.endpoints import endpoints
from poller.cli.lab import bench, demo, sim, soak
from poller.cli.oneline import PollerGroup
from poller.cli.run import run
from poller.cli.status import status

__all__ = ["cli"]


@click.group(
    cls=PollerGroup,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.version_option(__version__, prog_name="poller")
def cli() -> None:
    """llmgw-poller: scrape LLM engines once, share their load through Redis."""


for command in (run, endpoints, status, drain, check, demo, sim, bench, soak):
    cli.add_command(command)
