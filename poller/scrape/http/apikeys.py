"""Engine API keys: which variables and files a registry entry may name, and reading them.

Whoever can write the registry chooses an entry's ``api_key_env``/``api_key_file``, and
the poller sends what it finds there as a bearer token. ``api_key_env`` must start with
``scrape.key_env_prefix`` and ``api_key_file`` must resolve, after symlinks, inside
``scrape.key_dir`` (``KeyPolicy``); a file outside is never opened. Keys never appear in
an error message or a log line.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from poller.config import DEFAULT_KEY_DIR, ScrapeSettings, key_directory
from poller.errors import FetchError
from poller.schema.endpoint import Endpoint

__all__ = ["MAX_KEY_FILE_BYTES", "KeyPolicy", "resolve_api_key"]

_TOKEN_RE = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """Which variables and files an entry may name as its key (``scrape.key_env_prefix``,
    ``scrape.key_dir``). Whoever can write the registry chooses ``api_key_env`` and
    ``api_key_file``, and the poller sends what it finds as a bearer token to a URL of the
    writer's choosing: without this, any variable or readable file of the poller host
    could be sent anywhere. ``None`` lifts a rule (``poller check``, where the operator
    names their own variable or file on their own machine)."""

    env_prefix: str | None = "LLMGW_KEY_"
    key_dir: str | None = DEFAULT_KEY_DIR

    @classmethod
    def from_settings(
        cls, scrape: ScrapeSettings, environ: Mapping[str, str] | None = None
    ) -> KeyPolicy:
        return cls(scrape.key_env_prefix, key_directory(scrape, environ))

    @classmethod
    def unrestricted(cls) -> KeyPolicy:
        return cls(None, None)


#: A key file larger than this is not a key (and is not read past it).
MAX_KEY_FILE_BYTES = 16 * 1024


def resolve_api_key(endpoint: Endpoint, policy: KeyPolicy | None = None) -> str | None:
    """The bearer token for an endpoint, from the poller's environment or a file.

    ``policy`` (default: the default settings' rules) decides which variables and
    files may be named; anything else is a ``config`` failure naming the rule, and a file
    outside the key directory is never opened. The key never appears in an error: a key
    that is not one header-safe word is a ``config`` failure that says where it came
    from, not what it is."""
    if policy is None:
        policy = KeyPolicy.from_settings(ScrapeSettings())
    key = _read_api_key(endpoint, policy)
    if key is not None and not _TOKEN_RE.fullmatch(key):
        source = (
            f"environment variable {endpoint.api_key_env}"
            if endpoint.api_key_env
            else f"api_key_file {endpoint.api_key_file}"
        )
        raise FetchError(
            "config",
            f"the API key in {source} is not one word of visible ASCII characters",
            endpoint=endpoint.id,
        )
    return key


def _read_api_key(endpoint: Endpoint, policy: KeyPolicy) -> str | None:
    if endpoint.api_key_env:
        name = endpoint.api_key_env
        if policy.env_prefix is not None and not name.startswith(policy.env_prefix):
            raise FetchError(
                "config",
                f"api_key_env {name} does not start with {policy.env_prefix}: only such "
                "variables may hold engine keys (scrape.key_env_prefix)",
                endpoint=endpoint.id,
            )
        value = os.environ.get(name)
        if not value:
            raise FetchError(
                "config",
                f"environment variable {name} (api_key_env) is not set",
                endpoint=endpoint.id,
            )
        return value.strip()
    if endpoint.api_key_file:
        value = _read_key_file(endpoint, endpoint.api_key_file, policy.key_dir)
        if not value:
            raise FetchError(
                "config", f"api_key_file {endpoint.api_key_file} is empty", endpoint=endpoint.id
            )
        return value
    return None


@functools.lru_cache(maxsize=16)
def _real_dir(key_dir: str) -> str:
    """The key directory with its own symlinks resolved, once per process (the files in
    it are resolved at every read)."""
    return os.path.realpath(key_dir)


def _read_key_file(endpoint: Endpoint, name: str, key_dir: str | None) -> str:
    """The stripped text of a key file, which must resolve inside ``key_dir`` (if set).

    A relative name is taken inside the key directory. The path is resolved (symlinks,
    ``..``) before anything is opened, so a file outside is never opened at all; the
    resolved path is then opened without following a last symlink and without blocking,
    and must be a regular file (a FIFO or a device is refused, not read)."""
    path = name
    if key_dir is not None:
        root = _real_dir(key_dir)
        path = os.path.realpath(os.path.join(root, name))  # an absolute name replaces root
        if os.path.commonpath([root, path]) != root or path == root:
            raise FetchError(
                "config",
                f"api_key_file {name} is not inside the key directory {key_dir}: only files "
                "there may hold engine keys (scrape.key_dir)",
                endpoint=endpoint.id,
            )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise FetchError(
                    "config", f"api_key_file {name} is not a regular file", endpoint=endpoint.id
                )
            data = file.read(MAX_KEY_FILE_BYTES + 1)
        if len(data) > MAX_KEY_FILE_BYTES:
            raise FetchError(
                "config",
                f"api_key_file {name} is larger than {MAX_KEY_FILE_BYTES} bytes",
                endpoint=endpoint.id,
            )
        return data.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
            why = "it is a symbolic link"  # only when swapped in after it was resolved
        raise FetchError(
            "config", f"cannot read api_key_file {name}: {why}", endpoint=endpoint.id
        ) from None


#: Redirects followed, within the endpoint's origin only. (The Go poller's http.Client follows
#: 10, to any host, dropping only the Authorization header on another domain.)
