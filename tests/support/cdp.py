"""Headless Chromium for tests, driven over the DevTools protocol (CDP).

A small helper instead of a browser-automation package: the protocol is JSON over one
websocket, and aiohttp (already a dependency of the service) speaks websockets, so the
test needs no driver binary and no new package. Chromium gets a fresh empty profile and
loopback-only flags; it is stopped by pid. A missing Chromium is a loud failure with the
install hint, never a skip. Only a test marked ``chromium`` may start one
(tests/support/markers.py).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.markers import require

INSTALL_HINT = (
    "chromium not found on PATH: the browser test needs it. Install it "
    "(Debian/Ubuntu: apt-get install chromium) or run `make test`, which installs it."
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1500,1000",
]


def chromium_binary() -> str:
    """The Chromium to start; only a test marked ``chromium`` may ask for it."""
    require("chromium", "a headless Chromium")
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    raise RuntimeError(INSTALL_HINT)


class Browser:
    """One headless Chromium with one page; ``async with Browser() as b: ...``."""

    def __init__(self) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="poller-chromium-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.session = ""
        #: Console and log entries the page produced (CSP violations land here).
        self.log: list[str] = []

    def _launch(self) -> None:
        args = [chromium_binary(), *FLAGS, f"--user-data-dir={self.profile}", "about:blank"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )

    async def __aenter__(self) -> Browser:
        await asyncio.to_thread(self._launch)
        try:
            await self._connect()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _connect(self) -> None:
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60  # a loaded machine
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} at start")
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port within 60 s")
            await asyncio.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable", session=True)

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            data = json.loads(message.data)
            future = self._pending.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif data.get("method") == "Log.entryAdded":
                entry = data["params"]["entry"]
                self.log.append(f"{entry.get('level')}: {entry.get('text')}")
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.log.append(f"exception: {details.get('exception', {}).get('description')}")
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.log.append("console: " + " ".join(str(a.get("value")) for a in args))

    async def send(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        message_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        await self._ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(future, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def js(self, expression: str) -> Any:
        """Evaluate in the page (awaiting promises); returns the value, raises on a throw."""
        result = await self.send(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_js(self, expression: str, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            await asyncio.sleep(0.1)

    async def goto(self, url: str, timeout_s: float = 60) -> None:
        await self.send("Page.navigate", session=True, url=url)
        await self.wait_js(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
            timeout_s,
            f"{url} to load",
        )

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", session=True, format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
        return path

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)
