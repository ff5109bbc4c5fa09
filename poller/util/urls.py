"""URLs as logs and error messages may print them: without their secrets.

``redact_url`` is the one redactor of the package: the Redis URL in the poller's logs and
errors, in ``poller run --check`` and in a gateway's log line, and any http(s) URL.
"""

from __future__ import annotations

import re

__all__ = ["redact_url"]

#: What a redacted secret is replaced by.
HIDDEN = "***"

# ``password=`` and ``sentinel_password=`` (redis-py and the sentinel form read both from
# the query), in any case.
_QUERY_SECRET = re.compile(r"(^|[?&;])([^=&;#]*password[^=&;#]*)=([^&;#]*)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***``; nothing else changes.

    The user name is kept (it says which ACL user connects), and so is the rest as it
    was written: every host of a sentinel list, IPv6 brackets, ports, path and query. A
    password is the text after the first ``:`` of the user information (up to the last
    ``@`` before the path), or the value of a ``password`` or ``sentinel_password`` query
    parameter. Text that is not a URL (a mistyped scheme) is redacted the same way.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:  # "redis:/u:pw@h": the user information is still the text before the "@"
        scheme, rest = "", url
    end = len(rest)
    for stop in "/?#" if sep else "?#":
        index = rest.find(stop)
        if index >= 0:
            end = min(end, index)
    authority, tail = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    if at:
        if sep:
            user, colon, _ = userinfo.partition(":")
        else:
            user, colon, _ = userinfo.rpartition(":")
        if colon:
            authority = f"{user}:{HIDDEN}@{hosts}"
    head = f"{scheme}://" if sep else ""
    return head + authority + _redact_query(tail)


def _redact_query(tail: str) -> str:
    path, question, query = tail.partition("?")
    if not question:
        return tail
    query, hash_, fragment = query.partition("#")
    query = _QUERY_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}={HIDDEN}", query)
    return f"{path}?{query}{hash_}{fragment}"
