"""One ext_proc stream: one HTTP request through Envoy and its response (``Stream``).

``handle(message)`` takes each ``ProcessingRequest`` and returns the answers to send,
in order; ``close()`` runs when the stream ends, however it ends. The ticket picked for
the request counts it in flight from the pick to the end of its response: the last body
chunk or the trailers when Envoy sends them, else the stream's end, which Envoy holds
open until the HTTP stream is over (end of stream, client abort, upstream reset: the
filter is destroyed then). So exact in-flight needs no body on the response side.

Where the pick happens depends on the request body mode (the first message's
``protocol_config``; envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto):

=======================  ==============================================================
``NONE``, or no body     at the headers, without a model (a GET goes to any endpoint)
``BUFFERED[_PARTIAL]``   headers passed on; at the body, whose answer carries the header
``STREAMED``             with ``send_body_without_waiting_for_header_response``: the
                         headers' answer waits for the whole body, then one answer per
                         chunk; without it Envoy needs the headers answered first, so
                         the pick cannot read the body (a WARNING, once)
``FULL_DUPLEX_STREAMED`` the body is held until its end, then the headers' answer and
                         the body handed back (Envoy forwards only what the EPP sends)
=======================  ==============================================================

A body over the cap is refused at once with 400, whatever the mode: Envoy arms no
timeout while it waits for the answer to a streamed body, so the EPP must answer or fail
every stream promptly.
"""

from __future__ import annotations

import logging
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from poller.integrations.envoy import messages
from poller.integrations.envoy.body import BadRequest, read_body
from poller.integrations.envoy.picking import Choice, Picking
from poller.reader import Ticket

__all__ = ["Stream", "subset_of"]

log = logging.getLogger(__name__)

_Mode = processing_mode_pb2.ProcessingMode
NONE, STREAMED, BUFFERED = _Mode.NONE, _Mode.STREAMED, _Mode.BUFFERED
BUFFERED_PARTIAL, FULL_DUPLEX = _Mode.BUFFERED_PARTIAL, _Mode.FULL_DUPLEX_STREAMED
_warned_streamed = False


