"""Every mistake on the command line is one line on stderr and exit status 2.

click prints a usage block, a blank line and the error; an operator scanning a log (or a
unit's journal) wants the error alone, naming what to fix. ``PollerGroup`` turns click's
usage errors into ``BadInput``, which prints each of its lines as ``Error: ...``.
"""

from __future__ import annotations

from typing import Any

import click

__all__ = ["BadInput", "PollerGroup"]


class BadInput(click.ClickException):
    """Bad arguments, settings or files: one ``Error:`` line per problem, exit 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        for line in self.format_message().splitlines() or [""]:
            click.echo(f"Error: {line}", err=True)


def _one_line(exc: click.UsageError) -> BadInput:
    message = exc.format_message().replace("\n", " ")
    where = exc.ctx.command_path if exc.ctx is not None else "poller"
    return BadInput(f"{message} (see '{where} --help')")


class PollerGroup(click.Group):
    """A group whose commands' (and sub-groups') usage errors are ``BadInput``."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise  # `poller endpoints` alone: the help is the answer
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _one_line(exc) from None
