"""TLS to Redis (rediss://, rediss+sentinel://) and to HTTPS engines, with trustme certs.

Every server is local: redis-server processes with a TLS port (the plain port stays open
only so RedisProcess can see the server is up) and the shared test HTTP server, over TLS,
on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from click.testing import CliRunner

import poller.cli.run as run_module
import poller.service.serve as serve_module
from poller.cli.app import cli
from poller.config import RedisSettings, Settings, load_settings
from poller.errors import ConfigError, FetchError, StoreError
from poller.reader import StatsReader, SyncStatsReader
from poller.schema.endpoint import Endpoint, endpoint_from_json
from poller.scrape.http.client import Scraper
from poller.store.store import RedisStore
from poller_lab.embedded import free_port
from tests.support.httpserver import HTTPServer, Request, answer
from tests.support.paths import DATA
from tests.support.redisproc import RedisProcess, redis_server_binary

PAGE = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()
FIELDS = {"engine": "vllm", "running": "3", "waiting": "1", "interval_ms": "1000"}


@dataclass(frozen=True)
class Pki:
    ca: Path  # signed every certificate below
    other_ca: Path  # trusted by nobody here
    server_cert: Path  # 127.0.0.1 and localhost
    server_key: Path
    wrong_name_cert: Path  # valid, but for db.example only
    wrong_name_key: Path
    client_cert: Path
    client_key: Path
    client_pem: Path  # certificate and key in one file
    trustme_ca: trustme.CA
    server: trustme.LeafCert
    wrong_name: trustme.LeafCert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    wrong_name = ca.issue_cert("db.example")
    client = ca.issue_cert("poller-client@example")

    def write(name: str, blob: trustme.Blob) -> Path:
        path = root / name
        blob.write_to_path(str(path))
        return path

    client_pem = root / "client.pem"
    client_pem.write_bytes(client.private_key_pem.bytes() + client.cert_chain_pems[0].bytes())
    return Pki(
        ca=write("ca.pem", ca.cert_pem),
        other_ca=write("other-ca.pem", other.cert_pem),
        server_cert=write("server.crt", server.cert_chain_pems[0]),
        server_key=write("server.key", server.private_key_pem),
        wrong_name_cert=write("wrong.crt", wrong_name.cert_chain_pems[0]),
        wrong_name_key=write("wrong.key", wrong_name.private_key_pem),
        client_cert=write("client.crt", client.cert_chain_pems[0]),
        client_key=write("client.key", client.private_key_pem),
        client_pem=client_pem,
        trustme_ca=ca,
        server=server,
        wrong_name=wrong_name,
    )


# --- Redis ------------------------------------------------------------------------------


class TlsRedis:
    """A redis-server with a TLS port (and its plain port, used only to see it is up)."""

    def __init__(self, pki: Pki, *, auth_clients: str = "no", wrong_name: bool = False):
        redis_server_binary()  # the loud install hint when it is missing
        self.tls_port = free_port()
        cert, key = (
            (pki.wrong_name_cert, pki.wrong_name_key)
            if wrong_name
            else (pki.server_cert, pki.server_key)
        )
        self.proc = RedisProcess(extra_args=_tls_args(self.tls_port, pki, cert, key, auth_clients))

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    def start(self) -> TlsRedis:
        try:
            self.proc.start()
        except RuntimeError as exc:  # a redis-server built without TLS rejects the options
            raise RuntimeError(
                "redis-server could not start with TLS (built without it?); the TLS tests "
                f"need a redis-server with TLS support:\n{exc}"
            ) from exc
        return self


def _tls_args(port: int, pki: Pki, cert: Path, key: Path, auth_clients: str) -> list[str]:
    return [
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(pki.ca),
        "--tls-auth-clients",
        auth_clients,
    ]


@pytest.fixture(scope="module")
def tls_redis(pki: Pki) -> Iterator[TlsRedis]:
    server = TlsRedis(pki).start()
    yield server
    server.proc.cleanup()


@pytest.fixture(scope="module")
def mtls_redis(pki: Pki) -> Iterator[TlsRedis]:
    server = TlsRedis(pki, auth_clients="yes").start()
    yield server
    server.proc.cleanup()


@asynccontextmanager
async def opened(settings: RedisSettings) -> AsyncIterator[RedisStore]:
    store = RedisStore.from_settings(settings)
    try:
        yield store
    finally:
        await store.close()


async def test_store_works_over_tls(tls_redis: TlsRedis, pki: Pki) -> None:
    settings = RedisSettings(url=tls_redis.url, namespace="tls", tls_ca_file=str(pki.ca))
    async with opened(settings) as store:
        await store.ensure_schema()
        assert (await store.heartbeat("p1", 2000)).members == ["p1"]
        await store.put_endpoint(Endpoint(id="e1", url="https://127.0.0.1:8443"))
        [lease] = await store.acquire_leases("p1", ["e1"], 2000)
        assert lease.token is not None
        written = await store.write_stats(
            "e1", "p1", lease.token, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000
        )
        assert written.accepted
        stale = await store.write_stats(
            "e1", "p1", lease.token + 1, FIELDS, lease_ttl_ms=2000, stats_ttl_ms=3000
        )
        assert not stale.accepted  # fencing works the same over TLS
        view = await StatsReader(store.client, "tls").snapshot()
        assert view["e1"].state == "fresh" and view["e1"].owner == "p1"
        assert view.pollers == ["p1"]


@pytest.mark.parametrize(
    ("ca", "words"),
    [
        ("other", "certificate verify failed"),  # a CA that did not sign it
        (None, "certificate verify failed"),  # the system trust store does not know it
    ],
)
async def test_unverifiable_server_is_a_store_error_naming_tls(
    tls_redis: TlsRedis, pki: Pki, ca: str | None, words: str
) -> None:
    # The connect timeout only ends a hang: the verdict is the handshake's.
    settings = RedisSettings(
        url=tls_redis.url, tls_ca_file=str(pki.other_ca) if ca else None, connect_timeout_s=30
    )
    async with opened(settings) as store:
        async with asyncio.timeout(15):  # fails at the handshake, never hangs
            with pytest.raises(StoreError, match=words) as err:
                await store.heartbeat("p1", 2000)
    assert "SSL" in str(err.value)


@pytest.mark.redis_server
async def test_host_name_is_verified(pki: Pki) -> None:
    server = TlsRedis(pki, wrong_name=True).start()
    try:
        settings = RedisSettings(url=server.url, tls_ca_file=str(pki.ca), connect_timeout_s=30)
        async with opened(settings) as store:
            with pytest.raises(StoreError, match="certificate verify failed") as err:
                await store.ping()
        assert "127.0.0.1" in str(err.value)  # "IP address mismatch ... '127.0.0.1'"
    finally:
        server.proc.cleanup()


async def test_insecure_connects_and_warns_once(
    tls_redis: TlsRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="poller.store.store")
    async with opened(RedisSettings(url=tls_redis.url, tls_insecure=True)) as store:
        assert await store.ping()
        await store.heartbeat("p1", 2000)
    warnings = [r for r in caplog.records if "tls_insecure" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


async def test_verified_connection_does_not_warn(
    tls_redis: TlsRedis, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="poller.store.store")
    async with opened(RedisSettings(url=tls_redis.url, tls_ca_file=str(pki.ca))) as store:
        assert await store.ping()
    assert not [r for r in caplog.records if "tls_insecure" in r.getMessage()]


@pytest.mark.parametrize("form", ["cert+key", "one-pem"])
async def test_client_certificate_auth(mtls_redis: TlsRedis, pki: Pki, form: str) -> None:
    files = (
        {"tls_cert_file": str(pki.client_cert), "tls_key_file": str(pki.client_key)}
        if form == "cert+key"
        else {"tls_cert_file": str(pki.client_pem)}
    )
    settings = RedisSettings(url=mtls_redis.url, tls_ca_file=str(pki.ca), **files)
    async with opened(settings) as store:
        assert await store.ping()
        await store.heartbeat("p1", 2000)


async def test_client_certificate_required(mtls_redis: TlsRedis, pki: Pki) -> None:
    # Generous timeouts: the verdict is the server's refusal, never a timeout.
    settings = RedisSettings(
        url=mtls_redis.url, tls_ca_file=str(pki.ca), connect_timeout_s=30, socket_timeout_s=30
    )
    async with opened(settings) as store:
        async with asyncio.timeout(15):  # refused, never hangs
            # TLS 1.3 sends the server's refusal after the handshake: depending on timing
            # the client reads the alert or finds the connection already reset.
            with pytest.raises(StoreError, match="CERTIFICATE_REQUIRED|reset by peer"):
                await store.ping()


@pytest.mark.sentinel
async def test_sentinel_over_tls(pki: Pki, tmp_path: Path) -> None:
    """rediss+sentinel://: TLS to the sentinel and to the master it names."""
    master = TlsRedis(pki).start()
    s_tls = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"sentinel monitor mymaster 127.0.0.1 {master.tls_port} 1\n"
        "sentinel down-after-milliseconds mymaster 5000\n"
        "tls-replication yes\n"  # the sentinel itself talks TLS to the master
        f"tls-port {s_tls}\n"
        f"tls-cert-file {pki.server_cert}\n"
        f"tls-key-file {pki.server_key}\n"
        f"tls-ca-cert-file {pki.ca}\n"
        "tls-auth-clients no\n"
    )
    sentinel = RedisProcess(config_file=conf, extra_args=["--sentinel"]).start()
    try:
        url = f"rediss+sentinel://127.0.0.1:{s_tls}/mymaster/0"
        async with opened(RedisSettings(url=url, tls_ca_file=str(pki.ca))) as store:
            await store.ensure_schema()
            await store.heartbeat("p1", 2000)
        # Without the CA the sentinel cannot be verified. redis-py reports it as "No master
        # found" (it drops the sentinel's error text); it must at least fail fast, not
        # after redis-py's default retries with backoff (~9 s). The handshake fails at
        # once: the connect timeout only ends a hang, and the bound below is the behaviour.
        bad = RedisSettings(url=url, connect_timeout_s=30)
        async with opened(bad) as store:
            async with asyncio.timeout(6):
                with pytest.raises(StoreError, match="No master found"):
                    await store.ping()
    finally:
        sentinel.cleanup()
        master.proc.cleanup()


