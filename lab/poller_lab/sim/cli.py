"""``python -m poller_lab.sim``: serve a fleet of simulated engines until interrupted.

    python -m poller_lab.sim --endpoints 12 --engines vllm,sglang,llamacpp --style path \\
        --admin-port 9100 --seed 1 --registry-out /tmp/sim-endpoints.json \\
        --model qwen3-8b --fault vllm-0=slow,delay_s=3

The registry (a JSON list of ``{id, url, engine, api_key_env?}``, which is also YAML, so
``endpoints_from_file`` reads it) goes to stdout and, with ``--registry-out``, to a file.
Logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from poller.errors import ConfigError
from poller_lab.sim.engines import ENGINES
from poller_lab.sim.faults import DESCRIPTIONS, FAULT_MODES, Fault, defaults
from poller_lab.sim.server import Simulator
from poller_lab.sim.spec import STYLES, EndpointSpec, fleet

__all__ = ["main", "run_sim"]

_log = logging.getLogger(__name__)
DEFAULT_KEY_ENV = "LLMGW_KEY_SIM"  # pollers accept LLMGW_KEY_* (scrape.key_env_prefix)


async def run_sim(
    specs: Sequence[EndpointSpec],
    *,
    seed: int = 0,
    port: int = 0,
    admin_port: int = 0,
    registry_out: str | Path | None = None,
    api_key_env: str = DEFAULT_KEY_ENV,
    out: TextIO | None = None,
    stop: asyncio.Event | None = None,
    faults: Sequence[tuple[str, str, dict[str, Any]]] = (),
) -> None:
    """Serve ``specs`` until ``stop`` is set (default: until SIGINT or SIGTERM), with
    ``faults`` ((endpoint id, mode, parameters), already validated) set from the start."""
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        async with Simulator(specs, seed=seed, port=port, admin_port=admin_port) as sim:
            for endpoint_id, mode, params in faults:
                await sim.set_fault(endpoint_id, mode, **params)
            text = json.dumps(sim.registry(api_key_env), indent=2) + "\n"
            if registry_out is not None:
                await asyncio.to_thread(Path(registry_out).write_text, text, encoding="utf-8")
            # The registry is the CLI's output proper; logging would decorate it.
            (out or sys.stdout).write(text)
            (out or sys.stdout).flush()
            if any(s.api_key for s in specs):
                _log.info("keyed endpoints read their key from $%s on the poller", api_key_env)
            _log.info("admin API at %s/admin/endpoints", sim.admin_url)
            await stop.wait()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


def _epilog() -> str:
    width = max(len(m) for m in FAULT_MODES)
    lines = ["fault modes (what a client of the endpoint sees):"]
    for mode in FAULT_MODES:
        lines.append(f"  {mode:<{width}}  {DESCRIPTIONS[mode]}")
        params = [
            f"{k}={'NAME' if v is None else v if isinstance(v, str) else json.dumps(v)}"
            for k, v in defaults(mode).items()
        ]
        if params:
            lines.append(f"  {'':<{width}}    parameters: {', '.join(params)}")
    lines += [
        "",
        "set one at start:  --fault vllm-0=slow,delay_s=3   (repeat for more endpoints)",
        "or while it runs:  curl -X POST <admin>/admin/endpoints/vllm-0/fault \\",
        '                        -d \'{"mode": "slow", "delay_s": 3}\'',
        '                   ({"mode": "ok"} clears it; <admin> is logged at start, or',
        "                   fixed with --admin-port)",
    ]
    return "\n".join(lines)


def _parser(prog: str) -> argparse.ArgumentParser:
    # The docstring's first line without its "``python -m ...``: " prefix.
    what = __doc__.split("\n")[0].split(": ", 1)[1]
    p = argparse.ArgumentParser(
        prog=prog,
        description=what[0].upper() + what[1:],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--endpoints", type=int, default=6, help="how many endpoints (default 6)")
    p.add_argument(
        "--engines",
        default="vllm,sglang,llamacpp,trtllm,triton,tgi,lmdeploy",
        help=f"comma-separated, cycled over the endpoints; from {', '.join(ENGINES)}",
    )
    p.add_argument("--style", choices=STYLES, default="path", help="one port each, or /e/<id>")
    p.add_argument("--port", type=int, default=0, help="shared port of path-style endpoints")
    p.add_argument("--admin-port", type=int, default=0, help="admin API port (default: any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (vllm, sglang)")
    p.add_argument("--lora", default="", help="comma-separated LoRA adapters (vllm)")
    p.add_argument(
        "--load",
        type=float,
        metavar="L",
        help="every endpoint's background load per capacity (1.0 = full; more builds a "
        "queue); default: none on the first endpoint, which answers a request at once, "
        "0.3-0.9 from the seed on the others",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="the model every endpoint serves: /v1/models lists it, requests name it, "
        "pages that carry a model name show it (default per engine; a --spec-file entry's "
        "own model key wins)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="ID=MODE[,KEY=VALUE...]",
        help="start endpoint ID in fault MODE (modes below; repeatable)",
    )
    p.add_argument("--api-key", help="guard llama.cpp endpoints with this bearer key")
    p.add_argument("--api-key-env", default=DEFAULT_KEY_ENV, help="variable named in entries")
    p.add_argument("--registry-out", metavar="FILE", help="also write the registry here")
    p.add_argument(
        "--spec-file",
        metavar="FILE",
        help="serve the endpoint specs in this JSON list instead of --endpoints/--engines "
        "(keys as in the admin API: id, engine, capacity, load, speed_tps, prefill_tps, "
        "kv_blocks, metrics_lag_s, ...)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m poller_lab.sim") -> int:
    """Entry point; returns the exit status (2 for bad arguments). ``prog``: the command
    its usage and errors name (``poller sim`` when run through the ``poller`` command)."""
    args = _parser(prog).parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    lora = tuple(a for a in args.lora.split(",") if a)
    try:
        if args.spec_file:
            specs = _read_specs(Path(args.spec_file))
        else:
            specs = fleet(args.endpoints, engines, args.style, api_key=args.api_key, load=args.load)
        if args.dp > 1 or lora or args.model is not None:
            specs = [_with(s, args.dp, lora, args.model) for s in specs]
        faults = [_fault(text, {s.id for s in specs}) for text in args.fault]
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    from poller.util.logs import setup_logging

    setup_logging(args.log_level.upper())
    _raise_fd_limit()
    try:
        asyncio.run(
            run_sim(
                specs,
                seed=args.seed,
                port=args.port,
                admin_port=args.admin_port,
                registry_out=args.registry_out,
                api_key_env=args.api_key_env,
                faults=faults,
            )
        )
    except OSError as exc:  # a port in use, a registry file that cannot be written
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = " (a simulator still running? --port 0 and --admin-port 0 take free ports)"
        where = f"{exc.filename}: " if exc.filename else ""
        sys.stderr.write(f"error: {where}{exc.strerror or exc}{hint}\n")
        return 1
    return 0


def _fault(text: str, ids: set[str]) -> tuple[str, str, dict[str, Any]]:
    """``ID=MODE[,KEY=VALUE...]`` checked as the admin API checks it; values are JSON
    where they parse as JSON (numbers, true, false), else strings."""
    endpoint_id, sep, rest = text.partition("=")
    mode, *pairs = rest.split(",")
    if not sep or not endpoint_id or not mode:
        raise ConfigError(f"--fault {text!r}: expected ID=MODE[,KEY=VALUE...]")
    if endpoint_id not in ids:
        known = ", ".join(sorted(ids)[:8]) + (", ..." if len(ids) > 8 else "")
        raise ConfigError(f"--fault {text!r}: no endpoint {endpoint_id!r} (endpoints: {known})")
    params: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"--fault {text!r}: parameter {pair!r} is not KEY=VALUE")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    try:
        Fault.parse(mode, params)  # what the admin API checks, naming the parameters
    except ConfigError as exc:
        raise ConfigError(f"--fault {text!r}: {exc}") from None
    return endpoint_id, mode, params


def _read_specs(path: Path) -> list[EndpointSpec]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--spec-file {path}: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ConfigError(f"--spec-file {path}: expected a non-empty JSON list of specs")
    return [EndpointSpec.from_dict(item) for item in data]


def _raise_fd_limit() -> None:
    """Per-port fleets need a socket per endpoint and per scraper connection: often more
    than a default soft limit of 1024 descriptors, so take what the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            _log.warning("cannot raise the open-file limit from %d: %s", soft, exc)


def _with(spec: EndpointSpec, dp: int, lora: tuple[str, ...], model: str | None) -> EndpointSpec:
    """Apply --dp and --lora to the engines that have them, leaving the others alone, and
    --model to the specs that name none."""
    engine = ENGINES[spec.engine]
    return replace(
        spec,
        dp=dp if engine.rank_label and dp > 1 else spec.dp,
        lora=lora if engine.lora and lora else spec.lora,
        model=spec.model if spec.model is not None else model,
    )
