"""A small Chrome DevTools Protocol client: Debian's chromium, headless, driven over a websocket.

Playwright's browser download is not available here; the protocol itself is enough for what the
inspector's tests need: open a page, evaluate script, wait for a condition, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import threading
import urllib.request
from typing import TYPE_CHECKING, Any

import websockets

if TYPE_CHECKING:
    from pathlib import Path

    from websockets.asyncio.client import ClientConnection


def chromium_path() -> str | None:
    """The system chromium, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """A headless chromium process with its DevTools endpoint on a free loopback port."""

    def __init__(self, executable: str, profile: Path) -> None:
        self.process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--hide-scrollbars",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.http = self._endpoint(timeout=30)

    def _endpoint(self, timeout: float) -> str:
        found: list[str] = []
        done = threading.Event()

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                match = re.search(r"DevTools listening on ws://([^/]+)/", line)
                if match and not found:
                    found.append(match.group(1))
                    done.set()
            done.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not done.wait(timeout) or not found:
            self.close()
            raise RuntimeError("chromium did not start its DevTools endpoint")
        return f"http://{found[0]}"

    def new_target(self) -> str:
        """Open a blank tab; return its websocket address."""
        address = f"{self.http}/json/new?about:blank"
        request = urllib.request.Request(address, method="PUT")  # noqa: S310  # http on loopback
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return str(json.load(response)["webSocketDebuggerUrl"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.reader.join(10)
        if self.process.stderr is not None:
            self.process.stderr.close()


class Page:
    """One tab: send protocol commands, evaluate script, wait for conditions."""

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[str] = []
        self.dialogs: list[str] = []
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, browser: Chromium, *, width: int = 1000, height: int = 640) -> Page:
        connection = await websockets.connect(browser.new_target(), max_size=2**26)
        page = cls(connection)
        await page.send("Page.enable")
        await page.send("Page.bringToFront")
        await page.send("Runtime.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return page

    async def _read(self) -> None:
        async for raw in self.connection:
            message = json.loads(raw)
            if "id" in message:
                future = self.waiting.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif message.get("method") == "Runtime.exceptionThrown":
                self.console.append(str(message["params"]["exceptionDetails"]))
            elif message.get("method") == "Page.javascriptDialogOpening":
                # confirm() before a delete: accept it, as the user would.
                self.dialogs.append(message["params"]["message"])
                await self.connection.send(
                    json.dumps(
                        {
                            "id": next(self.ids),
                            "method": "Page.handleJavaScriptDialog",
                            "params": {"accept": True},
                        }
                    )
                )
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the DevTools connection closed"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[number] = future
        await self.connection.send(json.dumps({"id": number, "method": method, "params": params}))
        message = await asyncio.wait_for(future, 30)
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        return dict(message.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        """The value of `expression` (awaited if it is a promise)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise AssertionError(f"{expression!r} raised in the page: {text}")
        return result["result"].get("value")

    async def wait_for(self, condition: str, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        """Wait (in the page) until `condition` is truthy; return its value.

        The deadline is kept by the page itself, so it measures what the page saw.
        """
        milliseconds = int(timeout * 1000)
        return await self.evaluate(
            "new Promise((resolve, reject) => {"
            " const start = performance.now();"
            " const check = () => {"
            "  let value; try { value = (" + condition + "); } catch (e) { value = undefined; }"
            "  if (value) return resolve(value);"
            f"  if (performance.now() - start > {milliseconds})"
            "   return reject(new Error('timed out waiting for: ' + "
            + json.dumps(condition)
            + "));"
            "  setTimeout(check, 10);"
            " };"
            " check();"
            "})"
        )

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.body && document.body.dataset.ready === '1'", 20)

    async def click(self, selector: str) -> None:
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")

    async def type_into(self, selector: str, text: str) -> None:
        await self.evaluate(
            f"(() => {{ const node = document.querySelector({json.dumps(selector)});"
            f" node.value = {json.dumps(text)}; return true; }})()"
        )

    async def screenshot(self, path: Path) -> int:
        """Save a PNG of the viewport; return its size in bytes."""
        data = base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])
        path.write_bytes(data)  # noqa: ASYNC240  # a test helper, one small file
        return len(data)

    async def close(self) -> None:
        await self.connection.close()
        await self.reader