# --- Redis TLS settings --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"redis.tls_ca_file": "CA"}, "tls_ca_file needs a rediss:// or rediss+sentinel:// URL"),
        ({"redis.tls_insecure": True}, "tls_insecure needs a rediss://"),
        (
            {"redis.url": "rediss://h:6380", "redis.tls_key_file": "KEY"},
            "tls_key_file needs tls_cert_file",
        ),
        (
            {"redis.url": "rediss://h:6380", "redis.tls_ca_file": "CA", "redis.tls_insecure": 1},
            "tls_ca_file would be ignored",
        ),
        (
            {"redis.url": "rediss://h:6380", "redis.tls_ca_file": "/nonexistent/ca.pem"},
            "tls_ca_file: cannot read '/nonexistent/ca.pem': No such file",
        ),
    ],
)
def test_bad_tls_settings_are_config_errors(
    pki: Pki, overrides: dict[str, object], words: str
) -> None:
    overrides = {
        k: str(pki.ca) if v == "CA" else str(pki.client_key) if v == "KEY" else v
        for k, v in overrides.items()
    }
    with pytest.raises(ConfigError) as err:
        load_settings(None, overrides, {})
    assert str(err.value).startswith("redis: ") and words in str(err.value)


def test_tls_settings_from_the_environment(pki: Pki) -> None:
    env = {
        "POLLER_REDIS__URL": "rediss+sentinel://h:26379/m",
        "POLLER_REDIS__TLS_CA_FILE": str(pki.ca),
        "POLLER_REDIS__TLS_CERT_FILE": str(pki.client_cert),
        "POLLER_REDIS__TLS_KEY_FILE": str(pki.client_key),
    }
    redis = load_settings(None, None, env).redis
    assert (redis.tls_ca_file, redis.tls_cert_file, redis.tls_key_file) == (
        str(pki.ca),
        str(pki.client_cert),
        str(pki.client_key),
    )
    assert not redis.tls_insecure


