"""The simulator's admin API (JSON, on its own loopback port), for tests in other processes.

    GET    /admin/endpoints                  [{id, engine, style, base_url, fault, hits, ...}]
    POST   /admin/endpoints                  a spec, a list of specs, or {"endpoints": [...]}
    GET    /admin/endpoints/<id>             one endpoint
    DELETE /admin/endpoints/<id>             remove it (its port closes)
    POST   /admin/endpoints/<id>/fault       {"mode": "slow", "delay_s": 3} -> the endpoint
    GET    /admin/endpoints/<id>/snapshot    the simulated truth (running, waiting, ...)
    POST   /admin/endpoints/<id>/sleep       {"level": 1|2} (default 1): vLLM sleep mode
    POST   /admin/endpoints/<id>/wake_up     awake again
    GET    /admin/queue                      every endpoint's true queue, one call (oracle)
    POST   /admin/queue/reset                peak_waiting back to the current queue
    POST   /admin/prefix                     {"prompt": "..."} or {"messages": [...]}
                                             (+ "model"?): per endpoint the prompt's
                                             cached tokens and the true queue (oracle)
    POST   /admin/prefix/reset               {} for all, or {"id": "..."}: prefix caches
                                             emptied, their counters from zero
    GET    /admin/hits                       {"hits": {id: n}, "times": {id: [unix s, ...]}}
                                             (?id=<id> for one endpoint, ?times=0 for none)
    POST   /admin/hits/reset                 {} for all, or {"id": "..."}
    GET    /admin/registry                   poller registry entries [{id, url, engine, ...}]

Errors are ``{"error": "..."}`` with 400 (bad input) or 404 (unknown endpoint).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from aiohttp import web

from poller.errors import ConfigError
from poller_lab.sim.openai import BadRequest, chat_text
from poller_lab.sim.spec import EndpointSpec


class Simulator(Protocol):
    """What the admin API drives: the simulator (server.py), named here by what it does,
    so that the server can mount this API without the two importing each other."""

    @property
    def ids(self) -> list[str]: ...

    async def add(self, spec: EndpointSpec) -> str: ...

    async def remove(self, endpoint_id: str) -> None: ...

    def spec(self, endpoint_id: str) -> EndpointSpec: ...

    def registry(self, api_key_env: str = ...) -> list[dict[str, str]]: ...

    async def set_fault(self, endpoint_id: str, mode: str, **params: Any) -> Any: ...

    def hits(self, endpoint_id: str) -> int: ...

    def hit_times(self, endpoint_id: str) -> list[float]: ...

    def reset_hits(self, endpoint_id: str | None = None) -> None: ...

    def snapshot(self, endpoint_id: str) -> NamedTuple: ...

    def sleep(self, endpoint_id: str, level: int = 1) -> None: ...

    def queues(self) -> dict[str, Any]: ...

    def prefix(self, prompt: str, model: str | None = None) -> dict[str, Any]: ...

    def reset_prefix_cache(self, endpoint_id: str | None = None) -> list[str]: ...

    def reset_peaks(self) -> None: ...

    def describe(self, endpoint_id: str) -> dict[str, Any]: ...


__all__ = ["admin_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _reply(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"request body is not JSON: {exc}") from None


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ConfigError as exc:
        return _reply({"error": str(exc)}, 400)
    except KeyError as exc:
        return _reply({"error": str(exc.args[0]) if exc.args else "not found"}, 404)


class _Admin:
    """The handlers, bound to one simulator."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    async def list_endpoints(self, request: web.Request) -> web.Response:
        return _reply([self.sim.describe(i) for i in self.sim.ids])

    async def add_endpoints(self, request: web.Request) -> web.Response:
        data = await _body(request)
        if isinstance(data, dict) and "endpoints" in data:
            data = data["endpoints"]
        items = data if isinstance(data, list) else [data]
        specs = [EndpointSpec.from_dict(item) for item in items]  # all valid, or none added
        ids = [s.id for s in specs]
        taken = sorted({i for i in ids if ids.count(i) > 1 or i in self.sim.ids})
        if taken:
            raise ConfigError(f"endpoint ids already taken: {taken}")
        for spec in specs:
            await self.sim.add(spec)
        return _reply([self.sim.describe(i) for i in ids], 201)

    async def get_endpoint(self, request: web.Request) -> web.Response:
        return _reply(self.sim.describe(request.match_info["id"]))

    async def delete_endpoint(self, request: web.Request) -> web.Response:
        endpoint_id = request.match_info["id"]
        await self.sim.remove(endpoint_id)
        return _reply({"deleted": endpoint_id})

    async def set_fault(self, request: web.Request) -> web.Response:
        endpoint_id = request.match_info["id"]
        self.sim.spec(endpoint_id)  # an unknown id is a 404 whatever the body says
        data = await _body(request)
        if not isinstance(data, dict) or not isinstance(data.get("mode"), str):
            raise ConfigError('the body must be {"mode": "<fault mode>", ...parameters}')
        params = {k: v for k, v in data.items() if k != "mode"}
        await self.sim.set_fault(endpoint_id, data["mode"], **params)
        return _reply(self.sim.describe(endpoint_id))

    async def snapshot(self, request: web.Request) -> web.Response:
        return _reply(self.sim.snapshot(request.match_info["id"])._asdict())

    async def sleep(self, request: web.Request) -> web.Response:
        endpoint_id = request.match_info["id"]
        self.sim.spec(endpoint_id)
        data = await _body(request)
        level = data.get("level", 1) if isinstance(data, dict) else None
        if level not in (1, 2) or isinstance(level, bool):
            raise ConfigError('the body must be {} or {"level": 1} or {"level": 2}')
        self.sim.sleep(endpoint_id, level)
        return _reply(self.sim.describe(endpoint_id))

    async def wake_up(self, request: web.Request) -> web.Response:
        endpoint_id = request.match_info["id"]
        self.sim.sleep(endpoint_id, 0)
        return _reply(self.sim.describe(endpoint_id))

    async def queue(self, request: web.Request) -> web.Response:
        return _reply(self.sim.queues())

    async def reset_queue(self, request: web.Request) -> web.Response:
        self.sim.reset_peaks()
        return _reply(self.sim.queues())

    async def prefix(self, request: web.Request) -> web.Response:
        data = await _body(request)
        if not isinstance(data, dict):
            raise ConfigError('the body must be {"prompt": "..."} or {"messages": [...]}')
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ConfigError("model must be a string")
        if isinstance(data.get("prompt"), str) and "messages" not in data:
            prompt = data["prompt"]
        elif "messages" in data and "prompt" not in data:
            try:
                prompt = chat_text(data)
            except BadRequest as exc:
                raise ConfigError(exc.message) from None
        else:
            raise ConfigError('the body must hold "prompt" (a string) or "messages", one')
        return _reply(self.sim.prefix(prompt, model))

    async def reset_prefix(self, request: web.Request) -> web.Response:
        data = await _body(request)
        endpoint_id = data.get("id") if isinstance(data, dict) else None
        return _reply({"reset": self.sim.reset_prefix_cache(endpoint_id)})

    async def hits(self, request: web.Request) -> web.Response:
        # A thousand endpoints' timestamps are megabytes: let callers narrow the answer.
        one = request.query.get("id")
        ids = [self.sim.spec(one).id] if one else self.sim.ids
        answer: dict[str, Any] = {"hits": {i: self.sim.hits(i) for i in ids}}
        if request.query.get("times", "1") not in ("0", "false", "no"):
            answer["times"] = {i: self.sim.hit_times(i) for i in ids}
        return _reply(answer)

    async def reset_hits(self, request: web.Request) -> web.Response:
        data = await _body(request)
        endpoint_id = data.get("id") if isinstance(data, dict) else None
        self.sim.reset_hits(endpoint_id)
        return _reply({"reset": [endpoint_id] if endpoint_id else self.sim.ids})

    async def registry(self, request: web.Request) -> web.Response:
        return _reply(self.sim.registry())


def admin_app(sim: Simulator) -> web.Application:
    admin = _Admin(sim)
    app = web.Application(middlewares=[_errors])
    app.router.add_get("/admin/endpoints", admin.list_endpoints)
    app.router.add_post("/admin/endpoints", admin.add_endpoints)
    app.router.add_get("/admin/endpoints/{id}", admin.get_endpoint)
    app.router.add_delete("/admin/endpoints/{id}", admin.delete_endpoint)
    app.router.add_post("/admin/endpoints/{id}/fault", admin.set_fault)
    app.router.add_get("/admin/endpoints/{id}/snapshot", admin.snapshot)
    app.router.add_post("/admin/endpoints/{id}/sleep", admin.sleep)
    app.router.add_post("/admin/endpoints/{id}/wake_up", admin.wake_up)
    app.router.add_get("/admin/queue", admin.queue)
    app.router.add_post("/admin/queue/reset", admin.reset_queue)
    app.router.add_post("/admin/prefix", admin.prefix)
    app.router.add_post("/admin/prefix/reset", admin.reset_prefix)
    app.router.add_get("/admin/hits", admin.hits)
    app.router.add_post("/admin/hits/reset", admin.reset_hits)
    app.router.add_get("/admin/registry", admin.registry)
    return app
