"""The MLflow UI as a user sees it: `python -m eagle3.tools.ui` serves the configured store on
127.0.0.1, and the helpers below let tests and the pipeline check it through the REST API and
take a headless-Chromium screenshot of the runs comparison."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx

from eagle3.core import tracking
from eagle3.core.common import Eagle3Error, app
from eagle3.core.config import Config
from eagle3.core.lifecycle import run_child
from eagle3.serve.launch import EngineProcess, Launch, free_port

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--hide-scrollbars",
]


def server_command(uri: str, artifact_root: str, host: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--default-artifact-root",
        artifact_root,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


@contextlib.contextmanager
def mlflow_server(
    uri: str, artifact_root: str, log_path: Path, timeout_s: float = 120
) -> Iterator[str]:
    """An MLflow server on a free loopback port for the duration of the block; yields its base URL.
    Started, health-polled and stopped like any engine (its own process group)."""
    port = free_port("127.0.0.1")
    launch = Launch(
        "mlflow", server_command(uri, artifact_root, "127.0.0.1", port), {}, "127.0.0.1", port
    )
    with EngineProcess(launch, log_path.parent, name=log_path.stem) as server:
        server.wait_healthy(timeout_s)
        yield server.base_url


def search_runs(url: str, experiment_ids: list[str]) -> list[dict]:
    """All runs of these experiments through the REST API."""
    response = httpx.post(
        f"{url}/api/2.0/mlflow/runs/search",
        json={"experiment_ids": experiment_ids, "max_results": 1000},
        timeout=30,
    )
    response.raise_for_status()
    return response.json().get("runs", [])


def list_artifacts(url: str, run_id: str, path: str = "") -> list[str]:
    response = httpx.get(
        f"{url}/api/2.0/mlflow/artifacts/list", params={"run_id": run_id, "path": path}, timeout=30
    )
    response.raise_for_status()
    return [f["path"] for f in response.json().get("files", [])]


def compare_url(url: str, experiment_id: str, run_ids: list[str]) -> str:
    runs = ",".join(f'"{r}"' for r in run_ids)
    return f'{url}/#/compare-runs?runs=[{runs}]&experiments=["{experiment_id}"]'


def screenshot(page_url: str, out: Path, size: str = "1600,1000", budget_ms: int = 15000) -> Path:
    """A PNG of the page rendered by headless Chromium (Debian's `chromium`)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise Eagle3Error("chromium not found: install Debian's chromium package (make setup does)")
    out.parent.mkdir(parents=True, exist_ok=True)
    profile = out.parent / ".chromium-profile"
    cmd = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--window-size={size}",
        f"--virtual-time-budget={budget_ms}",
        f"--screenshot={out}",
        page_url,
    ]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    shutil.rmtree(profile, ignore_errors=True)
    if not out.exists() or out.stat().st_size == 0:
        raise Eagle3Error(f"chromium wrote no screenshot for {page_url}")
    return out


SCROLL_TO_TOP = (
    "document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; });"
    " window.scrollTo(0, 0)"
)
COMPARED_METRICS = ("tokens_per_s", "accept_length", "speedup")  # tok/s, tau, speedup


def select_by_typing(label: str) -> str:
    """JS: the search box of the multi-select that follows the text `label` (e.g. 'Metrics:')."""
    return (
        "[...document.querySelectorAll('div')].find(d => d.textContent === "
        f"{label!r} && d.nextElementSibling)?.nextElementSibling"
        ".querySelector('.du-bois-light-select-selector')"
    )


def comparison_screenshot(
    url: str,
    experiment_id: str,
    run_ids: list[str],
    out: Path,
    param: str = "job.spec",
    metrics: tuple[str, ...] = COMPARED_METRICS,
    size: str = "1600,1000",
) -> Path:
    """The runs comparison as a user sets it up: the model-training view, the assistant panel
    closed, a parallel-coordinates plot of `param` against `metrics`; a PNG of the page."""
    import asyncio

    from eagle3.tools.uidriver import drive

    page_url = compare_url(url, experiment_id, run_ids)

    async def script(page) -> None:
        await page.call("Page.navigate", url=page_url)
        await page.wait_for("document.body.innerText.includes('Clear All')")
        close = (
            "document.querySelector('[data-component-id=\"mlflow.assistant.chat_panel.close\"]')"
        )
        if await page.evaluate(f"!!{close}"):
            await page.click(close)
        training = "[...document.querySelectorAll('[role=button]')].find(b => b.textContent === 'Model training')"
        if await page.evaluate(f"!!{training}"):
            await page.click(training)
            await page.wait_for("document.body.innerText.includes('Clear All')")
        await page.click("document.querySelector('[data-testid=clear-button]')")
        await page.click(select_by_typing("Parameters:"))
        await page.type(param)
        await page.click(select_by_typing("Metrics:"))
        for metric in metrics:
            await page.type(metric)
        title = (
            "[...document.querySelectorAll('*')]"
            ".filter(e => e.textContent.startsWith('Comparing ')).pop()"
        )
        await page.click(title)  # closes the open dropdown
        await page.wait_for("document.querySelector('.parcoords') !== null", timeout_s=120)
        await page.evaluate(SCROLL_TO_TOP)
        await asyncio.sleep(2)
        await page.screenshot(out)

    out.parent.mkdir(parents=True, exist_ok=True)
    drive(script, size)
    return out


def newest_sweep(url: str, experiment_id: str) -> list[str]:
    """The child run ids of the newest bench sweep in the experiment."""
    runs = search_runs(url, [experiment_id])
    tags = {
        r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs
    }
    parents = sorted(
        (r for r in runs if tags[r["info"]["run_id"]].get("stage") == "bench-sweep"),
        key=lambda r: int(r["info"]["start_time"]),
    )
    if not parents:
        raise Eagle3Error(
            f"no bench sweep in experiment {experiment_id}: run `python -m eagle3.bench -m ...`"
        )
    parent = parents[-1]["info"]["run_id"]
    return [run for run, tag in tags.items() if tag.get("mlflow.parentRunId") == parent]


@app
def main(cfg: Config) -> None:
    """Serve the configured MLflow store in the foreground until Ctrl-C; with
    tracking.ui_screenshot=<png>, screenshot the newest sweep's comparison instead and exit."""

    experiment_id = tracking.setup(cfg.tracking)
    artifacts = str(Path(cfg.tracking.artifact_location).resolve().as_uri())
    if cfg.tracking.ui_screenshot:
        out = Path(cfg.tracking.ui_screenshot).resolve()
        with (
            tempfile.TemporaryDirectory(prefix="eagle3-ui-") as logs,
            mlflow_server(cfg.tracking.uri, artifacts, Path(logs) / "mlflow.log") as url,
        ):
            comparison_screenshot(url, experiment_id, newest_sweep(url, experiment_id), out)
        print(f"screenshot: {out}")
        return
    cmd = server_command(cfg.tracking.uri, artifacts, cfg.tracking.ui_host, cfg.tracking.ui_port)
    print(f"MLflow UI on http://{cfg.tracking.ui_host}:{cfg.tracking.ui_port} (Ctrl-C stops it)")
    run_child(cmd, cfg.serve.stop_timeout_s, cfg.serve.watchdog_poll_s)


if __name__ == "__main__":
    main()