def test_run_flags_reach_the_settings(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[Settings] = []

    async def fake_serve(settings: Settings) -> int:
        seen.append(settings)
        return 0

    # `poller run` imports the service stack when it runs: patch it where it lives
    monkeypatch.setattr(serve_module, "serve", fake_serve)
    monkeypatch.setattr(run_module, "setup_logging", lambda *a: None)
    base = ["run", "--redis-url", "rediss://127.0.0.1:6380/0", "--health-port", "0"]
    runner = CliRunner()
    done = runner.invoke(
        cli,
        [
            *base,
            "--redis-tls-ca",
            str(pki.ca),
            "--redis-tls-cert",
            str(pki.client_cert),
            "--redis-tls-key",
            str(pki.client_key),
        ],
        env={},
    )
    assert done.exit_code == 0, done.output
    redis = seen[0].redis
    assert redis.tls_ca_file == str(pki.ca) and redis.tls_key_file == str(pki.client_key)
    assert not redis.tls_insecure
    done = runner.invoke(cli, [*base, "--redis-tls-insecure"], env={})
    assert done.exit_code == 0 and seen[1].redis.tls_insecure
    done = runner.invoke(cli, [*base, "--redis-tls-ca", str(tmp_path / "none.pem")])
    assert done.exit_code == 2 and "cannot read" in done.output


# --- HTTPS engines ------------------------------------------------------------------------


def server_context(cert: trustme.LeafCert) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    return context


@asynccontextmanager
async def https_server(cert: trustme.LeafCert) -> AsyncIterator[str]:
    """An HTTPS server on 127.0.0.1 serving a vLLM page on every path."""
    async with HTTPServer(lambda r: answer(200, PAGE), tls=server_context(cert)) as server:
        yield server.url


@pytest.fixture
async def engine(pki: Pki) -> AsyncIterator[str]:
    async with https_server(pki.server) as url:
        yield url


@pytest.fixture
async def scraper() -> AsyncIterator[Scraper]:
    s = Scraper(max_body_bytes=200_000)
    yield s
    await s.aclose()


def ep(url: str, endpoint_id: str = "e1", **tls: object) -> Endpoint:
    return Endpoint.model_validate({"id": endpoint_id, "url": url, **tls})


async def test_https_verified_with_the_ca_file(scraper: Scraper, engine: str, pki: Pki) -> None:
    for _ in range(2):
        fetched = await scraper.fetch(ep(engine, tls_ca_file=str(pki.ca)), "/metrics", 2.0)
        assert fetched.status == 200 and fetched.body == PAGE


@pytest.mark.parametrize("ca", [None, "other"])
async def test_https_unverifiable_is_unreachable_naming_tls(
    scraper: Scraper, engine: str, pki: Pki, ca: str | None
) -> None:
    endpoint = ep(engine, **({"tls_ca_file": str(pki.other_ca)} if ca else {}))
    with pytest.raises(FetchError) as err:
        await scraper.fetch(endpoint, "/metrics", 2.0)
    assert err.value.reason == "unreachable"
    assert err.value.detail.startswith("TLS certificate verification failed: ")
    assert "tls_ca_file" in err.value.detail


async def test_https_host_name_is_verified(scraper: Scraper, pki: Pki) -> None:
    async with https_server(pki.wrong_name) as url:
        with pytest.raises(FetchError) as err:
            await scraper.fetch(ep(url, tls_ca_file=str(pki.ca)), "/metrics", 2.0)
    assert err.value.reason == "unreachable"
    assert "TLS certificate verification failed" in err.value.detail
    assert "127.0.0.1" in err.value.detail  # "IP address mismatch, ... '127.0.0.1'"


async def test_https_insecure_fetches_and_warns_once_per_endpoint(
    scraper: Scraper, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="poller.scrape.http.client")
    for endpoint_id in ("a", "a", "b"):
        fetched = await scraper.fetch(ep(engine, endpoint_id, tls_insecure=True), "/metrics", 2.0)
        assert fetched.body == PAGE
    warned = [r.getMessage() for r in caplog.records if "tls_insecure" in r.getMessage()]
    assert len(warned) == 2 and "endpoint=a" in warned[0] and "endpoint=b" in warned[1]


async def test_tls_settings_do_not_leak_between_endpoints(
    scraper: Scraper, engine: str, pki: Pki
) -> None:
    """A pooled verified connection must not serve an endpoint that would fail."""
    trusted = ep(engine, "trusted", tls_ca_file=str(pki.ca))
    assert (await scraper.fetch(trusted, "/metrics", 2.0)).status == 200
    with pytest.raises(FetchError, match="TLS certificate verification failed"):
        await scraper.fetch(ep(engine, "plain"), "/metrics", 2.0)
    assert (await scraper.fetch(trusted, "/metrics", 2.0)).status == 200


async def test_changed_tls_settings_take_effect(scraper: Scraper, engine: str, pki: Pki) -> None:
    with pytest.raises(FetchError):
        await scraper.fetch(ep(engine, "e1"), "/metrics", 2.0)
    fetched = await scraper.fetch(ep(engine, "e1", tls_ca_file=str(pki.ca)), "/metrics", 2.0)
    assert fetched.status == 200


async def test_unreadable_ca_file_is_a_config_failure(
    scraper: Scraper, engine: str, tmp_path: Path
) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    for path, words in ((tmp_path / "missing.pem", "No such file"), (not_pem, "")):
        with pytest.raises(FetchError) as err:
            await scraper.fetch(ep(engine, tls_ca_file=str(path)), "/metrics", 2.0)
        assert err.value.reason == "config"
        assert err.value.detail.startswith(f"cannot use tls_ca_file {path}: ") and words in (
            err.value.detail
        )


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"url": "http://e:8000", "tls_ca_file": "/ca.pem"}, "need an https URL"),
        ({"url": "http://e:8000", "tls_insecure": True}, "need an https URL"),
        (
            {"url": "https://e:8443", "tls_ca_file": "/ca.pem", "tls_insecure": True},
            "not both",
        ),
    ],
)
def test_endpoint_tls_fields_are_validated(entry: dict[str, object], words: str) -> None:
    import json

    with pytest.raises(ConfigError, match=words):
        endpoint_from_json("e1", json.dumps(entry))


