"""``[epp]``: the Endpoint Picker that Envoy asks over ext_proc (``poller epp``).

The ports are the Gateway API Inference Extension's reference picker's (9002 ext_proc,
9003 gRPC health, 9090 metrics), so an ``InferencePool``'s ``endpointPickerRef`` and an
Envoy configuration written for it carry over. docs/epp.md describes each setting.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["EppSettings"]

_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
#: A replica id goes into the shared counts' hash field (docs/schema.md).
_REPLICA_RE = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")


class EppSettings(BaseModel):
    model_config = _FROZEN

    #: Where the gRPC ports listen (0.0.0.0: every interface, as in a pod).
    host: str = "0.0.0.0"
    #: ext_proc (the Endpoint Picker Protocol).
    grpc_port: int = Field(default=9002, ge=1, le=65535)
    #: gRPC health (liveness, readiness, the ext_proc service); 0: on the ext_proc port only.
    grpc_health_port: int = Field(default=9003, ge=0, le=65535)
    #: Prometheus metrics over HTTP; 0 disables.
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    #: This replica's id in the counts the replicas share (default: hostname, pid, suffix).
    replica_id: str | None = None
    #: Endpoints named after the primary, for Envoy's override_host policy (0: the primary
    #: alone, which an ORIGINAL_DST cluster needs: it refuses a list).
    fallbacks: int = Field(default=0, ge=0, le=16)
    #: Every endpoint serving the model saturated: the least loaded still takes it (the
    #: engine queues it), or the request is refused with 429 and Retry-After ("none").
    when_saturated: Literal["least_loaded", "none"] = "least_loaded"
    #: The Retry-After of that 429, in seconds.
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    #: A request body over this many bytes is refused with 400 (read no further).
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    #: Serve ext_proc (and health) over TLS with this certificate and key (PEM files).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: How long picks go on with the last numbers after Redis stopped answering.
    stale_grace_s: float = Field(default=5.0, ge=0, le=3600)
    #: How often endpoints registered by host name are resolved again, in seconds.
    resolve_interval_s: float = Field(default=30.0, ge=1, le=3600)

    @field_validator("replica_id")
    @classmethod
    def _check_replica(cls, value: str | None) -> str | None:
        if value is not None and not _REPLICA_RE.fullmatch(value):
            raise ValueError(
                f"replica id {value[:80]!r} must be 1-200 characters from A-Z a-z 0-9 . _ : @ "
                "/ - (no spaces), e.g. the pod name"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> EppSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "tls_cert_file and tls_key_file go together: give both (TLS) or neither"
            )
        ports = [("grpc_port", self.grpc_port)]
        ports += [("grpc_health_port", self.grpc_health_port), ("metrics_port", self.metrics_port)]
        used: dict[int, str] = {}
        for name, port in ports:
            if port and port in used:
                raise ValueError(f"{name} and {used[port]} are both {port}: give each its own")
            used[port] = name
        return self
