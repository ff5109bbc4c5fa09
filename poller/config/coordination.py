"""The lease and membership timings (``[coordination]``) the pollers agree on through Redis."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CoordinationSettings"]

_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class CoordinationSettings(BaseModel):
    model_config = _FROZEN

    # Chosen so a SIGKILLed poller's endpoints are written again within ~3 s at a 1 s
    # interval: its lease and membership lapse after 2 s, survivors see the membership
    # change at their next heartbeat (<= 0.5 s) and reconcile at once.
    #: A lease lapses this long after its last renewal (every write and every reconcile).
    lease_ttl_ms: int = Field(default=2000, ge=200, le=600_000)
    #: A member counts as alive this long after its last heartbeat.
    member_ttl_ms: int = Field(default=2000, ge=200, le=600_000)
    heartbeat_interval_ms: int = Field(default=500, ge=50, le=200_000)
    #: Reconcile (and renew every held lease) at least this often.
    reconcile_interval_ms: int = Field(default=1000, ge=50, le=300_000)

    @model_validator(mode="after")
    def _check(self) -> CoordinationSettings:
        if self.heartbeat_interval_ms * 3 > self.member_ttl_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be at most a third "
                f"of member_ttl_ms ({self.member_ttl_ms})"
            )
        if self.reconcile_interval_ms * 2 > self.lease_ttl_ms:
            raise ValueError(
                f"reconcile_interval_ms ({self.reconcile_interval_ms}) must be at most half "
                f"of lease_ttl_ms ({self.lease_ttl_ms}): reconcile renews the leases"
            )
        return self
