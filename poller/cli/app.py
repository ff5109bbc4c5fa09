"""The ``poller`` command group, with every command registered explicitly.

The lab's commands (``demo``, ``sim``, ``bench``, ``soak``) belong to another
distribution (lab/): they join through the ``llmgw_poller.commands`` entry points, and
where the lab is not installed each of them says how to get it.

Exit status: 0 success, 1 the job failed (a scrape, a contract, Redis), 2 bad usage
(one ``Error:`` line per problem on stderr, see ``oneline.py``).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import click

from poller._version import __version__
from poller.cli.check import check
from poller.cli.drain import drain
from poller.cli.endpoints import endpoints
from poller.cli.epp import epp
from poller.cli.oneline import BadInput, PollerGroup
from poller.cli.run import run
from poller.cli.status import status

__all__ = ["COMMANDS_GROUP", "LAB_COMMANDS", "cli"]

#: The entry-point group through which other distributions add commands to ``poller``.
COMMANDS_GROUP = "llmgw_poller.commands"
#: The lab's commands, named even where the lab is missing so that they can say so.
LAB_COMMANDS = {
    "demo": "Three pollers share simulated engines; one is killed and restarted.",
    "sim": "Serve simulated engines.",
    "bench": "Measure the poller, the readers and the routing.",
    "soak": "Run pollers for a while under faults and check what they wrote.",
}
LAB_HINT = "from a checkout, `make demo` or `pip install -e ./lab`"


@click.group(
    cls=PollerGroup,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.version_option(__version__, prog_name="poller")
def cli() -> None:
    """llmgw-poller: scrape LLM engines once, share their load through Redis."""


def _missing_lab(name: str, summary: str, why: str = "which is not installed") -> click.Command:
    def callback() -> None:
        raise BadInput(f"poller {name} is part of the lab, {why}: {LAB_HINT}")

    return click.Command(
        name,
        callback=callback,
        help=f"{summary} (needs the lab: {LAB_HINT})",
        short_help=f"{summary.rstrip('.')} (needs the lab).",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


def _add_commands(group: click.Group) -> None:
    for command in (run, endpoints, status, drain, check, epp):
        group.add_command(command)
    for point in entry_points(group=COMMANDS_GROUP):
        try:
            command = point.load()
        except Exception as exc:  # a broken plug-in must not take the poller's own commands down
            why = f"which did not load ({type(exc).__name__}: {exc})"
            command = _missing_lab(point.name, LAB_COMMANDS.get(point.name, point.name), why)
        group.add_command(command, point.name)
    for name, summary in LAB_COMMANDS.items():
        if name not in group.commands:
            group.add_command(_missing_lab(name, summary))


_add_commands(cli)
