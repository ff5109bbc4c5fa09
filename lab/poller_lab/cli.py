"""The local tools: ``poller demo``, ``sim``, ``bench`` and ``soak`` (see ``poller_lab``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import click

from poller.util.logs import setup_logging

_Cfg = TypeVar("_Cfg")
_Command = TypeVar("_Command", bound=Callable[..., None])


def stopped_by_sigterm(command: _Command) -> _Command:
    """SIGTERM ends the command as Ctrl-C does, so every process it started is stopped on
    the way out (by default SIGTERM ends Python at once and leaves them running)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        old = signal.signal(signal.SIGTERM, interrupt)
        try:
            command(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, old)

    return cast(_Command, run)


def _redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The same URL check as the settings' (one line, exit 2, not a traceback later)."""
    from poller.config import check_redis_url

    if value is None:
        return None
    try:
        return check_redis_url(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@click.option(
    "--redis-url",
    metavar="URL",
    callback=_redis_url,
    show_default="an embedded redis-server, else fakeredis",
    help="Use this Redis.",
)
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(1, 86400),
    metavar="S",
    help="Stop after S seconds (default: run until Ctrl-C).",
)
@click.option(
    "--endpoints",
    type=click.IntRange(3, 200),
    default=12,
    show_default=True,
    help="Simulated endpoints the pollers share.",
)
@click.option(
    "--exit-after-story",
    is_flag=True,
    help="Stop once the kill, takeover, restart and rebalancing have been shown; exit 1 "
    "if --duration ends first (for scripts: a slow machine tells the story later).",
)
def demo(
    redis_url: str | None, duration_s: float | None, endpoints: int, exit_after_story: bool
) -> None:
    """Three pollers share simulated engines; one is killed and restarted. Ctrl-C stops."""
    from poller_lab.demo import run_demo

    setup_logging("WARNING")
    try:
        sys.exit(run_demo(redis_url, duration_s, endpoints, exit_after_story=exit_after_story))
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: demo failed: {exc}", err=True)
        sys.exit(1)


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def sim(ctx: click.Context) -> None:
    """Serve simulated engines (same options as `python -m poller_lab.sim --help`)."""
    from poller_lab.sim import main as sim_main

    sys.exit(sim_main(ctx.args, prog="poller sim"))


