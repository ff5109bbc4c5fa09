"""The EPP's gRPC server configurations, side by side: CPU per ext_proc stream.

Usage: python tests/bench/bench_epp_grpc.py [--streams 4000] [--clients 16] [--json]

For each server configuration a server process runs the EPP's own ``Stream`` on a
Router built by hand (4 endpoints, no Redis), and a client process (grpc.aio) opens
``--streams`` ext_proc streams, ``--clients`` at a time, each as Envoy's shipped modes
send them (request headers, a BUFFERED body, response headers, then the close). The
server's CPU (user + system, /proc) per stream is the figure; the configurations:

- ``aio``: grpc.aio in one event loop (what ``poller epp`` runs), compression off;
- ``aio-gzip``: the same with gzip on the server's answers;
- ``sync-4``, ``sync-16``: the synchronous server with a thread pool of 4 or 16 (a
  thread per open stream; Router picks under its lock, as threaded gateways do).

No Envoy: this is the server's own cost per stream, which the full path
(``poller bench --section epp``) adds Envoy's and the engines' to. Timings come from
whatever machine runs it, often shared and noisy: compare runs on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
CONFIGS = ("aio", "aio-gzip", "sync-4", "sync-16")


def _picking() -> Any:
    from poller import EndpointView
    from poller.integrations.envoy.destinations import Destinations
    from poller.integrations.envoy.metrics import EppMetrics
    from poller.integrations.envoy.picking import Picking
    from tests.reader.test_pick import timed, view_of
    from tests.support.routers import router_on

    views = []
    for i in range(4):
        view = timed(f"e{i}", models="m")
        entry = json.dumps({"url": f"http://10.0.0.{i + 1}:8000"})
        views.append(EndpointView(view.id, state=view.state, age_ms=view.age_ms, owner="p",
                                  token=1, raw=(entry, view.raw[1], view.raw[2]),
                                  timing=view.timing))  # fmt: skip
    router = router_on(view_of(*views))
    return Picking(router, Destinations(router), EppMetrics())


def serve(config: str, port_file: str) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as g

    from poller.integrations.envoy.stream import Stream

    picking = _picking()

    class Aio(g.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, requests: Any, context: Any) -> Any:
            stream = Stream(picking)
            try:
                async for request in requests:
                    for answer in stream.handle(request):
                        yield answer
            finally:
                stream.close()

    class Sync(g.ExternalProcessorServicer):  # type: ignore[misc]
        def Process(self, requests: Any, context: Any) -> Any:
            stream = Stream(picking)
            try:
                for request in requests:
                    yield from stream.handle(request)
            finally:
                stream.close()

    if config.startswith("sync"):
        pool = futures.ThreadPoolExecutor(int(config.split("-")[1]))
        server = grpc.server(pool, compression=grpc.Compression.NoCompression)
        g.add_ExternalProcessorServicer_to_server(Sync(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        Path(port_file).write_text(str(port))
        server.wait_for_termination()
        return

    async def main() -> None:
        compression = grpc.Compression.Gzip if config == "aio-gzip" else None
        server = grpc.aio.server(compression=compression or grpc.Compression.NoCompression)
        g.add_ExternalProcessorServicer_to_server(Aio(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await asyncio.to_thread(Path(port_file).write_text, str(port))
        await server.wait_for_termination()

    asyncio.run(main())


async def _client(port: int, streams: int, clients: int) -> float:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as g

    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    headers.protocol_config.request_body_mode = 2  # BUFFERED
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
    answer = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    answer.response_headers.headers.headers.append(
        base_pb2.HeaderValue(key=":status", raw_value=b"200")
    )
    left = streams
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = g.ExternalProcessorStub(channel)

        async def one() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                call = stub.Process()
                for message in (headers, body, answer):
                    await call.write(message)
                    await call.read()
                await call.done_writing()
                await call.read()  # the end of the stream

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(clients)))
        return time.perf_counter() - t0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(config: str, streams: int, clients: int) -> dict[str, Any]:
    port_file = Path(f"/tmp/bench-epp-grpc-{os.getpid()}-{config}")
    port_file.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, __file__, "--serve", config, str(port_file)])
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server {config} did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        asyncio.run(_client(port, 200, clients))  # warm up
        cpu0 = _cpu_s(server.pid)
        wall_s = asyncio.run(_client(port, streams, clients))
        cpu_s = _cpu_s(server.pid) - cpu0
    finally:
        server.kill()
        server.wait()
        port_file.unlink(missing_ok=True)
    return {
        "config": config,
        "streams_per_s": round(streams / wall_s),
        "server_cpu_ms_per_stream": round(1000 * cpu_s / streams, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    rows = [measure(c, args.streams, args.clients) for c in CONFIGS]
    if args.json:
        print(json.dumps({"rows": rows, "loadavg": os.getloadavg()}, indent=2))
        return
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for row in rows:
        print(f"  {row['config']:<9} {row['server_cpu_ms_per_stream']:>7} ms CPU/stream  "
              f"{row['streams_per_s']:>6} streams/s")  # fmt: skip


if __name__ == "__main__":
    main()
