"""Scraping against a real local HTTP server (the shared scripted test server)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from poller.config import ScrapeSettings, load_settings
from poller.errors import ConfigError, FetchError
from poller.schema.endpoint import Endpoint
from poller.scrape.http.client import KeyPolicy, Scraper, resolve_api_key
from tests.support.httpserver import HANG, HTTPServer, Pause, Request, answer, echo_headers, routes
from tests.support.paths import DATA
from tests.support.redisproc import free_port

PAGE = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()


def gzip_page(request: Request) -> bytes:
    if request.header("Accept-Encoding") == "gzip":
        return answer(200, gzip.compress(PAGE), {"Content-Encoding": "gzip"})
    return answer(200, PAGE)


def _chunk(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
SCRIPT = routes(
    {
        "/ok/metrics": answer(200, PAGE),
        "/headers/metrics": echo_headers,
        "/status500/metrics": answer(500, "boom"),
        "/status401/metrics": answer(401),
        "/redirect/metrics": answer(302, headers={"Location": "/ok/metrics"}),
        "/big-declared/metrics": answer(200, b"x" * 300_000),
        "/brotli/metrics": answer(200, b"\x0b\x02", {"Content-Encoding": "br"}),
        "/gzip/metrics": gzip_page,
        # Answers only the client's own timeout can end: whatever the machine's speed.
        "/hang/metrics": [HANG],
        "/head-then-hang/metrics": [b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n#", HANG],
        "/drip/metrics": [
            CHUNKED_HEAD,
            *[p for _ in range(100) for p in (_chunk(b"# drip\n"), Pause(0.05))],
        ],
        "/big-chunked/metrics": [CHUNKED_HEAD, *[_chunk(b"x" * 65536)] * 64, b"0\r\n\r\n"],
        "/cut/metrics": [answer(200, PAGE)[: -len(PAGE) + 1000], None],
    }
)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async with HTTPServer(SCRIPT) as running:
        yield running.url


@pytest.fixture
async def scraper() -> AsyncIterator[Scraper]:
    s = Scraper(max_body_bytes=200_000)
    yield s
    await s.aclose()


def ep(base: str, mode: str, **extra: object) -> Endpoint:
    return Endpoint.model_validate({"id": mode, "url": f"{base}/{mode}", **extra})


async def test_fetch_ok_and_keeps_the_connection(scraper: Scraper, server: str) -> None:
    for _ in range(3):
        fetched = await scraper.fetch(ep(server, "ok"), "/metrics", 2.0)
        assert fetched.body == PAGE and fetched.status == 200
        assert fetched.content_type.startswith("text/plain")


async def test_headers_sent(scraper: Scraper, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_KEY_VAR", "s3cret")
    endpoint = ep(server, "headers", api_key_env="LLMGW_KEY_VAR")
    fetched = await scraper.fetch(endpoint, "/metrics", 2.0)
    import json

    headers = json.loads(fetched.body)
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Accept-Encoding"] == "identity"
    assert headers["Accept"].startswith("text/plain;version=0.0.4")


async def test_a_same_origin_redirect_is_followed(scraper: Scraper, server: str) -> None:
    fetched = await scraper.fetch(ep(server, "redirect"), "/metrics", 2.0)
    assert fetched.status == 200 and fetched.body == PAGE


async def test_gzip_only_when_asked(scraper: Scraper, server: str) -> None:
    plain = await scraper.fetch(ep(server, "gzip"), "/metrics", 2.0)
    zipped = await scraper.fetch(ep(server, "gzip", accept_gzip=True), "/metrics", 2.0)
    assert plain.body == PAGE and zipped.body == PAGE


@pytest.mark.parametrize(
    ("mode", "reason", "words"),
    [
        ("status500", "http_status", "HTTP 500: boom"),
        ("status401", "auth", "HTTP 401"),
        ("hang", "timeout", "0.2s"),
        ("head-then-hang", "timeout", "0.2s"),
        ("drip", "timeout", "0.2s"),
        ("big-chunked", "too_large", "200000-byte cap"),
        ("big-declared", "too_large", "300000+ bytes"),
        ("cut", "unreachable", "in the middle of the body"),
        ("brotli", "parse", "unsupported Content-Encoding 'br'"),
    ],
)
async def test_failures_map_to_reasons(
    scraper: Scraper, server: str, mode: str, reason: str, words: str
) -> None:
    # Only the timeouts rely on the deadline; every other answer has time to spare.
    timeout_s = 0.2 if reason == "timeout" else 30.0
    with pytest.raises(FetchError) as err:
        await scraper.fetch(ep(server, mode), "/metrics", timeout_s)
    assert err.value.reason == reason, err.value
    assert words in err.value.detail, err.value.detail


async def test_refused_is_unreachable(scraper: Scraper) -> None:
    endpoint = Endpoint(id="gone", url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(FetchError) as err:
        await scraper.fetch(endpoint, "/metrics", 1.0)
    assert err.value.reason == "unreachable"


async def test_timeout_is_overall_not_per_read(scraper: Scraper, server: str) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(FetchError):
        await scraper.fetch(ep(server, "drip"), "/metrics", 0.3)
    assert loop.time() - started < 2.0  # the drip would take 5 s


# --- engine keys: only LLMGW_KEY_* variables and files in the key directory ------------------


def keyed(**key: str) -> Endpoint:
    return Endpoint.model_validate({"id": "k", "url": "http://127.0.0.1:9", **key})


def key_failure(endpoint: Endpoint, policy: KeyPolicy) -> str:
    with pytest.raises(FetchError) as err:
        resolve_api_key(endpoint, policy)
    assert err.value.reason == "config"
    return err.value.detail


def test_api_key_env_must_carry_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_KEY_ENGINE", "k1")
    monkeypatch.setenv("SECRET_OF_THE_HOST", "must-not-leave")
    policy = KeyPolicy.from_settings(ScrapeSettings(), {})
    assert resolve_api_key(keyed(api_key_env="LLMGW_KEY_ENGINE"), policy) == "k1"
    detail = key_failure(keyed(api_key_env="SECRET_OF_THE_HOST"), policy)
    assert detail == (
        "api_key_env SECRET_OF_THE_HOST does not start with LLMGW_KEY_: only such variables "
        "may hold engine keys (scrape.key_env_prefix)"
    )
    assert "must-not-leave" not in detail
    # The prefix is a setting; the default policy (no settings at hand) is the default rule.
    own = KeyPolicy.from_settings(ScrapeSettings(key_env_prefix="SECRET_"), {})
    assert resolve_api_key(keyed(api_key_env="SECRET_OF_THE_HOST"), own) == "must-not-leave"
    assert "LLMGW_KEY_" in key_failure(keyed(api_key_env="SECRET_OF_THE_HOST"), KeyPolicy())


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "engine-a").write_text("key-a\n")
    (tmp_path / "outside").write_text("host-secret\n")
    return keys


def test_api_key_file_inside_the_key_directory(key_dir: Path) -> None:
    policy = KeyPolicy.from_settings(ScrapeSettings(key_dir=str(key_dir)))
    assert resolve_api_key(keyed(api_key_file=str(key_dir / "engine-a")), policy) == "key-a"
    # A relative name is taken inside the key directory.
    assert resolve_api_key(keyed(api_key_file="engine-a"), policy) == "key-a"
    # Symlinks that stay inside are fine (a Kubernetes Secret volume is made of them).
    (key_dir / "..data").mkdir()
    (key_dir / "..data" / "engine-b").write_text("key-b")
    (key_dir / "engine-b").symlink_to("..data/engine-b")
    assert resolve_api_key(keyed(api_key_file="engine-b"), policy) == "key-b"


@pytest.mark.parametrize(
    "name",
    [
        "outside",  # an absolute path elsewhere (made absolute below)
        "keys/../outside",  # .. out of the directory
        "keys/link-out",  # a symlink inside that points outside
        "keys/dirlink/outside",  # a symlinked directory inside that points outside
        "keys",  # the directory itself
        "/etc/passwd",
        "/proc/self/environ",
    ],
)
def test_api_key_file_outside_the_key_directory_is_refused(key_dir: Path, name: str) -> None:
    (key_dir / "link-out").symlink_to(key_dir.parent / "outside")
    (key_dir / "dirlink").symlink_to(key_dir.parent)
    path = name if name.startswith("/") else str(key_dir.parent / name)
    policy = KeyPolicy.from_settings(ScrapeSettings(key_dir=str(key_dir)))
    detail = key_failure(keyed(api_key_file=path), policy)
    assert detail == (
        f"api_key_file {path} is not inside the key directory {key_dir}: only files there "
        "may hold engine keys (scrape.key_dir)"
    )
    # ... and relative names cannot climb out either.
    assert "not inside" in key_failure(keyed(api_key_file="../outside"), policy)


def test_a_file_outside_is_never_opened(key_dir: Path) -> None:
    # Opening a FIFO for reading blocks until a writer comes: if the poller opened it, this
    # test would hang (and fail at the per-test timeout) instead of returning at once.
    fifo = key_dir.parent / "fifo"
    os.mkfifo(fifo)
    (key_dir / "fifo-link").symlink_to(fifo)
    policy = KeyPolicy.from_settings(ScrapeSettings(key_dir=str(key_dir)))
    for path in (str(fifo), str(key_dir / "fifo-link")):
        assert "not inside the key directory" in key_failure(keyed(api_key_file=path), policy)


def test_a_fifo_inside_is_refused_without_blocking(key_dir: Path) -> None:
    os.mkfifo(key_dir / "fifo")
    (key_dir / "sub").mkdir()
    policy = KeyPolicy.from_settings(ScrapeSettings(key_dir=str(key_dir)))
    detail = key_failure(keyed(api_key_file="fifo"), policy)
    assert detail == "api_key_file fifo is not a regular file"
    assert key_failure(keyed(api_key_file="sub"), policy) == (
        "cannot read api_key_file sub: Is a directory"
    )
    assert "No such file" in key_failure(keyed(api_key_file="absent"), policy)
    (key_dir / "big").write_bytes(b"k" * 20_000)
    assert "larger than 16384 bytes" in key_failure(keyed(api_key_file="big"), policy)


def test_credentials_directory_is_the_default_key_directory(
    key_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(key_dir))
    policy = KeyPolicy.from_settings(ScrapeSettings())
    assert policy.key_dir == str(key_dir)
    assert resolve_api_key(keyed(api_key_file="engine-a"), policy) == "key-a"
    # The default rule with no settings at hand, as a Scraper without a policy uses it.
    assert resolve_api_key(keyed(api_key_file="engine-a")) == "key-a"
    assert Scraper(max_body_bytes=1024).key_policy == policy
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    detail = key_failure(
        keyed(api_key_file=str(key_dir / "engine-a")), KeyPolicy.from_settings(ScrapeSettings())
    )
    assert "not inside the key directory /etc/llmgw-poller/keys" in detail


async def test_a_refused_key_is_never_sent(
    server: str, key_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_OF_THE_HOST", "must-not-leave")
    scraper = Scraper(
        max_body_bytes=200_000,
        key_policy=KeyPolicy.from_settings(ScrapeSettings(key_dir=str(key_dir))),
    )
    try:
        for key in ({"api_key_env": "SECRET_OF_THE_HOST"}, {"api_key_file": "../outside"}):
            with pytest.raises(FetchError) as err:
                await scraper.fetch(ep(server, "headers", **key), "/metrics", 2.0)
            assert err.value.reason == "config"
        fetched = await scraper.fetch(
            ep(server, "headers", api_key_file="engine-a"), "/metrics", 2.0
        )
        assert json.loads(fetched.body)["Authorization"] == "Bearer key-a"
    finally:
        await scraper.aclose()


def test_check_is_not_bound_by_the_key_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `poller check` runs on the operator's machine with the operator's own flags.
    monkeypatch.setenv("MY_KEY", "mine")
    (tmp_path / "k").write_text("from-file")
    unrestricted = KeyPolicy.unrestricted()
    assert resolve_api_key(keyed(api_key_env="MY_KEY"), unrestricted) == "mine"
    assert resolve_api_key(keyed(api_key_file=str(tmp_path / "k")), unrestricted) == "from-file"


@pytest.mark.parametrize("value", ["aiohttp", "httpcore", "uvloop"])
def test_a_config_naming_another_http_stack_is_refused(tmp_path: Path, value: str) -> None:
    # There is one HTTP stack: a file that still names another fails to load, saying so.
    config = tmp_path / "poller.toml"
    config.write_text(f'[scrape]\nhttp_client = "{value}"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(config)
    assert str(err.value) == (
        f"{config}: scrape.http_client: {value!r} is not available: the poller has one HTTP "
        "stack, 'asyncio' (remove scrape.http_client or set it to 'asyncio')"
    )
    config.write_text('[scrape]\nhttp_client = "asyncio"\n')
    assert load_settings(config).scrape.http_client == "asyncio"