def test_endpoint_tls_fields_round_trip() -> None:
    endpoint = Endpoint(id="e1", url="https://e:8443", tls_ca_file="/etc/ca.pem")
    assert endpoint_from_json("e1", endpoint.to_json()) == endpoint
    assert "tls_insecure" not in endpoint.to_json()  # defaults stay out of the entry
    insecure = Endpoint(id="e2", url="HTTPS://e:8443", tls_insecure=True)
    assert endpoint_from_json("e2", insecure.to_json()).tls_insecure


def test_check_command_takes_tls_options(pki: Pki) -> None:
    """`poller check` against a local HTTPS engine, verified with --tls-ca-file."""

    async def serve_and_check() -> tuple[int, str, int, str]:
        async with https_server(pki.server) as url:
            runner = CliRunner()
            args = ["check", url, "--engine", "vllm", "--timeout", "5"]
            ok = await asyncio.to_thread(runner.invoke, cli, [*args, "--tls-ca-file", str(pki.ca)])
            bad = await asyncio.to_thread(runner.invoke, cli, args)
            return ok.exit_code, ok.output, bad.exit_code, bad.output

    # `poller check` runs its own event loop, so it runs in a thread beside the server's.
    ok_code, ok_out, bad_code, bad_out = asyncio.run(serve_and_check())
    assert ok_code == 0, ok_out
    assert bad_code == 1 and "TLS certificate verification failed" in bad_out


