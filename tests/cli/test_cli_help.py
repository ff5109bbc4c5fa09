"""Every option of every command says what it does, its default and its variable."""

from __future__ import annotations

from collections.abc import Iterator

import click
from click.testing import CliRunner

from poller.cli import cli

#: Options with no default to show: each names something only the operator can give.
NO_DEFAULT = {
    "--config",
    "--api-key-env",
    "--api-key-file",
    "--tls-ca-file",
    "--redis-tls-cert",
    "--redis-tls-key",
    "--output",
    "--duration",  # demo: runs until Ctrl-C
    "--label",
    "--version",
}


def commands(
    group: click.Group, path: tuple[str, ...] = ("poller",)
) -> Iterator[tuple[str, click.Command, click.Context]]:
    root = click.Context(group, info_name="poller", show_default=True)
    pending: list[tuple[tuple[str, ...], click.Command, click.Context]] = [(path, group, root)]
    while pending:
        names, command, ctx = pending.pop()
        yield " ".join(names), command, ctx
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                pending.append(
                    ((*names, name), sub, click.Context(sub, info_name=name, parent=ctx))
                )


def test_every_option_has_help_its_default_and_its_variable() -> None:
    problems = []
    seen = 0
    for where, command, ctx in commands(cli):  # type: ignore[arg-type]
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            seen += 1
            record = param.get_help_record(ctx)
            text = record[1] if record else ""
            name = f"{where} {param.opts[-1]}"
            if not param.help:
                problems.append(f"{name}: no help text")
            if param.envvar and f"env var: {param.envvar}" not in text:
                problems.append(f"{name}: its variable {param.envvar} is not shown")
            if not param.is_flag and "default:" not in text and param.opts[-1] not in NO_DEFAULT:
                problems.append(f"{name}: no default shown")
    assert seen > 60
    assert not problems, "\n".join(problems)


def test_run_help_shows_the_defaults_an_operator_asked_about() -> None:
    text = " ".join(CliRunner().invoke(cli, ["run", "--help"], terminal_width=400).output.split())
    for words in (
        "[env var: POLLER_REDIS_URL; default: (redis://127.0.0.1:6379/0)]",
        "[env var: POLLER_INTERVAL; default: (2)]",
        "[env var: POLLER_HEALTH_PORT; default: (9464, on 0.0.0.0)]",
        "--log-format [text|json] text: key=value lines",
        "--log-level [debug|info|warning|error] Least severe level logged",
    ):
        assert words in text, words


def test_every_option_variable_is_a_known_name() -> None:
    """`load_settings` without the command line (``poller check --config``) refuses unknown
    ``POLLER_*`` names: every option's variable must be known to it."""
    from poller.config import FLAT_ENV, Settings
    from poller.util.messages import locate_unknown

    for where, command, _ in commands(cli):  # type: ignore[arg-type]
        for param in command.params:
            name = getattr(param, "envvar", None)
            if not name:
                continue
            path = name.removeprefix("POLLER_").lower().split("__")
            known = name in FLAT_ENV or ("__" in name and locate_unknown(Settings, path) is None)
            assert known, (
                f"{where} {param.opts[-1]}: {name} is not in poller/config/load.py FLAT_ENV"
            )
