"""The ext_proc messages the EPP sends, built from Envoy's own generated API
(``xds-protos``: envoy/service/ext_proc/v3/external_processor.proto).

The destination goes out twice with one value, as the Endpoint Picker Protocol asks
(docs/epp.md): the request header ``x-gateway-destination-endpoint`` and the same
string under the dynamic metadata namespace ``envoy.lb``. A refusal is an
``ImmediateResponse`` whose body is an OpenAI-style error naming the reason.
"""

from __future__ import annotations

import json
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

__all__ = [
    "BODY_CHUNK_BYTES",
    "DESTINATION",
    "LB_NAMESPACE",
    "SERVED",
    "SUBSET",
    "SUBSET_NAMESPACE",
    "body_continue",
    "headers_continue",
    "immediate",
    "picked",
    "streamed_body",
    "trailers_continue",
]

#: The protocol's names (the proposal "Endpoint Picker Protocol",
#: proposals/004-endpoint-picker-protocol of kubernetes-sigs/gateway-api-inference-extension).
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
#: A streamed body goes back in pieces of at most this size: processing_mode.proto
#: recommends no more than 64 KiB per chunk; the reference picker keeps a margin too.
BODY_CHUNK_BYTES = 62_000

_EMPTY = pb.CommonResponse()


def picked(destination: str, where: str) -> Any:
    """The answer that routes: ``where`` is ``request_headers`` (the headers answer) or
    ``request_body`` (a BUFFERED body's answer, whose header mutation Envoy applies)."""
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION, raw_value=destination.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header]),
        # The route may depend on the header; ORIGINAL_DST reads it after routing anyway.
        clear_route_cache=True,
    )
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = destination
    if where == "request_headers":
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
    )


def headers_continue(where: str) -> Any:
    """Headers passed on unchanged (``request_headers`` or ``response_headers``)."""
    return pb.ProcessingResponse(**{where: pb.HeadersResponse(response=_EMPTY)})


def body_continue(where: str) -> Any:
    """A body chunk passed on unchanged (``request_body`` or ``response_body``), in the
    modes where Envoy keeps the chunk (STREAMED, BUFFERED)."""
    return pb.ProcessingResponse(**{where: pb.BodyResponse(response=_EMPTY)})


def trailers_continue(where: str) -> Any:
    return pb.ProcessingResponse(**{where: pb.TrailersResponse()})


def streamed_body(where: str, body: bytes, end_of_stream: bool) -> list[Any]:
    """A body handed back in FULL_DUPLEX_STREAMED mode, where Envoy forwards only what
    the server sends: the bytes in chunks of at most ``BODY_CHUNK_BYTES``, the last one
    carrying ``end_of_stream``."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    out = []
    for i, piece in enumerate(pieces or [b""]):
        last = i == len(pieces) - 1 or not pieces
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(
                body=piece, end_of_stream=end_of_stream and last
            )
        )
        common = pb.CommonResponse(body_mutation=mutation)
        out.append(pb.ProcessingResponse(**{where: pb.BodyResponse(response=common)}))
    return out


def immediate(status: int, reason: str, message: str, retry_after_s: int | None = None) -> Any:
    """A refusal the client gets from Envoy at once: ``status`` with an OpenAI-style
    error body (``{"error": {"message", "type", "param", "code"}}``), ``code`` the reason."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status == 400 else "service_unavailable",
            "param": None,
            "code": reason,
        }
    }
    headers = [_header("content-type", "application/json")]
    if retry_after_s is not None:
        headers.append(_header("retry-after", str(retry_after_s)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=f"epp_{reason}",
        )
    )


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