@click.command()
@click.option(
    "--endpoints",
    type=click.IntRange(1, 5000),
    show_default="200; --quick: 30",
    help="Simulated endpoints.",
)
@click.option(
    "--pollers",
    type=click.IntRange(1, 16),
    show_default="3",
    help="Pollers in the cluster section.",
)
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(0.1, 60),
    show_default="1",
    help="Scrape interval in seconds.",
)
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(1, 600),
    show_default="20; --quick: 4",
    help="Measurement window per section, seconds.",
)
@click.option(
    "--section",
    "sections",
    multiple=True,
    type=click.Choice(
        [
            "scrape",
            "cluster",
            "failover",
            "reader",
            "readers",
            "routing",
            "prefix",
            "peers",
            "sharing",
            "epp",
        ]
    ),
    show_default="scrape, cluster, failover, reader",
    help="Run only these sections (repeatable); readers, routing, prefix, peers, sharing and "
    "epp run only when named.",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    show_default="every registered one",
    help="routing, prefix: only these policies (repeatable).",
)
@click.option(
    "--gateways",
    "gateways",
    multiple=True,
    type=click.IntRange(1, 64),
    show_default="1 and 8 (--quick: 2)",
    help="prefix: only these gateway counts (repeatable); envoy-epp runs as many EPP replicas.",
)
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Choice(["prefix-heavy", "no-prefix"]),
    show_default="both",
    help="prefix: only these workloads (repeatable).",
)
@click.option(
    "--page",
    type=click.Choice(["61k", "200k"]),
    show_default="61k",
    help="vLLM page the engines serve: 61k (one engine) or 200k (dp=4, 8 LoRA).",
)
@click.option(
    "--vs-prometheus",
    is_flag=True,
    help="Also scrape the same endpoints with a local `prometheus` binary.",
)
@click.option("--quick", is_flag=True, help="Small and short (CI): 30 endpoints, 4 s windows.")
@click.option(
    "--full",
    is_flag=True,
    help="routing: the family's full factorial (512 cells) instead of its fractional design.",
)
@click.option(
    "--family-only",
    is_flag=True,
    help="routing: only the family in virtual time (seconds of CPU), not the real processes.",
)
@click.option(
    "--single-fleet",
    is_flag=True,
    help="routing: the one-fleet real-process bench (a sleeping and a failing engine) "
    "instead of the real-process family.",
)
@click.option(
    "--cells",
    metavar="PATTERNS",
    show_default="every cell of the design",
    help="routing, peers: only the real-process cells whose name (fleet:gateways:load) "
    "matches one of these comma-separated shell patterns, e.g. 'six:*,lag:8:0.9'; a "
    "name in full may be outside the design (six:4:0.9).",
)
@click.option(
    "--compare",
    is_flag=True,
    help="routing: also run each real cell's twin in virtual time and print the picker's "
    "ratios to the oracle side by side.",
)
@click.option(
    "--peers-part",
    type=click.Choice(["both", "routing", "prefix"]),
    default="both",
    show_default=True,
    help="peers: the routing family's cells, the prefix workload, or both.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**31 - 1),
    default=1,
    show_default=True,
    help="routing, prefix: the seed of the arrivals, request sizes and workloads.",
)
@click.option(
    "--redis-url",
    metavar="URL",
    callback=_redis_url,
    show_default="an embedded redis-server",
    help="Use this Redis (its namespace is flushed of bench keys).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the results as JSON (progress on stderr)."
)
@stopped_by_sigterm
def bench(
    endpoints: int | None,
    pollers: int | None,
    interval_s: float | None,
    duration_s: float | None,
    sections: tuple[str, ...],
    page: str | None,
    vs_prometheus: bool,
    quick: bool,
    redis_url: str | None,
    as_json: bool,
    policies: tuple[str, ...],
    full: bool,
    family_only: bool,
    single_fleet: bool,
    cells: str | None,
    compare: bool,
    peers_part: str,
    seed: int,
    gateways: tuple[int, ...] = (),
    workloads: tuple[str, ...] = (),
) -> None:
    """Measure scrape cost, cluster behaviour, failover, reader latency and routing locally."""
    # The sections that run only when named, each a bench of its own.
    routing = _RoutingArgs(full, family_only, single_fleet, cells, compare, seed)
    named: dict[str, Callable[[], None]] = {
        "routing": lambda: _bench_routing(quick, duration_s, policies, redis_url, as_json, routing),
        "peers": lambda: _bench_peers(
            quick, duration_s, cells, redis_url, as_json, seed, peers_part
        ),
        "prefix": lambda: _bench_prefix(
            quick, duration_s, policies, redis_url, as_json, seed, gateways, workloads
        ),
        "sharing": lambda: _bench_sharing(quick, duration_s, redis_url, as_json),
        "epp": lambda: _bench_epp(quick, duration_s, redis_url, as_json),
    }
    for name, run in named.items():
        if name in sections:
            run()
    if sections and all(s in named for s in sections):
        return
    sections = tuple(s for s in sections if s not in named)

    from poller_lab.bench import BenchConfig, format_table, run_bench

    cfg = BenchConfig.quick() if quick else BenchConfig()
    changes: dict[str, Any] = {"vs_prometheus": vs_prometheus}
    for name, value in (
        ("endpoints", endpoints),
        ("pollers", pollers),
        ("interval_s", interval_s),
        ("duration_s", duration_s),
        ("page", page),
    ):
        if value is not None:
            changes[name] = value
    if sections:
        changes["sections"] = sections
    cfg = dataclasses.replace(cfg, **changes)
    try:
        # Progress on stdout at a terminal; on stderr when stdout is a file, a pipe or JSON.
        to_stderr = as_json or not sys.stdout.isatty()
        result = run_bench(cfg, redis_url, say=lambda line: click.echo(line, err=to_stderr))
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: bench failed: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(result, indent=2) if as_json else format_table(result))


def _bench_sharing(
    quick: bool, duration_s: float | None, redis_url: str | None, as_json: bool
) -> None:
    """The sharing section: the share script's cost to Redis and to a replica as
    replicas are added (lab/poller_lab/bench_sharing.py)."""
    from poller_lab.bench_sharing import REPLICAS, bench_sharing, format_sharing

    counts = (8, 32) if quick else REPLICAS
    window = duration_s or (3.0 if quick else 10.0)
    try:
        report = bench_sharing(counts, window_s=window, redis_url=redis_url)
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: bench failed: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(report, indent=2) if as_json else format_sharing(report))


