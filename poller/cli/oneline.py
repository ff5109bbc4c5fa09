"""Every mistake on the command line is one line on stderr and exit status 2.

click prints a usage block, a blank line and the error; an operator scanning a log (or a
unit's journal) wants the error alone, naming what to fix. ``PollerGroup`` turns click's
usage errors into ``BadInput``, which prints each of its lines as ``Error: ...``, followed
by the ``POLLER_*`` variables that name nothing: click stops at its first error, and
those would otherwise wait for the next run.
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


def env_names(root: click.Command) -> frozenset[str]:
    """Every variable an option of ``root`` or of its commands reads, and the settings'."""
    from poller.config import FLAT_ENV

    names = set(FLAT_ENV)
    pending = [root]
    while pending:
        command = pending.pop()
        if isinstance(command, click.Group):
            pending += command.commands.values()
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or ())
    return frozenset(names)


def _one_line(exc: click.UsageError, root: click.Command) -> BadInput:
    import os

    from poller.config import Settings
    from poller.config.load import unknown_env

    message = exc.format_message().replace("\n", " ")
    where = exc.ctx.command_path if exc.ctx is not None else "poller"
    unknown = unknown_env(dict(os.environ), Settings, env_names(root))
    return BadInput("\n".join([f"{message} (see '{where} --help')", *unknown]))


class PollerGroup(click.Group):
    """A group whose commands' (and sub-groups') usage errors are ``BadInput``."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise  # `poller endpoints` alone: the help is the answer
        except click.UsageError as exc:
            raise _one_line(exc, self) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _one_line(exc, ctx.find_root().command) from None