def subset_of(request: Any) -> list[str] | None:
    """The subset hint of a message's metadata (``envoy.lb.subset_hint`` /
    ``x-gateway-destination-endpoint-subset``): a list of ``ip:port`` or ``ip``, given as
    a list or as one comma-separated string (what header_to_metadata makes); None when
    absent (every endpoint may be chosen)."""
    namespaces = request.metadata_context.filter_metadata
    if messages.SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[messages.SUBSET_NAMESPACE].fields
    if messages.SUBSET not in fields:
        return None
    value = fields[messages.SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    else:
        return []
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def served_of(request: Any) -> str | None:
    """``x-gateway-destination-endpoint-served`` of the ``envoy.lb`` metadata."""
    namespaces = request.metadata_context.filter_metadata
    if messages.LB_NAMESPACE not in namespaces:
        return None
    fields = namespaces[messages.LB_NAMESPACE].fields
    value = fields.get(messages.SERVED)
    return value.string_value if value is not None and value.string_value else None


class Stream:
    """The state of one request's ext_proc stream (module doc)."""

    def __init__(self, picking: Picking) -> None:
        self.picking = picking
        self.request_mode = NONE
        self.response_mode = NONE
        self.without_waiting = False
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.chunks = 0  # request body chunks held back (STREAMED, before the pick)
        self.routed = False
        self.finished = False  # a refusal sent: Envoy asks nothing more
        self.ticket: Ticket | None = None
        self.status = 0  # the response's status, once its headers came

    def handle(self, request: Any) -> list[Any]:
        kind = request.WhichOneof("request")
        if self.finished:
            return []
        if kind == "request_headers":
            return self._request_headers(request)
        if kind == "request_body":
            return self._request_body(request.request_body)
        if kind == "request_trailers":
            out = [] if self.routed else self._route_body(end_of_stream=False)
            return [*out, messages.trailers_continue("request_trailers")]
        if kind == "response_headers":
            return self._response_headers(request)
        if kind == "response_body":
            return self._response_body(request.response_body)
        if kind == "response_trailers":
            self._end()
            return [messages.trailers_continue("response_trailers")]
        return []

    def close(self) -> None:
        """The stream ended (Envoy closed it, the client or the upstream went away, or
        this EPP stops): the request is over. Failed unless its response came and was
        not a 5xx."""
        self._end()

    # --- the request ------------------------------------------------------------------

    def _request_headers(self, request: Any) -> list[Any]:
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self.request_mode = config.request_body_mode
            self.response_mode = config.response_body_mode
            self.without_waiting = config.send_body_without_waiting_for_header_response
        self.subset = subset_of(request)
        mode = self.request_mode
        if request.request_headers.end_of_stream or mode == NONE:
            return [self._route(None, None, "request_headers")]
        if mode in (BUFFERED, BUFFERED_PARTIAL):
            return [messages.headers_continue("request_headers")]
        if mode == FULL_DUPLEX or self.without_waiting:
            return []  # the headers' answer waits for the body
        _warn_streamed()
        return [self._route(None, None, "request_headers")]

    def _request_body(self, chunk: Any) -> list[Any]:
        if self.routed:  # STREAMED without waiting: the pick was made at the headers
            return self._pass_body("request_body", chunk.body, chunk.end_of_stream)
        self.body += chunk.body
        if len(self.body) > self.picking.max_body_bytes:
            self.finished = True
            cap = self.picking.max_body_bytes
            return [self.picking.refuse(400, "too_large", f"the request body is over {cap} bytes")]
        if self.request_mode == STREAMED:
            self.chunks += 1  # answered once the pick is made
        if chunk.end_of_stream:
            return self._route_body(end_of_stream=True)
        if self.request_mode == BUFFERED_PARTIAL:
            # Envoy's buffer filled before the body ended: all it will ever send.
            self.finished = True
            return [
                self.picking.refuse(
                    400, "too_large", "the request body is over the proxy's buffer limit"
                )
            ]
        return []

    def _route_body(self, end_of_stream: bool) -> list[Any]:
        """The body is whole: read it, pick, and answer what Envoy waits for."""
        body = bytes(self.body)
        self.body = bytearray()
        try:
            request = read_body(body)
        except BadRequest as exc:
            self.finished = True
            return [self.picking.refuse(400, "bad_request", str(exc))]
        mode = self.request_mode
        if mode in (BUFFERED, BUFFERED_PARTIAL):
            return [self._route(request.model, request.prompt, "request_body")]
        first = self._route(request.model, request.prompt, "request_headers")
        if self.finished:
            return [first]
        if mode == FULL_DUPLEX:
            return [first, *messages.streamed_body("request_body", body, end_of_stream)]
        # STREAMED, held back: one answer per chunk received (with trailers, the body
        # ended at its last chunk without end_of_stream).
        return [first] + [messages.body_continue("request_body")] * self.chunks

    def _route(self, model: str | None, prompt: str | None, where: str) -> Any:
        choice = self.picking.choose(model, prompt, self.subset)
        if not isinstance(choice, Choice):
            self.finished = True
            return choice
        self.routed = True
        self.ticket = choice.ticket
        return messages.picked(choice.destination, where)

    # --- the response -----------------------------------------------------------------

    def _response_headers(self, request: Any) -> list[Any]:
        headers = request.response_headers
        for header in headers.headers.headers:
            if header.key == ":status":
                value = header.raw_value or header.value.encode()
                self.status = int(value) if value.isdigit() else 0
                break
        served = served_of(request)
        ticket = self.ticket
        if served is not None and ticket is not None:
            endpoint_id = self.picking.destinations.endpoint_at(served)
            if endpoint_id is not None and endpoint_id != ticket.id:
                self.ticket = ticket.moved(endpoint_id)
                self.picking.metrics.served_elsewhere.inc()
        if headers.end_of_stream:
            self._end()
        return [messages.headers_continue("response_headers")]

    def _response_body(self, chunk: Any) -> list[Any]:
        self.picking.metrics.response_chunks.inc()
        if chunk.end_of_stream:
            self._end()
        return self._pass_body("response_body", chunk.body, chunk.end_of_stream)

    def _pass_body(self, where: str, body: bytes, end_of_stream: bool) -> list[Any]:
        mode = self.request_mode if where == "request_body" else self.response_mode
        if mode == FULL_DUPLEX:
            return messages.streamed_body(where, body, end_of_stream)
        return [messages.body_continue(where)]

    def _end(self) -> None:
        ticket = self.ticket
        if ticket is not None:
            ticket.done(ok=0 < self.status < 500)


def _warn_streamed() -> None:
    global _warned_streamed
    if not _warned_streamed:
        _warned_streamed = True
        log.warning(
            "request_body_mode STREAMED without send_body_without_waiting_for_header_response: "
            "Envoy waits for the headers' answer before it sends the body, so picks cannot "
            "read the model or the prompt; use BUFFERED or FULL_DUPLEX_STREAMED (docs/epp.md)"
        )