@dataclasses.dataclass(frozen=True)
class _RoutingArgs:
    full: bool = False
    family_only: bool = False
    single_fleet: bool = False
    cells: str | None = None
    compare: bool = False
    seed: int = 1


def _bench_routing(
    quick: bool,
    duration_s: float | None,
    policies: tuple[str, ...],
    redis_url: str | None,
    as_json: bool,
    args: _RoutingArgs = _RoutingArgs(),
) -> None:
    """The routing section: the family in virtual time (lab/poller_lab/routing/family.py),
    then (unless ``family_only``) the family on real processes (family_real.py), or with
    ``single_fleet`` the one-fleet bench (run.py); rows as they come (to stderr under
    --json), then the report."""

    from poller_lab.routing.cells import iter_design
    from poller_lab.routing.family import run_family

    out = sys.stderr if as_json else sys.stdout
    seed = args.seed
    family = run_family(
        list(iter_design("quick" if quick else "full" if args.full else "design")),
        10.0 if quick else 60.0,
        seed=seed,
        say=lambda line: print(line, file=out, flush=True),
    )
    if args.family_only:
        family["seed"] = seed
        if as_json:
            click.echo(json.dumps(family, indent=2))
        else:
            click.echo(f"  (took {family['elapsed_s']} s)")
        return
    if args.single_fleet:
        from poller_lab.routing import RoutingConfig
        from poller_lab.routing.run import run_routing

        cfg = _tuned(RoutingConfig.quick() if quick else RoutingConfig(), duration_s, policies)
        cfg = dataclasses.replace(cfg, seed=seed)
        _run_section(lambda: {**run_routing(cfg, redis_url, out), "family": family}, as_json)
        return
    _run_section(
        lambda: {
            **_real_family(quick, duration_s, policies, redis_url, args, out),
            "family": family,
        },
        as_json,
    )


def _real_family(
    quick: bool,
    duration_s: float | None,
    policies: tuple[str, ...],
    redis_url: str | None,
    args: _RoutingArgs,
    out: Any,
) -> dict[str, Any]:
    from poller_lab.routing.compare import COMPARE_HEADER, compare, format_compare
    from poller_lab.routing.family_real import RealConfig, run_real_family
    from poller_lab.routing.fleets import design, every_cell, quick_design, select

    if args.cells:
        cells = select(every_cell(), args.cells)
    else:
        cells = quick_design() if quick else design()
    cfg = RealConfig(cells=tuple(cells), seed=args.seed)
    if quick:
        cfg = dataclasses.replace(cfg, duration_s=4.0, warmup_s=0.5)
    cfg = _tuned(cfg, duration_s, policies)
    report = run_real_family(cfg, redis_url, out)
    if args.compare:
        rows = compare(report["rows"], cfg.interval_s, 10.0 if quick else 60.0, args.seed)
        print("virtual time against real processes (the picker over the oracle):", file=out)
        print(COMPARE_HEADER, file=out)
        for row in rows:
            print(format_compare(row), file=out, flush=True)
        report["compare"] = rows
    return report


def _bench_peers(
    quick: bool,
    duration_s: float | None,
    cells: str | None,
    redis_url: str | None,
    as_json: bool,
    seed: int = 1,
    part: str = "both",
) -> None:
    """The peers section (lab/poller_lab/peers/): the routing family's cells, then the
    prefix workload; rows as they come (to stderr under --json), then the report."""
    from poller_lab.peers.prefix import PrefixPeersConfig, run_prefix_peers
    from poller_lab.peers.run import PeersConfig, default_cells, run_peers
    from poller_lab.routing.fleets import select

    out = sys.stderr if as_json else sys.stdout

    def run() -> dict[str, Any]:
        report: dict[str, Any] = {}
        started = time.monotonic()
        if part in ("both", "routing"):
            cfg = PeersConfig.quick() if quick else PeersConfig()
            if cells:
                cfg = dataclasses.replace(cfg, cells=tuple(select(default_cells(), cells)))
            if duration_s is not None:
                cfg = dataclasses.replace(cfg, duration_s=duration_s)
            report["routing"] = run_peers(dataclasses.replace(cfg, seed=seed), redis_url, out)
        if part in ("both", "prefix"):
            pcfg = PrefixPeersConfig.quick() if quick else PrefixPeersConfig()
            prefix = dataclasses.replace(pcfg.prefix, seed=seed)
            if duration_s is not None:
                prefix = dataclasses.replace(prefix, duration_s=duration_s)
            pcfg = dataclasses.replace(pcfg, prefix=prefix)
            report["prefix"] = run_prefix_peers(pcfg, redis_url, out)
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        return report

    _run_section(run, as_json)


