"""Reading an engine's /v1/models: the answers of each engine's own source, names the view
cannot hold, and the fetch under the page's rules (key, redirects, allowlist, timeout,
body cap) against the shared scripted test server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from poller.errors import FetchError, ParseError
from poller.schema.endpoint import Endpoint
from poller.scrape.http.client import Scraper
from poller.scrape.models import MAX_LISTED, parse_models, read_models
from tests.support.httpserver import HANG, HTTPServer, answer, routes


def body(data: object) -> bytes:
    return json.dumps(data).encode()


# --- the answers engines give --------------------------------------------------------------

# llama-server (tools/server/server-context.cpp, get_res_models): "models" for Ollama
# clients, "data" for OpenAI ones, each model with its aliases.
LLAMA_SERVER = {
    "models": [{"name": "qwen3-8b", "model": "qwen3-8b"}],
    "object": "list",
    "data": [
        {
            "id": "qwen3-8b",
            "aliases": ["Qwen/Qwen3-8B", "qwen3"],
            "tags": [],
            "object": "model",
            "owned_by": "llamacpp",
            "meta": {"n_ctx": 4096},
        }
    ],
}
# TGI (router/src/server.rs, openai_get_model_info): one model, its --model-id.
TGI = {
    "object": "list",
    "data": [
        {
            "id": "meta-llama/Llama-3.1-8B-Instruct",
            "object": "model",
            "created": 0,
            "owned_by": "meta-llama/Llama-3.1-8B-Instruct",
        }
    ],
}
# LMDeploy (lmdeploy/serve/openai/api_server.py, available_models): the model, then its
# LoRA adapters.
LMDEPLOY = {
    "object": "list",
    "data": [
        {"id": "internlm/internlm2_5-7b-chat", "root": "internlm/internlm2_5-7b-chat"},
        {"id": "my-adapter", "root": "my-adapter"},
    ],
}


@pytest.mark.parametrize(
    ("answer_", "names"),
    [
        (LLAMA_SERVER, ("qwen3-8b", "Qwen/Qwen3-8B", "qwen3")),
        (TGI, ("meta-llama/Llama-3.1-8B-Instruct",)),
        (LMDEPLOY, ("internlm/internlm2_5-7b-chat", "my-adapter")),
        ({"object": "list", "data": []}, ()),
    ],
    ids=["llama-server", "tgi", "lmdeploy", "empty"],
)
def test_each_engines_answer_gives_its_names(answer_: object, names: tuple[str, ...]) -> None:
    assert parse_models(body(answer_)) == names


def test_names_the_view_cannot_hold_are_left_out_and_the_rest_kept_once() -> None:
    listed = {
        "data": [
            {"id": "a"},
            {"id": "a"},  # twice: once
            {"id": "with,comma"},  # the stats list is comma-separated
            {"id": "with space"},
            {"id": ""},
            {"id": "x" * 300},
            {"id": 7},
            "not an object",
            {"no": "id", "aliases": ["b", 3, "b"]},
            {"id": "c", "aliases": "not a list"},
        ]
    }
    assert parse_models(body(listed)) == ("a", "b", "c")


def test_a_long_listing_is_cut_at_the_limit() -> None:
    listed = {"data": [{"id": f"m{i}"} for i in range(MAX_LISTED + 10)]}
    assert parse_models(body(listed)) == tuple(f"m{i}" for i in range(MAX_LISTED))


@pytest.mark.parametrize(
    "raw",
    [b"<html>not found</html>", b"[1, 2]", b'{"object": "list"}', b'{"data": {}}', b"\xff\xfe"],
)
def test_an_answer_that_is_no_model_list_is_a_parse_error(raw: bytes) -> None:
    with pytest.raises(ParseError) as caught:
        parse_models(raw)
    assert caught.value.reason == "parse"
    assert "/v1/models" in caught.value.detail


# --- the fetch -----------------------------------------------------------------------------


SCRIPT = routes(
    {
        "/tgi/v1/models": answer(200, body(TGI), content_type="application/json"),
        "/moved/v1/models": answer(302, headers={"Location": "/tgi/v1/models"}),
        "/away/v1/models": answer(302, headers={"Location": "http://example.invalid/v1/models"}),
        "/missing/v1/models": answer(404),
        "/hang/v1/models": [HANG],
        "/big/v1/models": answer(200, b"x" * 5000),
    }
)


@pytest.fixture
async def server() -> AsyncIterator[HTTPServer]:
    async with HTTPServer(SCRIPT) as running:
        yield running


@pytest.fixture
async def scraper() -> AsyncIterator[Scraper]:
    s = Scraper(max_body_bytes=4096)
    yield s
    await s.aclose()


def ep(server: HTTPServer, mode: str, **extra: object) -> Endpoint:
    return Endpoint.model_validate(
        {"id": mode, "url": f"{server.url}/{mode}", "engine": "tgi", **extra}
    )


async def test_the_names_are_read_from_the_endpoints_base_url(
    server: HTTPServer, scraper: Scraper
) -> None:
    names = await read_models(scraper, ep(server, "tgi", metrics_path="/other"), 5.0)
    assert names == ("meta-llama/Llama-3.1-8B-Instruct",)
    # the base URL's /v1/models, whatever the entry's metrics_path
    assert [r.target for r in server.requests] == ["/tgi/v1/models"]


async def test_the_read_sends_the_endpoints_key_and_asks_for_json(
    server: HTTPServer, scraper: Scraper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_KEY_MODELS", "s3cret")
    await read_models(scraper, ep(server, "tgi", api_key_env="LLMGW_KEY_MODELS"), 5.0)
    (request,) = server.requests
    assert request.header("Authorization") == "Bearer s3cret"
    assert request.header("Accept") == "application/json"


async def test_redirects_are_followed_within_the_origin_only(
    server: HTTPServer, scraper: Scraper
) -> None:
    assert await read_models(scraper, ep(server, "moved"), 5.0) == (
        "meta-llama/Llama-3.1-8B-Instruct",
    )
    with pytest.raises(FetchError) as caught:
        await read_models(scraper, ep(server, "away"), 5.0)
    assert "example.invalid" in caught.value.detail


async def test_a_host_outside_the_allowlist_is_never_contacted(server: HTTPServer) -> None:
    scraper = Scraper(max_body_bytes=4096, allowed_hosts=("10.0.0.0/8",))
    try:
        with pytest.raises(FetchError) as caught:
            await read_models(scraper, ep(server, "tgi"), 5.0)
    finally:
        await scraper.aclose()
    assert caught.value.reason == "config"
    assert server.requests == []


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("missing", "http_status"), ("hang", "timeout"), ("big", "too_large")],
)
async def test_a_failed_read_raises_the_fetch_reason(
    server: HTTPServer, scraper: Scraper, mode: str, reason: str
) -> None:
    with pytest.raises(FetchError) as caught:
        # the hanging answer: only the client's own timeout ends it, whatever the machine
        await read_models(scraper, ep(server, mode), 0.5)
    assert caught.value.reason == reason


async def test_the_pages_prepared_request_is_left_alone(
    server: HTTPServer, scraper: Scraper
) -> None:
    endpoint = ep(server, "tgi")
    await read_models(scraper, endpoint, 5.0)
    assert endpoint.id not in scraper._requests  # the page's request is not replaced
