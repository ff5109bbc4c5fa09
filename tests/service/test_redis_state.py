"""The rule for a refusal of our credentials (poller/service/redis_state.py): it stops the
poller only when Redis never allowed what it refuses, and it is over at the next pass that
makes every call the leases need, or after a hold without one."""

from __future__ import annotations

import logging

import pytest

from poller.errors import StoreAuthError, StoreUnreachable
from poller.service.redis_state import RedisState, Refusals

LOGIN = StoreAuthError("Redis refused authentication: WRONGPASS", kind="authentication")
ACL = StoreAuthError("Redis refused permission (ACL): NOPERM", kind="permission")
HOLD_S = 6.0  # three lease TTLs of 2 s


def test_before_any_call_succeeded_every_refusal_is_the_settings() -> None:
    rule = Refusals(lease_ttl_ms=2000)
    assert rule.hold_s == HOLD_S
    assert rule.fatal(LOGIN, 0.0) and rule.fatal(ACL, 0.0)


def test_a_login_refused_after_one_succeeded_is_a_change_on_redis_side() -> None:
    rule = Refusals(lease_ttl_ms=2000)
    rule.allowed(0.0)  # the first heartbeat: the password worked
    assert not rule.fatal(LOGIN, 0.1)
    # An ACL without a command the poller has not made yet (a renewal) is still the
    # settings' mistake, until a pass made every call once.
    assert rule.fatal(ACL, 0.1)


def test_a_complete_pass_or_a_hold_since_the_first_pass_settles_the_poller() -> None:
    rule = Refusals(lease_ttl_ms=2000)
    rule.passed(10.0, complete=False)  # acquired, nothing renewed yet
    assert rule.fatal(ACL, 10.0 + HOLD_S - 0.1)
    assert not rule.fatal(ACL, 10.0 + HOLD_S)
    renewed = Refusals(lease_ttl_ms=2000)
    renewed.passed(10.0, complete=True)
    assert not renewed.fatal(ACL, 10.0) and not renewed.fatal(LOGIN, 10.0)


def test_a_refusal_ends_at_the_next_complete_pass_not_at_the_calls_between() -> None:
    rule = Refusals(lease_ttl_ms=2000)
    rule.passed(0.0, complete=True)
    rule.refused(ACL, 1.0)
    rule.allowed(1.5)  # a heartbeat the ACL allows
    rule.passed(2.0, complete=False)  # a pass that only acquired what lapsed
    assert rule.in_force
    rule.passed(2.5, complete=True)  # a renewal went through: the ACL is whole again
    assert not rule.in_force


def test_without_a_complete_pass_a_refusal_ends_a_hold_after_the_last_one() -> None:
    rule = Refusals(lease_ttl_ms=2000)
    rule.passed(0.0, complete=True)
    rule.refused(LOGIN, 1.0)
    rule.allowed(1.0 + HOLD_S - 0.1)
    assert rule.in_force
    rule.allowed(1.0 + HOLD_S)
    assert not rule.in_force


def test_the_state_is_logged_once_per_change_and_held_while_a_refusal_is_in_force(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up: list[float] = []
    state = RedisState(lease_ttl_ms=2000, set_up=up.append)
    assert not state.ok and state.problem == "Redis not reached yet"
    with caplog.at_level(logging.INFO):
        state.seen(None, 0.0)
        state.refusals.passed(0.0, complete=True)
        state.seen(LOGIN, 1.0)
        state.seen(LOGIN, 1.2)
        state.seen(None, 1.5)  # allowed, but the refusal is in force: still not ok
        assert not state.ok and state.problem == str(LOGIN)
        state.refusals.passed(2.0, complete=True)
        state.seen(None, 2.0)
        state.seen(StoreUnreachable("Redis unreachable during heartbeat: timeout"), 3.0)
        state.seen(None, 4.0)
    said = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert said == [
        ("INFO", "redis reachable"),
        ("ERROR", "Redis refused authentication"),
        ("INFO", "redis reachable"),
        ("WARNING", "redis unreachable"),
        ("INFO", "redis reachable"),
    ]
    assert state.ok and up[-1] == 1