def _tuned(cfg: _Cfg, duration_s: float | None, policies: tuple[str, ...]) -> _Cfg:
    """A section's config with the --duration and --policy given (dataclass fields)."""
    if duration_s is not None:
        cfg = dataclasses.replace(cfg, duration_s=duration_s)  # type: ignore[type-var]
    if policies:
        cfg = dataclasses.replace(cfg, policies=policies)  # type: ignore[type-var]
    return cfg


def _run_section(run: Callable[[], dict[str, Any]], as_json: bool) -> None:
    """Run a bench section: its report as JSON or how long it took; a bad setting exits
    2, a failed run 1, each with one ``Error:`` line."""
    from poller.errors import ConfigError

    try:
        result = run()
    except ConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: bench failed: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"  (took {result['elapsed_s']} s)")


def _bench_epp(quick: bool, duration_s: float | None, redis_url: str | None, as_json: bool) -> None:
    """The epp section (lab/poller_lab/epp_bench.py): rows as they come (to stderr under
    --json), then the report."""
    from poller_lab.epp_bench import EppBenchConfig, run_epp_bench

    out = sys.stderr if as_json else sys.stdout
    cfg = EppBenchConfig.quick() if quick else EppBenchConfig()
    if duration_s is not None:
        cfg = dataclasses.replace(cfg, duration_s=duration_s)
    _run_section(lambda: run_epp_bench(cfg, redis_url, out), as_json)


def _bench_prefix(
    quick: bool,
    duration_s: float | None,
    policies: tuple[str, ...],
    redis_url: str | None,
    as_json: bool,
    seed: int = 1,
    gateways: tuple[int, ...] = (),
    workloads: tuple[str, ...] = (),
) -> None:
    """The prefix section (lab/poller_lab/prefix/run.py): rows as they come (to stderr
    under --json), then the targets and the report."""
    from poller_lab.prefix.fleet import PrefixConfig
    from poller_lab.prefix.run import run_prefix

    out = sys.stderr if as_json else sys.stdout
    cfg = _tuned(PrefixConfig.quick() if quick else PrefixConfig(), duration_s, policies)
    cfg = dataclasses.replace(cfg, seed=seed)
    if gateways:
        cfg = dataclasses.replace(cfg, gateways=tuple(sorted(set(gateways))))
    if workloads:
        cfg = dataclasses.replace(cfg, workloads=tuple(dict.fromkeys(workloads)))
    _run_section(lambda: run_prefix(cfg, redis_url, out), as_json)


@click.command()
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(10, 86400),
    default=600,
    show_default=True,
    help="Seconds to run.",
)
@click.option(
    "--endpoints",
    type=click.IntRange(10, 5000),
    default=300,
    show_default=True,
    help="Simulated endpoints.",
)
@click.option(
    "--every",
    "every_s",
    type=click.FloatRange(5, 3600),
    default=20,
    show_default=True,
    help="Seconds between disruptions.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON (progress on stderr)."
)
@stopped_by_sigterm
def soak(duration_s: float, endpoints: int, every_s: float, as_json: bool) -> None:
    """Disrupt a local cluster for a while and check the invariants; exit 1 on a violation."""
    from poller_lab.soak import SoakConfig, format_summary, run_soak, violations

    cfg = SoakConfig(endpoints=endpoints, duration_s=duration_s, every_s=every_s)
    try:
        result = run_soak(cfg, say=lambda line: click.echo(line, err=as_json))
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: soak failed: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(result, indent=2) if as_json else format_summary(result))
    sys.exit(1 if violations(result) else 0)
