"""``poller endpoints export``: the registry as a file ``endpoints sync`` reads back.

Hand-written entries only by default: discovery entries (those with ``source``) belong
to their DNS source, which rewrites them, and ``sync`` leaves them alone anyway. So
``export > f; sync f`` changes nothing, and ``sync f`` on an empty registry rebuilds it.
It only reads (a read-only ACL user may run it), and says on stderr which Redis and
namespace it read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from poller.cli.common import (
    NAMESPACE,
    REDIS_URL,
    load,
    redis_line,
    run_store_command,
    store_session,
)
from poller.cli.oneline import BadInput
from poller.schema.endpoint import Endpoint

__all__ = ["endpoints_export", "export_document"]


def export_document(entries: list[Endpoint]) -> dict[str, Any]:
    """``{"endpoints": [{id, url, ...}, ...]}``, sorted by id, defaults left out."""
    rows = [
        {"id": e.id, **e.model_dump(mode="json", exclude={"id"}, exclude_defaults=True)}
        for e in sorted(entries, key=lambda e: e.id)
    ]
    return {"endpoints": rows}


def _format_of(output: str | None, chosen: str | None) -> str:
    """The format to write: ``chosen``, else the file's suffix's. ``sync`` reads a file
    by its suffix (.json: JSON, .toml: TOML, else YAML, which reads JSON too), so YAML
    into a .json file is refused: it could not be read back."""
    suffix = Path(output).suffix.lower() if output else ""
    if suffix == ".toml":
        raise BadInput(
            f"{output}: export writes YAML or JSON (sync reads both); use .yaml or .json"
        )
    by_suffix = "json" if suffix == ".json" else "yaml"
    if chosen == "yaml" and by_suffix == "json":
        raise BadInput(
            f"{output}: --format yaml into a file `sync` reads as JSON (by its suffix); "
            "name it .yaml or leave --format out"
        )
    return chosen or by_suffix


@click.command("export")
@click.option(
    "-o",
    "--output",
    metavar="FILE",
    type=click.Path(dir_okay=False, writable=True),
    help="Write to FILE instead of stdout (.json: JSON, else YAML).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["yaml", "json"]),
    show_default="yaml, or json for a .json FILE",
    help="Output format.",
)
@click.option(
    "--include-discovered",
    is_flag=True,
    help="Also export the entries DNS discovery wrote (with their source).",
)
@REDIS_URL
@NAMESPACE
def endpoints_export(
    output: str | None,
    fmt: str | None,
    include_discovered: bool,
    redis_url: str | None,
    namespace: str | None,
) -> None:
    """Write the registry as a file `poller endpoints sync` reads back."""
    kind = _format_of(output, fmt)
    settings = load(None, {"redis.url": redis_url, "redis.namespace": namespace})

    async def go() -> Any:
        async with store_session(redis_url, namespace, claim=False) as store:
            return await store.read_registry()

    registry = run_store_command(go())
    entries = [e for e in registry.endpoints.values() if include_discovered or not e.source]
    document = export_document(entries)
    if kind == "json":
        text = json.dumps(document, indent=2) + "\n"
    else:
        import yaml

        head = (
            f"# poller endpoints export (registry rev {registry.rev} of "
            f"{redis_line(settings.redis)}): `poller endpoints sync FILE` reads it back\n"
        )
        text = head + yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    if output:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
    else:
        click.echo(text, nl=False)
    click.echo(
        f"note: {_entries(len(entries))} of registry rev {registry.rev} of "
        f"{redis_line(settings.redis)}",
        err=True,
    )
    skipped = len(registry.endpoints) - len(entries)
    if skipped:
        click.echo(
            f"note: {_entries(skipped, 'discovered ')} left out (--include-discovered)", err=True
        )
    for endpoint_id in sorted(registry.invalid):
        click.echo(f"note: invalid entry {endpoint_id!r} left out: fix or remove it", err=True)


def _entries(n: int, kind: str = "") -> str:
    """``1 entry``, ``3 discovered entries``."""
    return f"{n} {kind}{'entry' if n == 1 else 'entries'}"
