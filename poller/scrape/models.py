"""The model names an engine lists on ``/v1/models``, for engines whose page has none.

llama.cpp's llama-server and TGI label no series with a model, and trtllm-serve writes
``model_name="undefined"``; each serves the OpenAI-compatible ``/v1/models``
(docs/engines.md, "Model names"). The poller reads it once per lease, through the same
``Scraper`` as the page (the endpoint's key, TLS, URL policy and timeout), and adds the
names to the stats' ``models``. The answer is ``{"object": "list", "data": [{"id": ...},
...]}``; llama-server adds each model's ``aliases``, which are names a request may use
too. Names the view cannot hold (``poller.schema.endpoint.check_model_name``) are left
out, as are names past ``MAX_LISTED``.
"""

from __future__ import annotations

import json
from typing import Any

from poller.errors import ParseError
from poller.schema.endpoint import Endpoint, check_model_name
from poller.scrape.http.client import Scraper

__all__ = ["MAX_LISTED", "MODELS_PATH", "parse_models", "read_models"]

MODELS_PATH = "/v1/models"
#: Names kept from one answer (a router listing hundreds would bloat every stats record).
MAX_LISTED = 64


def parse_models(body: bytes) -> tuple[str, ...]:
    """The names a ``/v1/models`` answer lists, each once, in the answer's order.

    Raises ParseError when the body is not a model list (not JSON, no ``data`` list).
    """
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        first = body[:60].decode("utf-8", "replace")
        raise ParseError("the /v1/models answer is not JSON", excerpt=first) from None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ParseError('the /v1/models answer has no "data" list of models')
    names: dict[str, None] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        aliases = entry.get("aliases")
        candidates = [entry.get("id"), *(aliases if isinstance(aliases, list) else ())]
        for name in candidates:
            if isinstance(name, str) and check_model_name(name) is None:
                names.setdefault(name, None)
                if len(names) == MAX_LISTED:
                    return tuple(names)
    return tuple(names)


async def read_models(scraper: Scraper, endpoint: Endpoint, timeout_s: float) -> tuple[str, ...]:
    """GET the endpoint's ``/v1/models`` and parse it; raises the ScrapeError of the
    fetch (``FetchError``) or of the answer (``ParseError``)."""
    fetched = await scraper.fetch_path(endpoint, MODELS_PATH, timeout_s)
    return parse_models(fetched.body)
