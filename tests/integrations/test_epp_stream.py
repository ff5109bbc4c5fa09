"""The EPP's ext_proc streams, message by message, on a Router built by hand: where each
body mode picks, what goes back to Envoy, the served endpoint, the refusals, and the
in-flight count from the pick to the end however the stream ends. No server: the
messages are Envoy's generated ones (xds-protos); tests/epp runs the real Envoy."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poller import EndpointView, RoutingOptions
from poller.integrations.envoy.body import BadRequest, read_body
from poller.integrations.envoy.destinations import Destinations, split_address
from poller.integrations.envoy.metrics import EppMetrics
from poller.integrations.envoy.picking import Picking
from poller.integrations.envoy.stream import Stream
from poller.reader import Router, prompt_of
from poller.reader.load.local import LocalLoad
from tests.reader.test_pick import Clock, timed, view_of
from tests.support.routers import router_on

Mode = processing_mode_pb2.ProcessingMode
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def endpoint(endpoint_id: str, url: str, **fields: str) -> EndpointView:
    view = timed(endpoint_id, models="m", **fields)
    entry = json.dumps({"url": url})
    return EndpointView(endpoint_id, state=view.state, age_ms=view.age_ms, owner="p",
                        token=1, raw=(entry, view.raw[1], view.raw[2]),
                        timing=view.timing)  # fmt: skip


def router(options: RoutingOptions | None = None, **running: int) -> Router:
    urls = {"a": "http://10.0.0.1:8000", "b": "http://10.0.0.2:8000",
            "c": "http://10.0.0.2:8001"}  # fmt: skip
    views = [endpoint(e, urls[e], running=str(n)) for e, n in running.items()]
    return router_on(view_of(*views), options, local=LocalLoad(clock=Clock()))


def picking(r: Router, **kw: Any) -> Picking:
    return Picking(r, Destinations(r), EppMetrics(), **kw)


def headers(end_of_stream: bool = False, mode: int | None = None, **extra: Any) -> Any:
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(end_of_stream=end_of_stream), **extra
    )
    if mode is not None:
        request.protocol_config.request_body_mode = mode
        request.protocol_config.response_body_mode = mode
    return request


def body(data: bytes, end_of_stream: bool = True) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def response_headers(status: str = "200", served: str | None = None, eos: bool = False) -> Any:
    request = pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=eos))
    request.response_headers.headers.headers.append(
        base_pb2.HeaderValue(key=":status", raw_value=status.encode())
    )
    if served is not None:
        lb = request.metadata_context.filter_metadata["envoy.lb"]
        lb.update({"x-gateway-destination-endpoint-served": served})
    return request


def destination(answer: Any) -> str:
    """The header the answer sets, checked equal to its envoy.lb metadata."""
    which = answer.WhichOneof("response")
    mutation = getattr(answer, which).response.header_mutation
    (header,) = [h.header for h in mutation.set_headers]
    assert header.key == "x-gateway-destination-endpoint"
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == header.raw_value.decode()
    return header.raw_value.decode()  # type: ignore[no-any-return]


def refusal(answer: Any) -> tuple[int, str, dict[str, str]]:
    immediate = answer.immediate_response
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, json.loads(immediate.body)["error"]["code"], sent


def test_buffered_picks_at_the_body_and_counts_until_the_stream_ends() -> None:
    r = router(a=0, b=3)
    stream = Stream(picking(r))
    (first,) = stream.handle(headers(mode=Mode.BUFFERED))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")
    (picked,) = stream.handle(body(BODY))
    assert picked.WhichOneof("response") == "request_body"
    assert destination(picked) == "10.0.0.1:8000"
    assert r.local.in_flight("a") == 1
    (answer,) = stream.handle(response_headers("200", served="10.0.0.1:8000"))
    assert answer.WhichOneof("response") == "response_headers"
    assert r.local.in_flight("a") == 1  # the answer's body is still coming
    stream.close()  # Envoy ends the stream when the response has ended
    assert r.local.in_flight("a") == 0 and r.local.failing("a") == 0


def test_full_duplex_holds_the_body_then_answers_headers_and_hands_it_back() -> None:
    r = router(a=0)
    stream = Stream(picking(r))
    assert stream.handle(headers(mode=Mode.FULL_DUPLEX_STREAMED)) == []
    assert stream.handle(body(BODY[:10], end_of_stream=False)) == []
    first, *rest = stream.handle(body(BODY[10:]))
    assert first.WhichOneof("response") == "request_headers" and destination(first)
    handed = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in rest)
    assert (
        handed == BODY
        and rest[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    )
    stream.handle(response_headers())
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n"))
    (echo,) = stream.handle(chunk)
    assert echo.response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"
    assert r.local.in_flight("a") == 1
    last = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True))
    stream.handle(last)
    assert r.local.in_flight("a") == 0  # ended at the last chunk, before the stream closes


def test_streamed_without_waiting_answers_each_held_chunk_after_the_headers() -> None:
    r = router(a=0)
    stream = Stream(picking(r))
    request = headers(mode=Mode.STREAMED)
    request.protocol_config.send_body_without_waiting_for_header_response = True
    assert stream.handle(request) == []
    assert stream.handle(body(BODY[:5], end_of_stream=False)) == []
    answers = stream.handle(body(BODY[5:]))
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_body"]


def test_streamed_answers_as_many_chunks_as_came_whether_trailers_or_the_last_chunk_end_it() -> (
    None
):
    def streamed(*messages: Any) -> list[str]:
        stream = Stream(picking(router(a=0)))
        request = headers(mode=Mode.STREAMED)
        request.protocol_config.send_body_without_waiting_for_header_response = True
        answers = [a for m in (request, *messages) for a in stream.handle(m)]
        return [a.WhichOneof("response") for a in answers]

    thirds = [BODY[:5], BODY[5:10], BODY[10:]]
    by_last_chunk = [body(part, end_of_stream=False) for part in thirds[:2]] + [body(thirds[2])]
    assert streamed(*by_last_chunk) == ["request_headers"] + ["request_body"] * 3
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    by_trailers = [body(part, end_of_stream=False) for part in thirds]
    assert streamed(*by_trailers, trailers) == (
        ["request_headers"] + ["request_body"] * 3 + ["request_trailers"]
    )


def test_a_request_without_a_body_is_picked_at_its_headers_without_a_model() -> None:
    r = router(a=0)
    (answer,) = Stream(picking(r)).handle(headers(end_of_stream=True, mode=Mode.BUFFERED))
    assert destination(answer) == "10.0.0.1:8000"


def test_the_endpoint_that_served_takes_over_the_count() -> None:
    r = router(a=0, b=3)
    p = picking(r)
    stream = Stream(p)
    stream.handle(headers(mode=Mode.BUFFERED))
    stream.handle(body(BODY))
    stream.handle(response_headers("200", served="10.0.0.2:8000"))  # Envoy retried on b
    assert r.local.in_flight("a") == 0 and r.local.in_flight("b") == 1
    assert r.local.failing("a") > 0  # a retry means the first one failed
    stream.close()
    assert r.local.total() == 0
    assert p.metrics.served_elsewhere._value.get() == 1


def test_a_5xx_answer_or_none_at_all_is_a_failed_request() -> None:
    r = router(a=0)
    stream = Stream(picking(r))
    stream.handle(headers(mode=Mode.BUFFERED))
    stream.handle(body(BODY))
    stream.close()  # the stream ended before any response: reset, refused, gone
    assert r.local.failing("a") > 0 and r.local.total() == 0


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"{not json", 400, "bad_request"),
        (b"[1, 2]", 400, "bad_request"),
        (json.dumps({"messages": []}).encode(), 400, "bad_request"),
        (json.dumps({"model": "other"}).encode(), 503, "no_endpoint"),
    ],
)
def test_refusals_say_why_in_an_openai_error(data: bytes, status: int, code: str) -> None:
    r = router(a=0)
    stream = Stream(picking(r))
    stream.handle(headers(mode=Mode.BUFFERED))
    (answer,) = stream.handle(body(data))
    got, reason, sent = refusal(answer)
    assert (got, reason, sent["content-type"]) == (status, code, "application/json")
    assert stream.handle(response_headers()) == []  # nothing more to say
    assert r.local.total() == 0


def test_a_body_over_the_cap_is_refused_before_it_ends() -> None:
    stream = Stream(picking(router(a=0), max_body_bytes=1024))
    assert stream.handle(headers(mode=Mode.FULL_DUPLEX_STREAMED)) == []
    (answer,) = stream.handle(body(b"x" * 2000, end_of_stream=False))
    assert refusal(answer)[:2] == (400, "too_large")


def test_saturated_with_none_is_a_429_with_retry_after() -> None:
    # Its KV cache full while it runs requests, none of the gateways' ended since its page.
    views = [endpoint("a", "http://10.0.0.1:8000", running="3", kv_cache_usage="0.95")]
    r = router_on(view_of(*views), RoutingOptions(when_saturated="none"))
    stream = Stream(picking(r, retry_after_s=3))
    stream.handle(headers(mode=Mode.BUFFERED))
    status, code, sent = refusal(stream.handle(body(BODY))[0])
    assert (status, code, sent["retry-after"]) == (429, "saturated", "3")


def test_the_subset_hint_narrows_the_choice_and_an_empty_one_refuses() -> None:
    r = router(a=0, b=5, c=5)
    hint = "envoy.lb.subset_hint"
    for given, expected in (("10.0.0.2", {"10.0.0.2:8000", "10.0.0.2:8001"}),
                            ("10.0.0.2:8001", {"10.0.0.2:8001"})):  # fmt: skip
        seen = set()
        for _ in range(20):
            stream = Stream(picking(r))
            request = headers(mode=Mode.BUFFERED)
            request.metadata_context.filter_metadata[hint].update(
                {"x-gateway-destination-endpoint-subset": given}
            )
            stream.handle(request)
            seen.add(destination(stream.handle(body(BODY))[0]))
            stream.close()
        assert seen == expected
    stream = Stream(picking(r))
    request = headers(mode=Mode.BUFFERED)
    request.metadata_context.filter_metadata[hint].update(
        {"x-gateway-destination-endpoint-subset": ["10.9.9.9:1"]}
    )
    stream.handle(request)
    assert refusal(stream.handle(body(BODY))[0])[:2] == (503, "no_endpoint")


def test_fallbacks_follow_the_primary_in_the_header() -> None:
    r = router(a=0, b=2, c=4)
    stream = Stream(picking(r, fallbacks=2))
    stream.handle(headers(mode=Mode.BUFFERED))
    assert destination(stream.handle(body(BODY))[0]) == (
        "10.0.0.1:8000,10.0.0.2:8000,10.0.0.2:8001"
    )


async def test_names_resolve_and_path_prefixes_are_left_out() -> None:
    views = [endpoint("n", "http://engine.local:9000"), endpoint("p", "http://10.0.0.7/x")]
    r = router_on(view_of(*views))

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("engine.local", 9000)
        return ["10.1.1.1"]

    where = Destinations(r, resolver=resolver)
    where.refresh()
    assert where.address("n") is None and where.address("p") is None
    names = where._names
    names[("engine.local", 9000)] = (await resolver("engine.local", 9000))[0]
    where._rev = None
    where.refresh()
    assert where.address("n") == "10.1.1.1:9000" and where.endpoint_at("10.1.1.1:9000") == "n"
    assert where.address("p") is None and where.routable == ["n"] and not where.complete


def test_addresses_parse_as_envoy_writes_them() -> None:
    assert split_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert split_address("[::1]:8000") == ("::1", 8000)
    assert split_address("[0:0::1]") == ("::1", None)
    assert split_address("10.0.0.1") == ("10.0.0.1", None)
    for bad in ("host:80", "10.0.0.1:0", "10.0.0.1:x", "[::1]x"):
        with pytest.raises(ValueError):
            split_address(bad)


def test_the_body_gives_the_model_and_the_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert read_body(BODY) == ("m", prompt_of(messages), False)
    completion = json.dumps({"model": "m", "prompt": ["one", "two"], "stream": True}).encode()
    assert read_body(completion) == ("m", "one", True)
    with pytest.raises(BadRequest, match="names no model"):
        read_body(b'{"model": ""}')


def test_readiness_follows_the_router_and_liveness_does_not() -> None:
    from grpc_health.v1 import health_pb2

    from poller import Router, ViewCache
    from poller.integrations.envoy.server import EXT_PROC_SERVICE, _Health

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    ready = _Health(router(a=0))
    assert {ready.status(s) for s in ("liveness", "readiness", EXT_PROC_SERVICE)} == {serving}
    unloaded = _Health(Router(ViewCache()))  # no view read yet (or Redis lost, or no schema)
    assert unloaded.status("liveness") == serving
    assert unloaded.status("readiness") == unloaded.status(EXT_PROC_SERVICE) == not_serving
