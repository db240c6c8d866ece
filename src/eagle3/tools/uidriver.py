"""Headless Chromium driven over its DevTools protocol: open a page, click, type, screenshot.

The MLflow UI keeps chart choices (which params and metrics a comparison plots) in React state
that no URL sets, so a screenshot of a chosen comparison types them the way a user does.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

from eagle3.core.common import Eagle3Error
from eagle3.core.group_reaper import group_alive

LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Page:
    """One Chromium tab over a DevTools websocket."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse):
        self.socket = socket
        self.ids = itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        ident = next(self.ids)
        await self.socket.send_json({"id": ident, "method": method, "params": params})
        while True:
            message = json.loads((await self.socket.receive()).data)
            if message.get("id") == ident:
                if "error" in message:
                    raise Eagle3Error(f"chromium {method}: {message['error']}")
                return message.get("result", {})

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float = 60) -> None:
        """Until the JS expression is truthy (the page has rendered what comes next)."""
        deadline = time.monotonic() + timeout_s
        while not await self.evaluate(expression):
            if time.monotonic() > deadline:
                raise Eagle3Error(f"the page never showed {expression}")
            await asyncio.sleep(0.5)

    async def click(self, expression: str) -> None:
        """Click the centre of the element the JS expression returns."""
        box = await self.evaluate(
            f"(() => {{ const e = {expression}; if (!e) return null; e.scrollIntoView();"
            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        if not box:
            raise Eagle3Error(f"nothing to click: {expression}")
        for kind in ("mousePressed", "mouseReleased"):
            await self.call(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )
        await asyncio.sleep(0.5)

    async def type(self, text: str, enter: bool = True) -> None:
        await self.call("Input.insertText", text=text)
        await asyncio.sleep(0.5)
        if enter:
            for kind in ("keyDown", "keyUp"):
                await self.call(
                    "Input.dispatchKeyEvent",
                    type=kind,
                    key="Enter",
                    code="Enter",
                    windowsVirtualKeyCode=13,
                )
            await asyncio.sleep(0.5)

    async def screenshot(self, out: Path) -> Path:
        shot = await self.call("Page.captureScreenshot", format="png")
        out.write_bytes(base64.b64decode(shot["data"]))
        return out


def start_chromium(profile: Path, size: str) -> tuple[subprocess.Popen, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise Eagle3Error("chromium not found: install Debian's chromium package (make setup does)")
    width, height = size.split(",")
    proc = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its renderer and utility processes share its group: stopped together
    )
    for line in proc.stderr:
        found = LISTENING.search(line)
        if found:  # keep draining its log so it never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)
    stop_chromium(proc)
    raise Eagle3Error("chromium exited before opening its DevTools port")


def stop_chromium(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """SIGKILL Chromium's whole process group and wait (up to wait_s) until it is gone: a renderer or
    utility process left running would go on writing into the profile folder while it is removed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + wait_s
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


async def _session(browser_ws: str, size: str, script) -> None:
    port = re.search(r":(\d+)/", browser_ws).group(1)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        async with session.ws_connect(page_ws, max_msg_size=0) as socket:
            page = Page(socket)
            width, height = (int(v) for v in size.split(","))
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            await script(page)


def drive(script, size: str = "1600,1000") -> None:
    """Run `async script(page)` against a fresh headless Chromium, which is stopped after."""
    with tempfile.TemporaryDirectory(prefix="eagle3-chromium-") as profile:
        proc, browser_ws = start_chromium(Path(profile), size)
        try:
            asyncio.run(_session(browser_ws, size, script))
        finally:
            stop_chromium(proc)