async def test_readers_and_status_take_the_tls_settings(tls_redis: TlsRedis, pki: Pki) -> None:
    settings = RedisSettings(url=tls_redis.url, tls_ca_file=str(pki.ca), namespace="rt")
    reader = StatsReader.from_settings(settings)
    try:
        assert (await reader.snapshot()).endpoints == {}
    finally:
        await reader.aclose()
    sync_reader = SyncStatsReader.from_settings(settings)
    try:
        assert sync_reader.snapshot().endpoints == {}
    finally:
        sync_reader.close()
    env = {"POLLER_REDIS_URL": tls_redis.url, "POLLER_REDIS__TLS_CA_FILE": str(pki.ca)}
    result = await asyncio.to_thread(
        CliRunner().invoke, cli, ["status", "--json", "--namespace", "rt"], env=env
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["endpoints"] == []


async def test_https_redirects_stay_on_https_and_never_downgrade(
    scraper: Scraper, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the https origin a redirect is followed; to http on the same host and port
    (a downgrade that would send the key in clear text) it is refused."""
    monkeypatch.setenv("LLMGW_KEY_TLS_TEST", "tls-key")
    seen: list[tuple[str, str | None]] = []

    def handle(request: Request) -> bytes:
        seen.append((request.path, request.header("Authorization")))
        if request.path == "/moved/metrics":
            return answer(301, headers={"Location": "/metrics"})
        if request.path == "/plain/metrics":
            host = request.header("Host")
            return answer(302, headers={"Location": f"http://{host}/"})
        return answer(200, PAGE)

    extra = {"tls_ca_file": str(pki.ca), "api_key_env": "LLMGW_KEY_TLS_TEST"}
    async with HTTPServer(handle, tls=server_context(pki.server)) as server:
        base = server.url
        fetched = await scraper.fetch(ep(f"{base}/moved", **extra), "/metrics", 2.0)
        assert fetched.body == PAGE
        with pytest.raises(FetchError) as err:
            await scraper.fetch(ep(f"{base}/plain", **extra), "/metrics", 2.0)
    assert err.value.reason == "http_status"
    assert err.value.detail.startswith(f"HTTP 302 redirect to {base.replace('https', 'http')},")
    assert seen == [
        ("/moved/metrics", "Bearer tls-key"),
        ("/metrics", "Bearer tls-key"),
        ("/plain/metrics", "Bearer tls-key"),
    ]
